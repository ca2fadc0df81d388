"""Speculative decoding (prompt lookup, and a draft model) in the native engine, with and
without, on the same requests; vLLM's CPU build with its own n-gram speculation on them
where it runs it.

    python bench/speculative.py [--dtype fp32|bf16] [--k 4] [--runs 3] [--requests 32]
        [--doc-size small] [--draft-size tiny] [--train-steps 10000] [--copy-share 0.75]
        [--max-tokens 0] [--skip-vllm] [--smoke]

Workloads (greedy, EOS ignored, so every run makes the same tokens):
- documents: the factory's Llama (--doc-size) trained on its shipped book (--train-steps;
  a --copy-share of its windows are paragraphs written twice, so that it learns to copy
  from its context, as a real model does when asked to quote or extract), asked to copy a
  passage it was just given (the passage, a blank line, its first words: the answer goes
  on with the passage) and to continue a passage the book holds further on
  (the prompt quotes the book up to a point, then quotes it again from an earlier point:
  the continuation is in the prompt). The output reuses the input, as in extraction,
  quoting and rewriting. Quotes start and end between words, as a user's would: cut
  mid-word, the small trained model loses its place (it writes other text from there,
  leaving nothing to speculate on), which a real model does not. At 10,000 steps (the
  default: ~40 minutes of training on first use, the two models side by side, then
  cached under models/) both models copy these requests to their end; at 3,000, about
  half of each.
  A draft model proposes too: the factory's --draft-size Llama trained the same way (the
  sizes share the tokenizer).
- random: bench/throughput.py's mixed workload on the random-weight bench model, where
  proposals rarely match: speculation must cost nothing there (prompt lookup only: the
  factory has no smaller model with the bench model's tokenizer).

Figures per workload: single stream (one request at a time: decode tok/s, from each
request's first token to its last) and batch (--requests at once: output tok/s); the share
of proposed tokens accepted. vLLM: batch only (its offline `generate`), same requests.
The last line is one JSON object with the ISA and the device (on a GPU the engine runs
there, and a small model's step costs its kernel launches more than its rows).

--smoke: the smallest run through every step: both models trained 4 steps, the tiny
random model for the random workload, two requests of 8 tokens, one run; vLLM (eager) on
the documents alone, with n-gram speculation alone. A check that the bench runs, not a
measurement.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from plurai.gpu_workers.backend import AddRequest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.throughput import vllm_peer, vllm_python  # noqa: E402
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


def doc_model(size: str, steps: int, copy_share: float) -> Path:
    """Trained for a number of steps, not seconds, so that every machine makes the same
    model (made once; cached under models/). A share of its training windows are paragraphs
    written twice: a model trained on the book alone continues a passage from what it
    remembers of the book, not from the prompt, and copies no field out of a document."""
    from plurai.gpu_workers.models.factory import make_model
    from plurai.gpu_workers.models.train import TrainConfig

    cfg = TrainConfig(
        steps=steps, seconds=24 * 3600.0, context=192, chat_share=0.0, copy_share=copy_share
    )
    name = f"{size}-llama-book-{steps}" + (f"-copy{copy_share:g}" if copy_share else "")
    return make_model(ROOT / "models" / name, size=size, train=cfg)


def documents(model: Path, n: int, max_tokens: int, seed: int = 0) -> list[Request]:
    """Half copy requests (a passage, then its first words), half continuations (the book
    up to a point, then from an earlier point on), cut between words. Each answers with
    `max_tokens`, or with 0 the rest of its passage: where a real model would end its
    quote (the trained model writes no EOS there: it goes on with the book)."""
    from transformers import AutoTokenizer

    from plurai.gpu_workers.models.train import corpus_text, paragraphs

    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    paras = [p for p in paragraphs(corpus_text()) if 200 <= len(p) <= 500]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.choice(paras)
        if i % 2 == 0:
            cut = _word_end(p, len(p) // 5)
            text = f"{p}\n\n{p[:cut]}"
        else:
            cut = _word_end(p, len(p) // 2)
            text = f"{p}\n\n{p[_word_end(p, cut // 3) + 1 : cut]}"
        ids = tok(text, add_special_tokens=False).input_ids
        rest = len(tok(p[cut:], add_special_tokens=False).input_ids)
        out.append(Request(ids, max_tokens or rest))
    return out


def _word_end(p: str, i: int) -> int:
    """Where the last word that ends at or before character i ends."""
    j = p.rfind(" ", 0, i)
    return j if j > 0 else i


def run_native(
    model: Path,
    reqs: list[Request],
    dtype: str,
    spec: str,
    k: int,
    batch: bool,
    kv_bytes: int | None = None,
):
    """(output tok/s: batch all at once, or decode tok/s one at a time; acceptance).
    kv_bytes: the engine's KV budget (None: the default)."""
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig
    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    max_len = max(len(r.prompt) + r.max_tokens for r in reqs) + 16
    engine = Engine(
        EngineConfig(
            model=str(model),
            dtype=dtype,
            speculative=spec,
            num_speculative_tokens=k,
            max_model_len=max(1024, max_len),
            **({"kv_cache_bytes": kv_bytes} if kv_bytes else {}),
        )
    )
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    # a whole untimed pass first: a step of a new row count builds its kernels (oneDNN's
    # primitives) the first time, and proposals make many row counts; a serving engine has
    # long built them (the pass also warms the cost model, as serving would)
    engine.generate([r.prompt for r in reqs], params)
    before = engine.stats()
    made = 0
    if batch:
        start = time.perf_counter()
        for i, (r, p) in enumerate(zip(reqs, params, strict=True)):
            engine.add(AddRequest(f"b{i}", token_ids=r.prompt, params=p))
        while engine.has_unfinished():
            made += sum(len(o.new_token_ids) for o in engine.step())
        rate = made / (time.perf_counter() - start)
    else:
        decode_s = 0.0
        for i, (r, p) in enumerate(zip(reqs, params, strict=True)):
            engine.add(AddRequest(f"s{i}", token_ids=r.prompt, params=p))
            first = None
            while engine.has_unfinished():
                outs = engine.step()
                n = sum(len(o.new_token_ids) for o in outs)
                if n and first is None:
                    first, n = time.perf_counter(), n - 1  # decode: after the first token
                made += n
            decode_s += time.perf_counter() - first
        rate = made / decode_s
    after = engine.stats()
    engine.close()
    proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return rate, (accepted / proposed if proposed else None)


