"""The two backends on the same work: one queue workload end to end through Redis with one
native worker, then with one vLLM worker, and each backend offline (the native
Engine.generate, vLLM's LLM.generate) on the same requests. Tokens/s for each, TTFT p50/p99
end to end (from a job's creation to its first streamed token, both stamped by Redis).

    .venv-vllm/bin/python bench/backends.py [--model DIR] [--requests 48] [--dtype bf16] [--smoke]

Runs in vLLM's environment (`make vllm-install`). Every job is greedy with ignore_eos, so
both backends generate exactly the same number of tokens. The last line is one JSON object
of measured figures and ratios. --smoke: two short requests on the factory's small random
Llama (the smallest vLLM runs), in fp32: a check that the bench runs, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.workload import (  # noqa: E402
    SMOKE_KV_BYTES,
    Request,
    add_smoke_arg,
    bench_model,
    cpu_isa,
    json_line,
    mixed,
    smoke_model,
)
from plurai.broker_config import keys  # noqa: E402
from plurai.broker_config.embedded import EmbeddedRedis  # noqa: E402
from plurai.broker_config.stats import serving_workers  # noqa: E402
from plurai.producer.client import Client  # noqa: E402

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def worker_cmd(a: argparse.Namespace, backend: str, url: str) -> list[str]:
    cmd = [sys.executable, "-m", "plurai.cli", "worker", "--model", a.model, "--url", url]
    cmd += ["--log-level", "WARNING", "--metrics-port", "-1", "--backend", backend]
    if backend == "native":
        cmd += ["--engine", f"dtype={a.dtype}", "--engine", f"max_model_len={a.max_len}"]
        return cmd + (["--engine", f"kv_cache_bytes={SMOKE_KV_BYTES}"] if a.smoke else [])
    opts = {"dtype": VLLM_DTYPES[a.dtype], "max_model_len": a.max_len, "enforce_eager": "true"}
    return cmd + [x for k, v in opts.items() for x in ("--vllm", f"{k}={v}")]


def end_to_end(a: argparse.Namespace, backend: str, url: str, reqs: list[Request]) -> dict:
    env = {**os.environ, "PLURAI_HEARTBEAT_INTERVAL_S": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    worker = subprocess.Popen(worker_cmd(a, backend, url), cwd=ROOT, env=env)
    try:
        client = Client(url)
        client.redis.flushall()
        while not serving_workers(client.redis):
            if worker.poll() is not None:
                raise SystemExit(f"the {backend} worker exited")
            time.sleep(0.2)
        client.submit("warm up the engine", max_tokens=8).result(timeout=300)
        jobs = [
            {"token_ids": r.prompt, "max_tokens": r.max_tokens, "ignore_eos": True} for r in reqs
        ]
        t = time.perf_counter()
        submitted = client.submit_many(jobs)
        recs = client.wait_all(submitted, timeout=3600)
        dt = time.perf_counter() - t
        assert all(r.state == "completed" for r in recs), {r.state for r in recs}
        ttft = []
        for rec in recs:  # stream entry ids are Redis's own millisecond clock
            first = client.redis.xrange(keys.output(rec.id), "-", "+", count=2)[-1][0]
            ttft.append((int(str(first).split("-")[0]) - (rec.created_ms or 0)) / 1000)
        tokens = sum(r.output_tokens or 0 for r in recs)
        return {
            "tokens": tokens,
            "seconds": dt,
            "tokens_per_s": tokens / dt,
            "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": pct(ttft, 0.99),
        }
    finally:
        worker.terminate()
        worker.wait(timeout=120)


def offline_native(a: argparse.Namespace, reqs: list[Request]) -> dict:
    from plurai.gpu_workers.engine.config import EngineConfig
    from plurai.gpu_workers.engine.engine import Engine
    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    kv = {"kv_cache_bytes": SMOKE_KV_BYTES} if a.smoke else {}
    engine = Engine(EngineConfig(model=a.model, dtype=a.dtype, max_model_len=a.max_len, **kv))
    engine.generate([[16, 17, 18]], SamplingParams(max_tokens=8))
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    t = time.perf_counter()
    out = engine.generate([r.prompt for r in reqs], params)
    dt = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for c in out)
    engine.close()
    del engine, out
    gc.collect()
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}


def offline_vllm(a: argparse.Namespace, reqs: list[Request]) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    llm = LLM(
        model=a.model, dtype=VLLM_DTYPES[a.dtype], max_model_len=a.max_len, enforce_eager=True
    )
    llm.generate([TokensPrompt(prompt_token_ids=[16, 17, 18])], SamplingParams(max_tokens=8))
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    t = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=r.prompt) for r in reqs], params)
    dt = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in out)
    del llm, out
    gc.collect()
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "bench-llama"))
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    isa = cpu_isa()
    ap.add_argument(
        "--dtype",
        choices=sorted(VLLM_DTYPES),
        default="bf16" if isa in ("avx512_bf16", "amx") else "fp32",
    )
    ap.add_argument("--max-len", type=int, default=1280)
    add_smoke_arg(ap)
    a = ap.parse_args()
    if a.smoke:
        a.model, a.requests, a.dtype, a.max_len = str(smoke_model("small")), 2, "fp32", 256
    bench_model(a.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(a.model).vocab_size
    lengths = {"prompt_median": 16, "output_median": 8} if a.smoke else {}
    reqs = mixed(a.requests, vocab, a.seed, **lengths)
    res: dict[str, dict] = {}
    res["offline_native"] = offline_native(a, reqs)
    res["offline_vllm"] = offline_vllm(a, reqs)
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis(Path(d) / "redis") as url:
        res["e2e_native"] = end_to_end(a, "native", url, reqs)
        res["e2e_vllm"] = end_to_end(a, "vllm", url, reqs)
    for name, r in res.items():
        extra = (
            f", TTFT p50 {r['ttft_p50_s']:.3f}s p99 {r['ttft_p99_s']:.3f}s"
            if "ttft_p50_s" in r
            else ""
        )
        print(
            f"{name:15s} {r['tokens']} tokens in {r['seconds']:.2f}s = {r['tokens_per_s']:.1f} tok/s{extra}"
        )
    out = {
        "model": Path(a.model).name,
        "requests": a.requests,
        "dtype": a.dtype,
        "cpus": os.cpu_count(),
        "isa": isa,
        **{f"{k}_tokens_per_s": round(v["tokens_per_s"], 1) for k, v in res.items()},
        **{
            f"{k}_{q}": round(v[q], 4)
            for k, v in res.items()
            for q in ("ttft_p50_s", "ttft_p99_s")
            if q in v
        },
        "e2e_vs_offline_native": round(
            res["e2e_native"]["tokens_per_s"] / res["offline_native"]["tokens_per_s"], 3
        ),
        "e2e_vs_offline_vllm": round(
            res["e2e_vllm"]["tokens_per_s"] / res["offline_vllm"]["tokens_per_s"], 3
        ),
        "native_vs_vllm_e2e": round(
            res["e2e_native"]["tokens_per_s"] / res["e2e_vllm"]["tokens_per_s"], 3
        ),
        "native_vs_vllm_offline": round(
            res["offline_native"]["tokens_per_s"] / res["offline_vllm"]["tokens_per_s"], 3
        ),
    }
    json_line(out, a.smoke)


if __name__ == "__main__":
    main()
