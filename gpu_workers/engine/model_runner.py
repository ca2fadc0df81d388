"""Loads the model, owns the KV cache tensor, and turns a scheduled batch into one
forward pass that returns logits for the rows that sample."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.placement import placement
from plurai.gpu_workers.engine.sequence import Sequence
from plurai.gpu_workers.kernels import load as load_kernels
from plurai.gpu_workers.layers.attention import AttnContext, Prefill, use_flash
from plurai.gpu_workers.models.loader import build_model, load_config, resolve_dtype

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.hf_config = cfg = load_config(config.model)
        self.tp, self.stage = placement(config, rank, cfg.num_hidden_layers)
        self.world = config.tensor_parallel * config.pipeline_parallel
        dev = config.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        if dev == "cuda" and self.world > 1:
            dev = f"cuda:{rank}"
        self.device = torch.device(dev)
        if config.threads:
            torch.set_num_threads(config.threads)
        elif self.world > 1 and self.device.type == "cpu":  # the ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world))
        self.dtype = resolve_dtype(config.dtype, cfg, self.device)
        self.max_model_len = self._max_model_len(cfg)
        self.ops = self._kernels()
        self.model = build_model(
            config.model,
            cfg,
            self.dtype,
            self.device,
            self.max_model_len,
            self.tp,
            self.stage,
            self.ops,
        )
        self.vocab_size = cfg.vocab_size
        self.block_size = config.block_size
        self.flash = use_flash(self.device, self.block_size)
        self.num_blocks = self._allocate_cache()
        self.scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        # False on rank 0 from the broadcast of a step until its run is done with the other
        # ranks: a run that fails then has left them mid-step, and the group cannot go on
        self.in_lockstep = True
        capacity = self.num_blocks * self.block_size
        if capacity < self.max_model_len:
            log.warning(
                "KV cache holds %d tokens; max_model_len lowered from %d",
                capacity,
                self.max_model_len,
            )
            self.max_model_len = capacity

    def _kernels(self):
        """The fused CPU kernels, or None for the torch path (see plurai.gpu_workers.kernels)."""
        mode = self.config.kernels
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
            if mode == "native":
                raise ValueError(
                    "kernels=native: the native kernels are CPU kernels for fp32 and bf16"
                )
            return None
        return load_kernels(mode)

    def _max_model_len(self, cfg) -> int:
        limit = cfg.max_position_embeddings
        window = getattr(cfg, "sliding_window", None)
        if window and getattr(cfg, "use_sliding_window", True):
            # full attention equals the model's sliding window only up to the window's length
            limit = min(limit, window)
        want = self.config.max_model_len
        if want is not None and want > limit:
            raise ValueError(f"max_model_len {want} exceeds what the model supports ({limit})")
        return want or limit

    def _allocate_cache(self) -> int:
        layers = len(self.model.layers)  # this stage's layers only
        attn = self.model.layers[0].self_attn
        per_block = (
            2
            * layers
            * self.block_size
            * attn.num_kv_heads
            * attn.head_dim
            * torch.empty(0, dtype=self.dtype).element_size()
        )
        n = self.config.num_kv_blocks
        if n is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.gpu_memory_utilization)
            else:
                budget = self.config.kv_cache_bytes
            n = max(1, budget // per_block)
        if self.world > 1:  # block ids are shared by the ranks: agree on one count
            agreed = torch.tensor([n])
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            n = int(agreed.item())
        self.kv_cache = torch.zeros(
            2,
            layers,
            attn.num_kv_heads,
            n,
            self.block_size,
            attn.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        for i, layer in enumerate(self.model.attention_layers()):
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]
        return n

    def prepare(
        self, seqs: list[Sequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttnContext, list[list[int]]]:
        """Inputs for one step. Decodes are laid out first, then prefill chunks. A decode
        with proposed tokens (speculator.py) is a decode row per token, each attending to
        the cache up to itself: the proposals' K/V are written before attention reads it,
        so row j sees the tokens before it, as a causal chunk would. Per sequence, the rows
        whose logits it samples from: its last row once its chunk reaches its end, and one
        per proposed token before that; none for a prefill chunk short of the end."""
        bs = self.block_size
        decodes, prefills = split(seqs)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[list[int]] = []
        for s in decodes + prefills:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled
            ids += s.token_ids[start:end]
            pos += range(start, end)
            bt = s.block_table
            slots += [bt[p // bs] * bs + p % bs for p in range(start, end)]
            n = 1 + s.num_draft if end == len(s) else 0
            sample_rows.append(list(range(len(ids) - n, len(ids))))
        dev = self.device
        # a row per decode token: its sequence and the tokens it attends to
        rows = [(s, s.num_computed_tokens + j + 1) for s in decodes for j in range(s.num_scheduled)]
        ctx = AttnContext(slot_mapping=torch.tensor(slots, device=dev), num_decode=len(rows))
        if self.flash:
            self._flash_inputs(ctx, decodes + prefills)
        else:
            if decodes:
                lens = [n for _, n in rows]
                width = -(-max(lens) // bs)
                table = [
                    s.block_table[:width] + [0] * (width - len(s.block_table[:width]))
                    for s, _ in rows
                ]
                ctx.decode_blocks = torch.tensor(table, device=dev)
            if decodes and self.ops is not None:  # read in place: no mask, no gather
                ctx.decode_lens = torch.tensor(lens, device=dev)
            elif decodes:
                pad = (
                    torch.arange(width * bs, device=dev)[None, :]
                    >= torch.tensor(lens, device=dev)[:, None]
                )
                ctx.decode_bias = torch.zeros(pad.shape, device=dev).masked_fill_(
                    pad, float("-inf")
                )[None, :, None]
            gathered = [len(s.block_table) for s in prefills if s.num_computed_tokens]
            if decodes and self.ops is None:
                gathered.append(ctx.decode_blocks.numel())
            if gathered:
                ctx.scratch = self._scratch(max(gathered))
            row = len(rows)
            for s in prefills:
                context = s.num_computed_tokens + s.num_scheduled
                blocks = None
                if s.num_computed_tokens:
                    blocks = torch.tensor(s.block_table[: -(-context // bs)], device=dev)
                ctx.prefills.append(Prefill(row, s.num_scheduled, context, blocks))
                row += s.num_scheduled
        input_ids = torch.tensor(ids, device=dev)
        positions = torch.tensor(pos, device=dev)
        return input_ids, positions, ctx, sample_rows

    def _scratch(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather buffers for `num_blocks` blocks, grown (doubled) only when too small."""
        need = num_blocks * self.kv_cache[0, 0, :, 0].numel()
        if self.scratch is None or self.scratch[0].numel() < need:
            size = max(need, 2 * self.scratch[0].numel() if self.scratch is not None else 0)
            self.scratch = (
                torch.empty(size, dtype=self.dtype, device=self.device),
                torch.empty(size, dtype=self.dtype, device=self.device),
            )
        return self.scratch

    def _flash_inputs(self, ctx: AttnContext, seqs: list[Sequence]) -> None:
        q_lens = [s.num_scheduled for s in seqs]
        k_lens = [s.num_computed_tokens + s.num_scheduled for s in seqs]
        width = max(len(s.block_table) for s in seqs)
        dev = self.device
        ctx.cu_q = torch.tensor(
            [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev
        )
        ctx.cu_k = torch.tensor(
            [0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev
        )
        ctx.max_q, ctx.max_k = max(q_lens), max(k_lens)
        ctx.block_table = torch.tensor(
            [s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
            dtype=torch.int32,
            device=dev,
        )

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """One forward; returns the sequences that sample now, in order, and their logits
        [rows, vocab]: 1 + num_draft rows each (on rank 0; other ranks return what they
        computed, which nobody uses).

        With pipeline stages the step is cut into micro-batches (one per stage, at most one
        per sequence): a stage sends each micro-batch on as soon as it is done and goes on
        with the next, so the stages work at the same time.

        With `fault_token_id` set (a test hook), a run raises once it is done if a
        sequence's prompt holds that token: after the forward, so the ranks stay in step."""
        fault = self.config.fault_token_id
        faulty = (
            fault is not None
            and self.rank == 0
            and any(fault in s.token_ids[: s.num_prompt_tokens] for s in seqs)
        )
        count = min(self.stage.count, len(seqs))
        batches = [seqs[i::count] for i in range(count)]
        sends: list = []
        results = []
        for batch in batches:
            logits, sampling, send = self._run_batch(batch)
            sends += send
            results.append((logits, sampling))
        if self.rank == 0 and self.stage.count > 1:  # the last stage's first rank sends the logits
            for logits, sampling in results:
                if sampling:
                    dist.recv(logits, src=(self.stage.count - 1) * self.tp.size)
        for work, _tensor in sends:
            work.wait()
        self.in_lockstep = True
        if faulty:
            raise RuntimeError(f"injected fault: token {fault} is in a prompt of this batch")
        sampling = [s for _, batch_sampling in results for s in batch_sampling]
        if len(results) == 1:
            return results[0]
        return torch.cat([lg for lg, _ in results]), sampling

    def _run_batch(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[Sequence], list]:
        input_ids, positions, ctx, rows = self.prepare(seqs)
        hidden = None
        if not self.stage.first:  # the previous stage's output for the same tokens
            hidden = torch.empty(
                len(input_ids), self.hf_config.hidden_size, dtype=self.dtype, device=self.device
            )
            dist.recv(hidden, src=self.rank - self.tp.size)
        out = self.model(input_ids, positions, ctx, hidden)
        decodes, prefills = split(seqs)
        order = decodes + prefills
        picked = [(rs, s) for rs, s in zip(rows, order, strict=True) if rs]
        sampling = [s for _, s in picked]
        flat = [r for rs, _ in picked for r in rs]
        logits = torch.empty(len(flat), self.vocab_size, device=self.device)
        if not self.stage.last:
            out = out.contiguous()  # kept alive with its send until the send completes
            return logits, sampling, [(dist.isend(out, dst=self.rank + self.tp.size), out)]
        sends = []
        if flat:
            logits = self.model.logits(out[torch.tensor(flat, device=self.device)])
            if self.stage.count > 1 and self.tp.rank == 0:
                sends.append((dist.isend(logits, dst=0), logits))
        return logits, sampling, sends


def split(seqs: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """A step's decodes (one token, or one and its proposals) and prefill chunks."""
    decodes = [s for s in seqs if s.num_scheduled == 1 + s.num_draft]
    return decodes, [s for s in seqs if s.num_scheduled != 1 + s.num_draft]
