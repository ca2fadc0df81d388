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

--smoke: the smallest run through every step (the factory's small random Llama, two
requests, one run; the peers on the project's kernels in one child process and those on
torch's in another; vLLM on one checkpoint alone (w4a16's), eager; the book model
trained 4 steps, the checkpoints in a temporary folder). A check that the bench runs, not
a measurement.

Run alone (nothing else on the machine: two cores are easily disturbed). The last line is
one JSON object of the measured figures, medians over --runs, with the CPU's ISA.

    python bench/quantized.py [--runs 3] [--requests 32] [--schemes w8a16,w4a16,w8a8]
        [--group-size 128] [--skip-vllm] [--skip-ppl] [--skip-torch-kernels] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.throughput import vllm_peer, vllm_python  # noqa: E402
from bench.workload import (  # noqa: E402
    SMOKE_KV_BYTES,
    Request,
    add_smoke_arg,
    add_workload_args,
    bench_model,
    cpu_isa,
    json_line,
    mixed,
    smoke_model,
)

SCHEMES = ("w8a16", "w4a16", "w8a8")


def checkpoint(src: Path, scheme: str, group: int, into: Path | None = None) -> Path:
    """src quantized (made once, cached beside it, or in the folder `into`)."""
    from plurai.gpu_workers.models.quantize import quantize

    suffix = f"-g{group}" if scheme == "w4a16" else ""
    dst = (into or src.parent) / f"{src.name}-{scheme}{suffix}"
    if not (dst / "config.json").is_file():
        quantize(src, dst, scheme, group if scheme == "w4a16" else None)
    return dst


def child(runs: list[dict]) -> list[dict]:
    """Each run (model, reqs, one, threads, kv) in turn, in this process; every run here with
    the quantized layers on torch's int kernels (`torch_kernels`) or every one without:
    that is set once for the process."""
    from plurai.gpu_workers.kernels import load

    (torch_kernels,) = {r["torch_kernels"] for r in runs}
    if torch_kernels:  # the loaded extension without its quantized matmuls (the other
        ops = load("auto")  # fused kernels stay, so that only the matmuls differ)
        for name in ("qlinear", "qlinear_i8"):
            if hasattr(ops, name):
                delattr(ops, name)
    return [decode_rate(r["model"], r["reqs"], r["one"], r["threads"], r["kv"]) for r in runs]


def decode_rate(
    model: str, reqs: list[list[int]], one_at_a_time: bool, threads: int, kv_bytes: int
) -> dict:
    """Decode tok/s of the native engine in bf16 on these requests ([prompt, max_tokens])."""
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig
    from plurai.gpu_workers.engine.sampling_params import SamplingParams
    from plurai.gpu_workers.layers.quant_linear import QuantLinear

    engine = Engine(
        EngineConfig(model=model, dtype="bf16", kv_cache_bytes=kv_bytes, threads=threads)
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
    runs: list[tuple[Path, list[Request], bool, int, bool]], kv_bytes: int = 1 << 30
) -> list[tuple[float, list[str]]]:
    """These runs (model, requests, one at a time, threads, torch's int kernels) in one child
    process, each engine with this KV budget: (decode tok/s, the quantized layers' kinds)
    of each."""
    spec = [
        {
            "model": str(model),
            "reqs": [[r.prompt, r.max_tokens] for r in reqs],
            "one": one_at_a_time,
            "threads": threads,
            "torch_kernels": torch_kernels,
            "kv": kv_bytes,
        }
        for model, reqs, one_at_a_time, threads, torch_kernels in runs
    ]
    run = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
    )
    line = next((x for x in run.stdout.splitlines() if x.startswith("CHILD ")), None)
    if run.returncode != 0 or line is None:
        models = sorted({str(r[0]) for r in runs})
        raise SystemExit(f"the native run on {', '.join(models)} failed:\n{run.stderr[-3000:]}")
    out = []
    for got, (_, reqs, *_) in zip(json.loads(line[6:]), runs, strict=True):
        assert got["tokens"] == sum(r.max_tokens for r in reqs), got
        out.append((got["tokens"] / got["seconds"], got["kernels"]))
    return out


def perplexity(model: Path, text_ids: list[int], window: int) -> float:
    """exp(mean NLL of each next token) over windows of the text, each read in one prefill
    of the engine's model (bf16)."""
    import torch

    from plurai.gpu_workers.engine.engine import Engine, EngineConfig
    from plurai.gpu_workers.layers.attention import AttnContext, Prefill

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
    from plurai.gpu_workers.models.train import corpus_text

    model = doc_model("small", steps, copy_share=0.0)  # the book alone: its perplexity
    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    return model, tok(corpus_text(), add_special_tokens=False).input_ids


