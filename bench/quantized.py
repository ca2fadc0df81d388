"""Quantized weights against bf16 on the native engine, with vLLM's CPU build on the same
checkpoints where it loads them.

- Speed: the bench model in bf16 and quantized by `plurai quantize` (w8a16, w4a16, w8a8;
  round to nearest), decode tok/s on the mixed workload of bench/throughput.py (32
  requests at once) and on one stream (one request at a time), every run in a process of
  its own; activations bf16 on every peer.
- Quality: the perplexity of the factory's small Llama trained on its shipped book, on the
  book's text, in bf16 and in each scheme (the engine's own forward: every position's
  logits of windows of the text).
- torch's int kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`, `_int_mm`)
  on the same checkpoints, in place of the project's (`qlinear`, `qlinear_i8`): what those
  gain.
- vLLM: the same checkpoints through bench/vllm_peer.py (its CPU build refuses some
  schemes: the JSON gives its error's last line for each).

Run alone (nothing else on the machine: two cores are easily disturbed). The last line is
one JSON object of the measured figures, medians over --runs, with the CPU's ISA.

    python bench/quantized.py [--runs 3] [--requests 32] [--schemes w8a16,w4a16,w8a8]
        [--group-size 128] [--skip-vllm] [--skip-ppl] [--skip-torch-kernels]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.throughput import vllm_peer, vllm_python  # noqa: E402
from bench.workload import Request, add_workload_args, bench_model, cpu_isa, mixed  # noqa: E402

SCHEMES = ("w8a16", "w4a16", "w8a8")


def checkpoint(src: Path, scheme: str, group: int) -> Path:
    """src quantized (made once, cached beside it)."""
    from gpu_workers.models.quantize import quantize

    suffix = f"-g{group}" if scheme == "w4a16" else ""
    dst = src.with_name(f"{src.name}-{scheme}{suffix}")
    if not (dst / "config.json").is_file():
        quantize(src, dst, scheme, group if scheme == "w4a16" else None)
    return dst


def child(
    model: str, reqs: list[list[int]], one_at_a_time: bool, threads: int, torch_kernels: bool
) -> dict:
    """Decode tok/s of the native engine in bf16 on these requests ([prompt, max_tokens]);
    `torch_kernels`: the quantized layers on torch's int kernels, not the project's."""
    from gpu_workers.engine.engine import Engine, EngineConfig
    from gpu_workers.engine.sampling_params import SamplingParams
    from gpu_workers.kernels import load
    from gpu_workers.layers.quant_linear import QuantLinear

    if torch_kernels:  # the loaded extension without its quantized matmuls (the other
        ops = load("auto")  # fused kernels stay, so that only the matmuls differ)
        for name in ("qlinear", "qlinear_i8"):
            if hasattr(ops, name):
                delattr(ops, name)

    engine = Engine(
        EngineConfig(model=model, dtype="bf16", kv_cache_bytes=1 << 30, threads=threads)
    )
    kinds = sorted({m.kind for m in engine.runner.model.modules() if isinstance(m, QuantLinear)})
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    batches = [[r] for r in reqs] if one_at_a_time else [reqs]
    tokens, seconds = 0, 0.0
    for batch in batches:
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in batch]
        start = time.perf_counter()
        out = engine.generate([p for p, _ in batch], params)
        seconds += time.perf_counter() - start
        tokens += sum(len(c.token_ids) for c in out)
    return {"tokens": tokens, "seconds": seconds, "kernels": kinds}


def run_child(
    model: Path, reqs: list[Request], one_at_a_time: bool, threads: int, torch_kernels: bool
) -> tuple[float, list[str]]:
    spec = {
        "model": str(model),
        "reqs": [[r.prompt, r.max_tokens] for r in reqs],
        "one": one_at_a_time,
        "threads": threads,
        "torch_kernels": torch_kernels,
    }
    run = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
    )
    line = next((x for x in run.stdout.splitlines() if x.startswith("CHILD ")), None)
    if run.returncode != 0 or line is None:
        raise SystemExit(f"the native run on {model} failed:\n{run.stderr[-3000:]}")
    out = json.loads(line[6:])
    assert out["tokens"] == sum(r.max_tokens for r in reqs), out
    return out["tokens"] / out["seconds"], out["kernels"]


def perplexity(model: Path, text_ids: list[int], window: int) -> float:
    """exp(mean NLL of each next token) over windows of the text, each read in one prefill
    of the engine's model (bf16)."""
    import torch

    from gpu_workers.engine.engine import Engine, EngineConfig
    from gpu_workers.layers.attention import AttnContext, Prefill

    runner = Engine(EngineConfig(model=str(model), dtype="bf16", kv_cache_bytes=64 << 20)).runner
    nll, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(text_ids) - window, window):
            ids = torch.tensor(text_ids[i : i + window + 1])
            t = window
            ctx = AttnContext(slot_mapping=torch.arange(t), prefills=[Prefill(0, t, t, None)])
            hidden = runner.model(ids[:t], torch.arange(t), ctx)
            logp = torch.log_softmax(runner.model.logits(hidden), dim=-1)
            nll -= logp[torch.arange(t), ids[1:]].sum().item()
            count += t
    return float(torch.exp(torch.tensor(nll / count)))


