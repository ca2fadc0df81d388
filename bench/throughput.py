"""Useful tokens/s on a mixed workload: Plurai's engine against vLLM's CPU build and
transformers.

Peers, all on the same requests, model, dtype and threads, in one run:
  - plurai: Engine.generate (continuous batching over the paged KV cache), with the fused
    CPU kernels where they build (the default), and plurai_torch: the same on the
    pure-torch path (kernels=torch), which shows what the kernels gain
  - vllm: vLLM's offline LLM.generate with its defaults, in its own environment
    (`make vllm-install`: .venv-vllm, or PLURAI_VLLM_PYTHON), with the set-up its docs
    recommend where this machine has it: Intel OpenMP and tcmalloc preloaded (said in the
    JSON), OpenMP threads bound to as many cores as Plurai's torch threads
  - hf_static: transformers `generate` on padded static batches of --hf-batch requests;
    a batch runs to its longest request, but only each request's own max_tokens count
  - hf_cb: transformers' continuous batching manager (what `generate_batch` runs), with
    each request's own max_new_tokens
Every request ignores EOS so each peer produces exactly max_tokens per request.
The last line is one JSON object of the measured figures and ratios.

With --runs N each peer runs N times (interleaved) and the figures are medians.
--smoke: every peer once on the factory's small random Llama (the smallest vLLM runs),
two short requests, vLLM eager: a check that the bench runs, not a measurement.

    python bench/throughput.py [--requests 32] [--runs 3] [--hf-batch 8] [--skip-hf-cb]
        [--skip-vllm] [--skip-torch-path] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from plurai.gpu_workers.backend import AddRequest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.workload import (  # noqa: E402
    Request,
    add_smoke_arg,
    add_workload_args,
    bench_model,
    cpu_isa,
    json_line,
    mixed,
    smoke_model,
)


def run_plurai(
    model: Path, reqs: list[Request], dtype: str, kernels: str = "auto"
) -> tuple[float, dict]:
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig
    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(model), dtype=dtype, kernels=kernels))
    if kernels == "auto" and engine.runner.ops is None:
        print("plurai: the fused CPU kernels did not build; this is the torch path", flush=True)
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4))  # warm-up
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    samples = []
    start = time.perf_counter()
    ids = [f"b{i}" for i in range(len(reqs))]
    for rid, r, p in zip(ids, reqs, params, strict=True):
        engine.add(AddRequest(rid, token_ids=r.prompt, params=p))
    produced = 0
    while engine.has_unfinished():
        produced += len(engine.step())
        if engine.num_steps % 8 == 0:
            s = engine.stats()
            if s["slots_allocated"]:
                samples.append(s["tokens_stored"] / s["slots_allocated"])
    elapsed = time.perf_counter() - start
    assert produced == sum(r.max_tokens for r in reqs), produced
    samples.sort()
    kv = {
        "kv_util_median": samples[len(samples) // 2] if samples else None,
        "kv_util_min": samples[0] if samples else None,
        "preemptions": engine.scheduler.num_preemptions,
    }
    return elapsed, kv


def _hf_model(model: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).eval()
    m.generation_config.eos_token_id = None  # ignore EOS, as the other peers do
    return m


def run_hf_static(
    model: Path, reqs: list[Request], dtype: torch.dtype, batch: int, pad_id: int
) -> float:
    m = _hf_model(model, dtype)
    start = time.perf_counter()
    for i in range(0, len(reqs), batch):
        group = reqs[i : i + batch]
        width = max(len(r.prompt) for r in group)
        ids = torch.tensor([[pad_id] * (width - len(r.prompt)) + r.prompt for r in group])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in group])
        new = max(r.max_tokens for r in group)
        with torch.inference_mode():
            m.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
            )
    return time.perf_counter() - start


def run_hf_cb(model: Path, reqs: list[Request], dtype: torch.dtype, small: bool = False) -> float:
    """small: a cache of 16 pages and 256-token batches, not sized from the free memory
    (whose allocation, at the first request, takes seconds)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    m = _hf_model(model, dtype)
    gc = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.max_tokens for r in reqs),
        eos_token_id=None,
        pad_token_id=0,
    )
    cb = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256) if small else None
    manager = m.init_continuous_batching(generation_config=gc, continuous_batching_config=cb)
    manager.start()
    try:
        start = time.perf_counter()
        for i, r in enumerate(reqs):
            manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.max_tokens)
        done = 0
        while done < len(reqs):
            out = manager.get_result(timeout=5)
            if out is not None and out.is_finished():
                assert out.error is None, out.error
                done += 1
        return time.perf_counter() - start
    finally:
        manager.stop(block=True)


ROOT = Path(__file__).resolve().parent.parent
TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc.so.4",
)