def vllm_speed(model: Path, reqs: list[Request], threads: int, eager: bool = False) -> float | str:
    """vLLM's decode tok/s on the checkpoint, or the last line of its error."""
    py = vllm_python()
    if py is None:
        return "no .venv-vllm (make vllm-install)"
    max_len = max(len(r.prompt) + r.max_tokens for r in reqs)
    options: dict = {"max_model_len": max(1024, max_len)}
    if eager:  # no torch.compile: a start in seconds, not minutes
        options["enforce_eager"] = True
    out, log, _ = vllm_peer(py, model, reqs, "bf16", threads, options)
    if out is None:  # the line that says why, else the last one
        lines = [x.strip() for x in log.splitlines() if x.strip()]
        marks = ("not supported", "Failed to find", "died unexpectedly")  # the last: a crash
        why = [x for x in lines if any(m in x for m in marks)]
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
    add_smoke_arg(ap)
    a = ap.parse_args()
    if a.child:
        print("CHILD " + json.dumps(child(json.loads(a.child))), flush=True)
        return
    if a.smoke:
        a.requests, a.single, a.runs, a.train_steps, a.ppl_tokens = 2, 1, 1, 4, 512
    with tempfile.TemporaryDirectory() as tmp:
        # smoke runs write their checkpoints apart: two may run at once
        run(a, Path(tmp) if a.smoke else None)


def run(a: argparse.Namespace, into: Path | None) -> None:
    from transformers import AutoConfig

    schemes = [s for s in a.schemes.split(",") if s]
    src = smoke_model("small") if a.smoke else bench_model(a.model)
    models = {"bf16": src, **{s: checkpoint(src, s, a.group_size, into) for s in schemes}}
    # peers: (checkpoint, torch's int kernels instead of the project's)
    peers = {n: (p, False) for n, p in models.items()}
    if not a.skip_torch_kernels:
        peers |= {f"{s}_torch_kernels": (models[s], True) for s in schemes}
    vocab = AutoConfig.from_pretrained(str(src)).vocab_size
    lengths = {"prompt_median": 16, "output_median": 8} if a.smoke else {}
    reqs = mixed(a.requests, vocab, a.seed, **lengths)
    single = reqs[: a.single]
    batch: dict[str, list[float]] = {n: [] for n in peers}
    stream: dict[str, list[float]] = {n: [] for n in peers}
    kernels: dict[str, list[str]] = {}
    for i in range(a.runs):  # interleaved, so that a slow spell touches every peer
        # each peer's batch and one-stream runs, in a process of their own; in a smoke run,
        # one process for the peers on the project's kernels and one for torch's
        jobs = [
            (name, (path, rs, one, a.threads, torch_kernels))
            for name, (path, torch_kernels) in peers.items()
            for one, rs in ((False, reqs), (True, single))
        ]
        groups = (
            [[j for j in jobs if j[1][4] == tk] for tk in (False, True)]
            if a.smoke
            else [[j] for j in jobs]
        )
        rates: dict[tuple[str, bool], float] = {}
        for group in filter(None, groups):
            got = run_child([spec for _, spec in group], SMOKE_KV_BYTES if a.smoke else 1 << 30)
            for (name, spec), (tps, kinds) in zip(group, got, strict=True):
                rates[name, spec[2]] = tps
                kernels[name] = kinds
        for name in peers:
            tps, tps1 = rates[name, False], rates[name, True]
            batch[name].append(tps)
            stream[name].append(tps1)
            print(
                f"run {i}: {name:6} batch {tps:7.1f} tok/s   one stream {tps1:6.1f} tok/s",
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
        on = models
        if a.smoke and schemes:  # one start: a scheme its CPU build runs, where asked for
            first = "w4a16" if "w4a16" in schemes else schemes[0]
            on = {first: models[first]}
        vllm = {n: vllm_speed(p, reqs, a.threads, eager=a.smoke) for n, p in on.items()}
        out["vllm_checkpoints"] = list(vllm)
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
            ppl[s] = perplexity(checkpoint(book, s, min(a.group_size, 128), into), ids, 256)
        out["book_model"] = book.name
        out["perplexity"] = {n: round(v, 3) for n, v in ppl.items()}
    json_line(out, a.smoke)


if __name__ == "__main__":
    main()
