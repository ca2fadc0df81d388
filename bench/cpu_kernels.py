"""What each fused CPU kernel (gpu_workers/kernels) gains, alone and in place.

Alone: each kernel against the torch ops it replaces, at the bench model's shapes, for a
decode step of 2 and of 32 sequences (~230 cached tokens each; decode attention takes the
layers' caches in turn, so it reads from memory as in a step) and a 512-token prefill
chunk (medians of many calls).
In place: the throughput workload through the engine with every kernel, then with one
kernel at a time swapped for its torch equivalent (same call, torch ops inside), then on
the pure-torch path; medians of --runs runs, interleaved.
The last line is one JSON object.
--smoke: the same on the tiny test model's shapes, two short requests, one run: a check
that the bench runs, not a measurement.

    python bench/cpu_kernels.py [--requests 32] [--runs 3] [--dtype fp32] [--smoke]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from plurai.gpu_workers.backend import AddRequest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.step_profile import median_time  # noqa: E402
from bench.workload import (  # noqa: E402
    SMOKE_KV_BYTES,
    add_smoke_arg,
    add_workload_args,
    bench_model,
    cpu_isa,
    json_line,
    mixed,
    smoke_model,
)
from plurai.gpu_workers.layers.attention import AttnContext, PagedAttention  # noqa: E402
from plurai.gpu_workers.layers.rotary import apply_rotary  # noqa: E402

KERNELS = ("rms_norm", "silu_mul", "rotary_cache", "paged_decode")


# torch equivalents with the kernels' signatures: what the engine ran before them
def torch_rms_norm(x, residual, weight, eps):
    if residual is not None:
        residual.add_(x)
        x = residual
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def torch_silu_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_rotary_cache(q, k, v, cos, sin, k_cache, v_cache, slots):
    q.copy_(apply_rotary(q, cos, sin))
    k.copy_(apply_rotary(k, cos, sin))
    for cache, new in ((k_cache, k), (v_cache, v)):
        cache.view(cache.shape[0], -1, cache.shape[-1]).index_copy_(1, slots, new.transpose(0, 1))


def torch_paged_decode(q, k_cache, v_cache, tables, lens, scale):
    """The engine's torch decode path (gathered K, V read by embedding_bag), fed the
    padding mask that the model runner builds for it."""
    hk, _, bs, d = k_cache.shape
    attn = PagedAttention(q.shape[1], hk, d, scale)
    attn.k_cache, attn.v_cache = k_cache, v_cache
    pad = torch.arange(tables.shape[1] * bs)[None, :] >= lens[:, None]
    bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))[None, :, None]
    ctx = AttnContext(
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_decode=q.shape[0],
        decode_blocks=tables,
        decode_bias=bias,
    )
    return attn._decode(q, ctx)


TORCH = {
    "rms_norm": torch_rms_norm,
    "silu_mul": torch_silu_mul,
    "rotary_cache": torch_rotary_cache,
    "paged_decode": torch_paged_decode,
}


def median_us(fn: Callable[[], object], runs: int = 61) -> float:
    return round(median_time(fn, runs=runs) * 1e6, 1)


def alone(ops, cfg, dtype: torch.dtype, runs: int = 61) -> dict:
    """Microseconds per call, kernel and torch, at decode (2 and 32 rows) and prefill."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    hq, hk = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.head_dim
    bs, context = 16, 230
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    out: dict = {}
    for rows in (2, 32, 512):
        x, res, w = rand(rows, hidden), rand(rows, hidden), rand(hidden)
        gate_up = rand(rows, 2 * inter)
        qkv = rand(rows, (hq + 2 * hk) * d)
        cos, sin = rand(rows, 1, d), rand(rows, 1, d)
        blocks = max(64, rows * -(-context // bs))
        k_cache, v_cache = rand(hk, blocks, bs, d), rand(hk, blocks, bs, d)
        slots = torch.randperm(blocks * bs, generator=gen)[:rows]

        def qkv_views(t=qkv, rows=rows):
            return [a.view(rows, -1, d) for a in t.split([hq * d, hk * d, hk * d], dim=-1)]

        calls = {
            "rms_norm": lambda impl, x=x, res=res, w=w: impl(x, res.clone(), w, 1e-6),
            "silu_mul": lambda impl, g=gate_up: impl(g),
            "rotary_cache": lambda impl, cs=(cos, sin), kc=k_cache, vc=v_cache, s=slots: impl(
                *qkv_views(), *cs, kc, vc, s
            ),
        }
        if rows <= 32:  # decode attention: one query row per sequence
            width = -(-context // bs)
            tables = torch.randperm(blocks, generator=gen)[: rows * width].view(rows, width)
            lens = torch.full((rows,), context)
            q = rand(rows, hq, d)
            # one cache per layer, taken in turn, as a step reads them: together larger
            # than the L3 cache, as in the engine, where the reads come from memory
            layers = itertools.cycle(
                [
                    (rand(hk, blocks, bs, d), rand(hk, blocks, bs, d))
                    for _ in range(cfg.num_hidden_layers)
                ]
            )
            calls["paged_decode"] = lambda impl, q=q, t=tables, n=lens, layers=layers: impl(
                q, *next(layers), t, n, d**-0.5
            )
        for name, call in calls.items():
            native = median_us(lambda call=call, name=name: call(getattr(ops, name)), runs)
            ref = median_us(lambda call=call, name=name: call(TORCH[name]), runs)
            out[f"{name}@{rows}"] = {
                "kernel_us": native,
                "torch_us": ref,
                "speedup": round(ref / native, 2),
            }
    return out


def run_engine(model: Path, reqs, dtype: str, ops, kv_bytes: int | None = None) -> float:
    """kv_bytes: the engine's KV budget (None: the default)."""
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig
    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    kv = {"kv_cache_bytes": kv_bytes} if kv_bytes else {}
    engine = Engine(EngineConfig(model=str(model), dtype=dtype, kernels="torch", **kv))
    if ops is not None:  # the same engine with these ops set on every layer
        for m in engine.runner.model.modules():
            if hasattr(m, "ops"):
                m.ops = ops
        engine.runner.ops = ops
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4))  # warm-up
    for i, r in enumerate(reqs):
        engine.add(
            AddRequest(
                f"k{i}",
                token_ids=r.prompt,
                params=SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
            ),
        )
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(ap)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--runs", type=int, default=3)
    add_smoke_arg(ap)
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.runs = 2, 1

    from transformers import AutoConfig

    from plurai.gpu_workers import kernels

    ops = kernels.build()
    model = smoke_model() if args.smoke else bench_model(args.model)
    cfg = AutoConfig.from_pretrained(str(model))
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    result: dict = {
        "bench": "kernels",
        "isa": cpu_isa(),
        "build_isa": kernels.build_isa(),
        "dtype": args.dtype,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "threads": torch.get_num_threads(),
    }
    with torch.inference_mode():
        result["alone"] = alone(ops, cfg, dtype, runs=5 if args.smoke else 61)
    for key, fig in result["alone"].items():
        print(
            f"{key:18} kernel {fig['kernel_us']:9.1f} us   torch {fig['torch_us']:9.1f} us   x{fig['speedup']}"
        )

    lengths = {"prompt_median": 16, "output_median": 8} if args.smoke else {}
    reqs = mixed(args.requests, cfg.vocab_size, args.seed, **lengths)
    useful = sum(r.max_tokens for r in reqs)
    configs: dict[str, object] = {"all_kernels": ops}
    for name in KERNELS:  # everything but `name`
        configs[f"without_{name}"] = SimpleNamespace(
            **{k: TORCH[k] if k == name else getattr(ops, k) for k in KERNELS}
        )
    configs["torch_path"] = None
    times: dict[str, list[float]] = {k: [] for k in configs}
    for run in range(args.runs):
        for name, config in configs.items():
            t = run_engine(model, reqs, args.dtype, config, SMOKE_KV_BYTES if args.smoke else None)
            times[name].append(t)
            print(f"run {run + 1}: {name:22} {useful / t:7.1f} useful tok/s", flush=True)
    tok_s = {k: round(useful / sorted(v)[len(v) // 2], 1) for k, v in times.items()}
    result["in_place_tok_s"] = tok_s
    # what each kernel adds to the whole: all kernels over all-but-that-one
    result["in_place_gain"] = {
        name: round(tok_s["all_kernels"] / tok_s[f"without_{name}"], 3) for name in KERNELS
    }
    result["all_over_torch"] = round(tok_s["all_kernels"] / tok_s["torch_path"], 3)
    json_line(result, args.smoke)


if __name__ == "__main__":
    main()