def book_model(steps: int) -> tuple[Path, list[int]]:
    from transformers import AutoTokenizer

    from bench.speculative import doc_model
    from gpu_workers.models.train import corpus_text

    model = doc_model("small", steps)
    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    return model, tok(corpus_text(), add_special_tokens=False).input_ids


def vllm_speed(model: Path, reqs: list[Request], threads: int) -> float | str:
    """vLLM's decode tok/s on the checkpoint, or the last line of its error."""
    py = vllm_python()
    if py is None:
        return "no .venv-vllm (make vllm-install)"
    max_len = max(len(r.prompt) + r.max_tokens for r in reqs)
    out, stderr, _ = vllm_peer(
        py, model, reqs, "bf16", threads, {"max_model_len": max(1024, max_len)}
    )
    if out is None:  # the line that says why, else the last one
        lines = [x.strip() for x in stderr.splitlines() if x.strip()]
        why = [x for x in lines if "not supported" in x or "Failed to find" in x]
        return (why or lines or ["failed"])[-1][-300:]
    return out["tokens"] / out["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--group-size", type=int, default=128, help="w4a16's group size")
    ap.add_argument("--single", type=int, default=4, help="requests run one at a time")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument(
        "--skip-torch-kernels", action="store_true", help="the schemes on torch's int kernels"
    )
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--ppl-tokens", type=int, default=8192, help="of the book's text")
    ap.add_argument("--train-steps", type=int, default=600, help="the book model's training")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        spec = json.loads(a.child)
        res = child(
            spec["model"], spec["reqs"], spec["one"], spec["threads"], spec["torch_kernels"]
        )
        print("CHILD " + json.dumps(res), flush=True)
        return

    schemes = [s for s in a.schemes.split(",") if s]
    src = bench_model(a.model)
    models = {"bf16": src, **{s: checkpoint(src, s, a.group_size) for s in schemes}}
    # peers: (checkpoint, torch's int kernels instead of the project's)
    peers = {n: (p, False) for n, p in models.items()}
    if not a.skip_torch_kernels:
        peers |= {f"{s}_torch_kernels": (models[s], True) for s in schemes}
    reqs = mixed(a.requests, 8192, a.seed)
    single = reqs[: a.single]
    batch: dict[str, list[float]] = {n: [] for n in peers}
    stream: dict[str, list[float]] = {n: [] for n in peers}
    kernels: dict[str, list[str]] = {}
    for run in range(a.runs):  # interleaved, so that a slow spell touches every peer
        for name, (path, torch_kernels) in peers.items():
            tps, kernels[name] = run_child(path, reqs, False, a.threads, torch_kernels)
            batch[name].append(tps)
            tps1, _ = run_child(path, single, True, a.threads, torch_kernels)
            stream[name].append(tps1)
            print(
                f"run {run}: {name:6} batch {tps:7.1f} tok/s   one stream {tps1:6.1f} tok/s",
                flush=True,
            )
    out: dict = {
        "bench": "quantized",
        "isa": cpu_isa(),
        "model": src.name,
        "requests": a.requests,
        "single_stream_requests": a.single,
        "runs": a.runs,
        "kernels": kernels,
        "batch_tok_s": {n: round(statistics.median(v), 1) for n, v in batch.items()},
        "one_stream_tok_s": {n: round(statistics.median(v), 1) for n, v in stream.items()},
        "batch_runs": {n: [round(x, 1) for x in v] for n, v in batch.items()},
        "one_stream_runs": {n: [round(x, 1) for x in v] for n, v in stream.items()},
    }
    base, base1 = out["batch_tok_s"]["bf16"], out["one_stream_tok_s"]["bf16"]
    others = [n for n in peers if n != "bf16"]
    out["batch_ratio_vs_bf16"] = {n: round(out["batch_tok_s"][n] / base, 3) for n in others}
    out["one_stream_ratio_vs_bf16"] = {
        n: round(out["one_stream_tok_s"][n] / base1, 3) for n in others
    }
    if not a.skip_vllm:
        vllm = {n: vllm_speed(p, reqs, a.threads) for n, p in models.items()}
        out["vllm_batch_tok_s"] = {
            n: round(v, 1) if isinstance(v, float) else None for n, v in vllm.items()
        }
        out["vllm_refused"] = {n: v for n, v in vllm.items() if isinstance(v, str)}
        out["plurai_vs_vllm"] = {
            n: round(out["batch_tok_s"][n] / v, 3) for n, v in vllm.items() if isinstance(v, float)
        }
    if not a.skip_ppl:
        book, ids = book_model(a.train_steps)
        ids = ids[: a.ppl_tokens]
        ppl = {"bf16": perplexity(book, ids, 256)}
        for s in schemes:
            ppl[s] = perplexity(checkpoint(book, s, min(a.group_size, 128)), ids, 256)
        out["book_model"] = book.name
        out["perplexity"] = {n: round(v, 3) for n, v in ppl.items()}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
