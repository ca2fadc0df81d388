"""Tensor and pipeline parallelism across processes (torch.distributed: gloo on CPU,
NCCL on CUDA). Global rank = stage * tensor_parallel + tensor-parallel rank.

Rank 0 is the engine: it schedules, and before each forward it broadcasts the step (for
every scheduled sequence: computed and scheduled token counts, length, the scheduled
tokens, the block table) as one int64 tensor. Ranks 1..N-1 run `python -m
gpu_workers.engine.parallel`, rebuild the same inputs from it and join the forward: inside
a stage, sharded layers meet in all-reduces; between stages, hidden states go from each
rank to the same tensor-parallel rank of the next stage, and the last stage sends the
logits to rank 0, the only one that samples. No pickle crosses the wire. If any
rank dies, the others' next collective fails and the engine raises, so a worker group stops
as a whole.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpu_workers.engine.config import EngineConfig

STOP = -1


@dataclass
class TP:
    """This process's place in its stage's tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the stage's process group (None: the whole world)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass
class Stage:
    """This process's pipeline stage: a contiguous range of the model's layers."""

    index: int = 0
    count: int = 1
    layers: tuple[int, int] = (0, 0)  # [first, end) of the layers held here

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def split_layers(
    num_layers: int, stages: int, custom: list[int] | None = None
) -> list[tuple[int, int]]:
    """Layer ranges per stage: even (earlier stages take the remainder), or `custom` counts."""
    counts = custom or [num_layers // stages + (i < num_layers % stages) for i in range(stages)]
    if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"pipeline split {counts} does not cover {num_layers} layers in {stages} stages"
        )
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def placement(config: EngineConfig, rank: int, num_layers: int) -> tuple[TP, Stage]:
    """Global rank -> (tensor-parallel place, pipeline stage). Rank = stage * tp + tp_rank."""
    tp, pp = config.tensor_parallel, config.pipeline_parallel
    stage = rank // tp
    group = None
    if dist.is_initialized() and pp > 1:
        # every process creates every stage's group, in the same order
        for s in range(pp):
            g = dist.new_group(list(range(s * tp, (s + 1) * tp)))
            if s == stage:
                group = g
    ranges = split_layers(num_layers, pp, config.pipeline_layers)
    return TP(rank % tp, tp, group), Stage(stage, pp, ranges[stage])


@dataclass
class StepSeq:
    """What a non-zero rank needs of a scheduled sequence to build the same inputs."""

    token_ids: list[int]
    num_computed_tokens: int
    num_scheduled: int
    block_table: list[int] = field(default_factory=list)

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
            len(s.block_table),
            *s.token_ids[start : start + n],
            *s.block_table,
        ]
    return torch.tensor(out, dtype=torch.int64)


def decode_step(data: list[int]) -> list[StepSeq]:
    seqs, i = [], 1
    for _ in range(data[0]):
        start, n, length, nb = data[i : i + 4]
        i += 4
        tokens = [0] * length
        tokens[start : start + n] = data[i : i + n]
        i += n
        seqs.append(StepSeq(tokens, start, n, data[i : i + nb]))
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


def _init(rank: int, size: int, port: int, device: str) -> None:
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
                    "gpu_workers.engine.parallel",
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
        _init(0, self.size, port, config.device)

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


def main() -> None:
    ap = argparse.ArgumentParser(description="one non-zero rank of a tensor-parallel engine")
    ap.add_argument("--config", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    config = EngineConfig(**json.loads(a.config))
    _init(a.rank, a.size, a.port, config.device)
    from gpu_workers.engine.model_runner import ModelRunner

    runner = ModelRunner(config, a.rank)
    while (seqs := recv_step()) is not None:
        runner.run(seqs)  # type: ignore[arg-type]
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
