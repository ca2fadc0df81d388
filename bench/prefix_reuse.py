"""Prefix reuse across the KV tiers.

1. TTFT of one request with a long shared prefix (--prefix tokens) plus a short suffix:
   cold (nothing cached), device hit (same engine, prefix still on the device), host hit
   (prefix pushed out of the device into the host tier), and Redis hit (a second engine
   with an empty device cache and no host tier, like a freshly started worker, loading
   the prefix that the first engine wrote through to Redis). Medians of --repeats runs,
   each with a new suffix.
2. Throughput of a multi-turn workload (conversations sharing one system prompt, each
   turn resending the history) with a device cache too small to keep every
   conversation, with the host and Redis tiers off and on.
The last line is one JSON object of the measured figures and ratios. --smoke: every tier
once on the tiny test model, a 128-token prefix, two chats of two turns: a check that the
bench runs, not a measurement.

    python bench/prefix_reuse.py [--model DIR] [--prefix 1536] [--repeats 5] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis

from plurai.gpu_workers.backend import AddRequest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workload import add_smoke_arg, bench_model, json_line, smoke_model  # noqa: E402
from plurai.broker_config.embedded import EmbeddedRedis  # noqa: E402
from plurai.gpu_workers.engine.engine import Engine, EngineConfig  # noqa: E402
from plurai.gpu_workers.engine.sampling_params import SamplingParams  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def ttft(engine: Engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.add(AddRequest("probe", token_ids=prompt, params=FIRST_TOKEN))
    while not any(o.request_id == "probe" for o in engine.step()):
        pass
    return time.perf_counter() - start


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(16, vocab) for _ in range(n)]


def ttft_figures(model: str, url: str, args: argparse.Namespace) -> dict:
    base = dict(model=model, dtype=args.dtype)
    rng = random.Random(0)
    # a device cache of 256 blocks: enough for the prompt, small enough to flush quickly
    a = Engine(
        EngineConfig(
            **base,
            num_kv_blocks=256,
            kv_host_bytes=4 << 30,
            kv_write_through=True,
        ),
        kv_redis=redis.Redis.from_url(url),
    )
    vocab = a.vocab_size
    prefix = tokens(rng, args.prefix, vocab)
    ttft(a, tokens(rng, 64, vocab))  # warm-up
    cold, device, host, remote = [], [], [], []
    for i in range(args.repeats):
        # cold: a prefix no tier has seen
        cold.append(ttft(a, tokens(rng, args.prefix, vocab) + tokens(rng, 16, vocab)))
        if i == 0:
            ttft(a, prefix + tokens(rng, 16, vocab))  # computes the shared prefix once
        device.append(ttft(a, prefix + tokens(rng, 16, vocab)))
    a.blocks.tiers.remote.flush()
    # host: push the prefix out of the device by filling it with other blocks, then ask again
    n_blocks = a.blocks.num_blocks
    for _ in range(args.repeats):
        a.generate(
            [tokens(rng, 500, vocab) for _ in range(n_blocks * 16 // 500 + 1)],
            SamplingParams(max_tokens=1),
        )
        host.append(ttft(a, prefix + tokens(rng, 16, vocab)))
    host_hits = a.stats()["kv_host_hits"]
    a.close()
    for _ in range(args.repeats):
        b = Engine(EngineConfig(**base, kv_host_bytes=0), kv_redis=redis.Redis.from_url(url))
        other = tokens(rng, args.prefix, vocab)  # warm-up on unrelated tokens of the same shapes
        ttft(b, other + tokens(rng, 16, vocab))
        ttft(b, other + tokens(rng, 16, vocab))
        remote.append(ttft(b, prefix + tokens(rng, 16, vocab)))
        redis_hits = b.stats()["kv_redis_hits"]
        b.close()
    med = {
        k: statistics.median(v)
        for k, v in {"cold": cold, "device": device, "host": host, "redis": remote}.items()
    }
    return {
        "prefix_tokens": args.prefix,
        **{f"ttft_{k}_ms": round(v * 1000, 1) for k, v in med.items()},
        "speedup_device": round(med["cold"] / med["device"], 1),
        "speedup_host": round(med["cold"] / med["host"], 1),
        "speedup_redis": round(med["cold"] / med["redis"], 1),
        "host_hit_blocks": host_hits,
        "redis_hit_blocks_per_run": redis_hits,
    }


def multi_turn(model: str, url: str | None, args: argparse.Namespace) -> float:
    rng = random.Random(1)
    cfg = dict(model=model, dtype=args.dtype, num_kv_blocks=args.device_blocks)
    if url is None:
        engine = Engine(EngineConfig(**cfg, kv_host_bytes=0))
    else:
        engine = Engine(
            EngineConfig(**cfg, kv_host_bytes=256 << 20), kv_redis=redis.Redis.from_url(url)
        )
    vocab = engine.vocab_size
    system = tokens(rng, 512, vocab)
    chats = [list(system) for _ in range(args.chats)]
    produced = 0
    start = time.perf_counter()
    for _turn in range(args.turns):
        for c in chats:
            c += tokens(rng, 24, vocab)  # the user's message
        outs = engine.generate(chats, SamplingParams(max_tokens=32, ignore_eos=True))
        for c, o in zip(chats, outs, strict=True):
            c += o.token_ids
            produced += len(o.token_ids)
    elapsed = time.perf_counter() - start
    engine.close()
    return produced / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="models/bench-llama")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefix", type=int, default=1536)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chats", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument(
        "--device-blocks", type=int, default=160, help="device KV blocks in the multi-turn run"
    )
    add_smoke_arg(ap)
    args = ap.parse_args()
    if args.smoke:
        args.prefix, args.repeats, args.chats, args.turns = 128, 1, 2, 2
    model = str(smoke_model() if args.smoke else bench_model(args.model))

    with tempfile.TemporaryDirectory() as d, EmbeddedRedis(Path(d) / "redis") as url:
        result = {"bench": "prefix_reuse", **ttft_figures(model, url, args)}
        print(
            f"TTFT, {args.prefix}-token prefix: cold {result['ttft_cold_ms']} ms, device hit "
            f"{result['ttft_device_ms']} ms ({result['speedup_device']}x), host hit {result['ttft_host_ms']} ms "
            f"({result['speedup_host']}x), Redis hit {result['ttft_redis_ms']} ms ({result['speedup_redis']}x)",
            flush=True,
        )
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis(Path(d) / "redis") as url:
        off = multi_turn(model, None, args)
        on = multi_turn(model, url, args)
    result.update(
        {
            "multi_turn_tok_s_tiers_off": round(off, 1),
            "multi_turn_tok_s_tiers_on": round(on, 1),
            "multi_turn_ratio": round(on / off, 2),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        }
    )
    print(
        f"multi-turn ({args.chats} chats x {args.turns} turns, {args.device_blocks} device blocks): "
        f"tiers off {off:.1f} tok/s, on {on:.1f} tok/s ({on / off:.2f}x)"
    )
    json_line(result, args.smoke)


if __name__ == "__main__":
    main()