def vllm_python() -> Path | None:
    found = os.environ.get("PLURAI_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    return Path(found) if Path(found).exists() else None


def vllm_env(py: Path, threads: int, kv_gib: int = 4) -> tuple[dict[str, str], list[str]]:
    """The environment of a vLLM peer, with the set-up vLLM's CPU docs recommend (Intel
    OpenMP and tcmalloc preloaded where present, OpenMP threads bound to `threads` cores),
    and the names of the libraries preloaded."""
    preload = [str(p) for p in (py.parent.parent / "lib" / "libiomp5.so",) if p.exists()]
    preload += [t for t in TCMALLOC if Path(t).exists()]
    env = {
        **os.environ,
        "LD_PRELOAD": " ".join(preload),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
    }
    return env, [Path(p).name for p in preload]


def peer(cmd: list[str], spec: dict, env: dict[str, str] | None = None) -> tuple[dict | None, str]:
    """A peer script (bench/vllm_peer.py, bench/plurai_peer.py) run on `spec`: its figures
    (its "PEER " line; None when it failed) and its log (stdout, then stderr)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        run = subprocess.run([*cmd, f.name], env=env, capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode != 0:
        return None, log
    return json.loads(next(x for x in run.stdout.splitlines() if x.startswith("PEER "))[5:]), log


def vllm_peer(
    py: Path, model: Path, reqs: list[Request], dtype: str, threads: int, options: dict
) -> tuple[dict | None, str, list[str]]:
    """bench/vllm_peer.py on these requests with vLLM's EngineArgs `options` (vllm_env's
    set-up): its figures (None when it failed), its log (stdout, where vLLM logs its
    engine's errors too, then stderr), and the libraries preloaded."""
    spec = {
        "model": str(model),
        "dtype": dtype,
        "requests": [[r.prompt, r.max_tokens] for r in reqs],
        "options": options,
    }
    env, names = vllm_env(py, threads)
    out, log = peer([str(py), str(ROOT / "bench" / "vllm_peer.py")], spec, env)
    return out, log, names


def run_vllm(
    model: Path, reqs: list[Request], dtype: str, threads: int, eager: bool = False
) -> tuple[float, list[str]] | None:
    """Seconds of vLLM's run and the libraries preloaded; None when vLLM is not installed.
    eager: without torch.compile (a start in seconds, not minutes)."""
    py = vllm_python()
    if py is None:
        print("vllm       skipped: no .venv-vllm (make vllm-install) nor PLURAI_VLLM_PYTHON")
        return None
    max_len = max(len(r.prompt) + r.max_tokens for r in reqs)
    options: dict = {"max_model_len": max(1024, max_len)}
    if eager:
        options["enforce_eager"] = True
    out, log, preload = vllm_peer(py, model, reqs, dtype, threads, options)
    if out is None:
        raise SystemExit(f"the vLLM peer failed:\n{log[-3000:]}")
    assert out["tokens"] == sum(r.max_tokens for r in reqs), out
    return out["seconds"], preload


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(ap)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--skip-hf-static", action="store_true")
    ap.add_argument("--skip-hf-cb", action="store_true")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-torch-path", action="store_true")
    ap.add_argument("--runs", type=int, default=1, help="runs per peer; figures are medians")
    add_smoke_arg(ap)
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.hf_batch, args.runs = 2, 2, 1

    model = smoke_model("small") if args.smoke else bench_model(args.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(model)).vocab_size
    lengths = {"prompt_median": 16, "output_median": 8} if args.smoke else {}
    reqs = mixed(args.requests, vocab, args.seed, **lengths)
    useful = sum(r.max_tokens for r in reqs)
    tdtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    print(
        f"{len(reqs)} requests: {sum(len(r.prompt) for r in reqs)} prompt tokens, {useful} output tokens; "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )

    result: dict = {
        "bench": "throughput",
        "requests": len(reqs),
        "useful_tokens": useful,
        "dtype": args.dtype,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
    }
    peers: dict[str, Callable[[], float | None]] = {"plurai": lambda: plurai("auto")}
    kv: dict = {}

    def plurai(kernels: str) -> float:
        t, figures = run_plurai(model, reqs, args.dtype, kernels)
        kv.update(figures)
        return t

    if not args.skip_torch_path:
        peers["plurai_torch"] = lambda: run_plurai(model, reqs, args.dtype, "torch")[0]
    preload: list = []
    if not args.skip_vllm:

        def vllm() -> float | None:
            ran = run_vllm(model, reqs, args.dtype, torch.get_num_threads(), eager=args.smoke)
            if ran is None:
                return None
            preload[:] = [ran[1]]
            return ran[0]

        peers["vllm"] = vllm
    if not args.skip_hf_static:
        peers["hf_static"] = lambda: run_hf_static(model, reqs, tdtype, args.hf_batch, pad_id=0)
    if not args.skip_hf_cb:
        peers["hf_cb"] = lambda: run_hf_cb(model, reqs, tdtype, small=args.smoke)
    times: dict[str, list[float]] = {name: [] for name in peers}
    for run in range(args.runs):
        for name, fn in peers.items():
            t = fn()
            if t is None:
                continue
            times[name].append(t)
            print(f"run {run + 1}: {name:13} {useful / t:8.1f} useful tok/s ({t:.1f}s)", flush=True)
    for name, ts in times.items():
        if ts:
            result[f"{name}_tok_s"] = round(useful / sorted(ts)[len(ts) // 2], 1)
            result[f"{name}_runs_tok_s"] = [round(useful / t, 1) for t in ts]
    result.update(kv)
    if preload:
        result["vllm_preload"] = preload[0]
    for name in ("plurai_torch", "vllm", "hf_static", "hf_cb"):
        if f"{name}_tok_s" in result:
            key = "kernel_speedup" if name == "plurai_torch" else f"ratio_vs_{name}"
            result[key] = round(result["plurai_tok_s"] / result[f"{name}_tok_s"], 2)
    result["isa"] = cpu_isa()
    # the flag set the fused kernels were built with (PLURAI_KERNEL_ISA can narrow it)
    from plurai.gpu_workers.kernels import build_isa

    result["kernels_isa"] = build_isa()
    result["peers"] = [name for name, ts in times.items() if ts]  # those that ran
    json_line(result, args.smoke)


if __name__ == "__main__":
    main()