def run_vllm(
    model: Path, reqs: list[Request], dtype: str, k: int | None, eager: bool = False
) -> dict:
    """vLLM's offline generate of every request at once, with n-gram speculation (k
    tokens) or none: output tok/s, or why it did not run."""
    py = vllm_python()
    if py is None:
        return {"skipped": "no .venv-vllm (make vllm-install)"}
    max_len = max(len(r.prompt) + r.max_tokens for r in reqs) + 16
    options: dict = {"max_model_len": max(1024, max_len)}
    if eager:  # no torch.compile: a start in seconds, not minutes
        options["enforce_eager"] = True
    if k:
        options["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    out, log, _ = vllm_peer(py, model, reqs, dtype, threads, options)
    if out is None:
        lines = [x for x in log.splitlines() if "Error" in x or "error" in x]
        return {"failed": (lines[-1] if lines else log[-300:])[-300:]}
    return {"tok_s": round(out["tokens"] / out["seconds"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--k", type=int, default=4, help="tokens proposed a step")
    ap.add_argument("--runs", type=int, default=3, help="runs of each case; medians")
    ap.add_argument("--requests", type=int, default=32, help="requests of the batch cases")
    ap.add_argument("--single", type=int, default=8, help="requests of the single-stream cases")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="tokens out, documents (0: each the rest of its passage, the answer's length)",
    )
    # the bench size trains at ~10 s a step on one core: over a day to learn to copy; the
    # small one takes ~0.23 s a step (made once, under models/)
    ap.add_argument("--doc-size", default="small", help="the documents' model: a factory size")
    ap.add_argument("--draft-size", default="tiny", help="the draft model's factory size")
    ap.add_argument("--train-steps", type=int, default=10000, help="their training on the book")
    ap.add_argument(
        "--copy-share", type=float, default=0.75, help="share of their training that copies"
    )
    ap.add_argument("--skip-vllm", action="store_true")
    add_smoke_arg(ap)
    a = ap.parse_args()
    if a.smoke:
        a.train_steps, a.requests, a.single, a.runs, a.max_tokens = 4, 2, 1, 1, 8
    sizes, steps, shares = (a.doc_size, a.draft_size), (a.train_steps,) * 2, (a.copy_share,) * 2
    if a.smoke:  # a few steps: here, at once
        book, draft = map(doc_model, sizes, steps, shares)
    else:  # trained side by side on first use (one core each): ~40 minutes rather than ~60
        with ProcessPoolExecutor(2) as pool:
            book, draft = pool.map(doc_model, sizes, steps, shares)
    rand = smoke_model() if a.smoke else bench_model()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(rand)).vocab_size
    lengths = {"prompt_median": 16, "output_median": 8} if a.smoke else {}
    ngram = {"ngram": "ngram"}
    work = {
        "documents": (
            book,
            documents(book, a.requests, a.max_tokens),
            ngram | {"draft": f"draft:{draft}"},
        ),
        "random": (rand, mixed(a.requests, vocab, 0, **lengths), ngram),
    }
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    out: dict = {"bench": "speculative", "isa": cpu_isa(), "device": gpu or "cpu"}
    out |= {"dtype": a.dtype, "k": a.k}
    out |= {"doc_model": book.name, "draft_model": draft.name}
    kv = SMOKE_KV_BYTES if a.smoke else None
    for name, (model, reqs, specs) in work.items():
        fig: dict = {"requests": len(reqs), "output_tokens": sum(r.max_tokens for r in reqs)}
        modes = {"off": "off"} | specs
        for mode, batch, rs in (("single", False, reqs[: a.single]), ("batch", True, reqs)):
            rates: dict[str, list[float]] = {m: [] for m in modes}
            acc: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(a.runs):  # interleaved, so a slow minute lands on every mode
                for m, spec in modes.items():
                    rate, accepted = run_native(model, rs, a.dtype, spec, a.k, batch, kv)
                    rates[m].append(rate)
                    if accepted is not None:
                        acc[m].append(accepted)
                    print(f"{name} {mode} {m}: {rate:.1f} tok/s", file=sys.stderr)
            off = statistics.median(rates["off"])
            fig[mode] = {
                "off_tok_s": round(off, 1),
                "runs_off": [round(x, 1) for x in rates["off"]],
            }
            for m in specs:
                on = statistics.median(rates[m])
                # prompt lookup's figures keep their names; the draft's are prefixed
                pre = "" if m == "ngram" else f"{m}_"
                fig[mode] |= {
                    f"{m}_tok_s": round(on, 1),
                    f"{pre}speedup": round(on / off, 3),
                    f"{pre}acceptance": round(statistics.median(acc[m]), 3) if acc[m] else None,
                    f"runs_{m}": [round(x, 1) for x in rates[m]],
                }
        if not a.skip_vllm and a.smoke and name != "documents":
            # one vLLM start, on the documents: the random workload's tiny model has heads
            # smaller than vLLM's CPU attention takes
            fig["vllm_batch"] = {"skipped": "smoke: vLLM on the documents alone"}
        elif not a.skip_vllm:
            v_on = run_vllm(model, reqs, a.dtype, a.k, eager=a.smoke)
            v_off = {"skipped": "smoke"} if a.smoke else run_vllm(model, reqs, a.dtype, None)
            fig["vllm_batch"] = {"off": v_off, "ngram": v_on}
            if "tok_s" in v_on:
                fig["batch"]["ratio_vs_vllm_ngram"] = round(
                    fig["batch"]["ngram_tok_s"] / v_on["tok_s"], 3
                )
            if "tok_s" in v_off and "tok_s" in v_on:
                fig["vllm_batch"]["speedup"] = round(v_on["tok_s"] / v_off["tok_s"], 3)
        out[name] = fig
    json_line(out, a.smoke)


if __name__ == "__main__":
    main()
