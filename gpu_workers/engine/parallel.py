"""Tensor and pipeline parallelism across processes (torch.distributed: gloo on CPU,
NCCL on CUDA). Global rank = stage * tensor_parallel + tensor-parallel rank.

Rank 0 is the engine: it schedules, and before each forward it broadcasts the step (for
every scheduled sequence: computed and scheduled token counts, length, the scheduled
tokens, the block table) as one int64 tensor. Ranks 1..N-1 run `python -m
gpu_workers.engine.rank`, rebuild the same inputs from it and join the forward: inside
a stage, sharded layers meet in all-reduces; between stages, hidden states go from each
rank to the same tensor-parallel rank of the next stage, and the last stage sends the
logits to rank 0, the only one that samples. No pickle crosses the wire. If any
rank dies, the others' next collective fails and the engine raises, so a worker group stops
as a whole.

A process's place in the group (`TP`, `Stage`, the layer split) is `placement.py`, a
leaf that the model builds on; this module imports nothing of the model.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from plurai.gpu_workers.engine.config import EngineConfig

STOP = -1


@dataclass
class StepSeq:
    """What a non-zero rank needs of a scheduled sequence to build the same inputs."""

    token_ids: list[int]
    num_computed_tokens: int
    num_scheduled: int
    block_table: list[int] = field(default_factory=list)
    num_draft: int = 0  # proposed tokens at the end (the last stage gives their logits)

    def __len__(self) -> int:
        return len(self.token_ids)


def encode_step(seqs: list) -> torch.Tensor:
    out = [len(seqs)]
    for s in seqs:
        start, n = s.num_computed_tokens, s.num_scheduled
        out += [
            start,
            n,
            len(s),
            s.num_draft,
            len(s.block_table),
            *s.token_ids[start : start + n],
            *s.block_table,
        ]
    return torch.tensor(out, dtype=torch.int64)


def decode_step(data: list[int]) -> list[StepSeq]:
    seqs, i = [], 1
    for _ in range(data[0]):
        start, n, length, draft, nb = data[i : i + 5]
        i += 5
        tokens = [0] * length
        tokens[start : start + n] = data[i : i + n]
        i += n
        seqs.append(
            StepSeq(
                token_ids=tokens,
                num_computed_tokens=start,
                num_scheduled=n,
                block_table=data[i : i + nb],
                num_draft=draft,
            )
        )
        i += nb
    return seqs


def send_step(payload: torch.Tensor | None) -> None:
    """Rank 0: broadcast one step (None: stop)."""
    size = torch.tensor([STOP if payload is None else payload.numel()], dtype=torch.int64)
    dist.broadcast(size, src=0)
    if payload is not None:
        dist.broadcast(payload, src=0)


def recv_step() -> list[StepSeq] | None:
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0)
    if size.item() == STOP:
        return None
    payload = torch.empty(int(size.item()), dtype=torch.int64)
    dist.broadcast(payload, src=0)
    return decode_step(payload.tolist())


def init_process_group(rank: int, size: int, port: int, device: str) -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=120),
    )


class Group:
    """Rank 0's handle on the other ranks' processes."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = config.tensor_parallel * config.pipeline_parallel
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = json.dumps(asdict(config))
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "plurai.gpu_workers.engine.rank",
                    "--config",
                    cfg,
                    "--rank",
                    str(r),
                    "--size",
                    str(self.size),
                    "--port",
                    str(port),
                ]
            )
            for r in range(1, self.size)
        ]
        init_process_group(0, self.size, port, config.device)

    def check(self) -> None:
        for r, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {r} exited with code {p.returncode}")

    def close(self) -> None:
        try:
            if all(p.poll() is None for p in self.procs):
                send_step(None)
        finally:
            for p in self.procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            dist.destroy_process_group()
