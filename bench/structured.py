"""Constrained decoding: tokens/s of a batch where half the requests carry a JSON schema
(response_format) against the same batch unconstrained, on the native engine.

The same work both ways: the constrained batch runs first and its outputs fix each
request's output length; the unconstrained batch then asks for exactly those lengths
(ignore_eos), on the same prompts and sampling settings, so both produce the same tokens
per request and the batches shrink alike as requests end. What differs is the constraint:
compiling the schemas (a fresh engine per run, so the grammar cache starts cold), the
token masks of the constrained rows each step, and advancing the matchers. Every
constrained output is parsed and validated with `jsonschema`.

With --libraries, the grammar libraries are compared on this model's tokenizer alone:
compile time and per-token mask time of llguidance (the engine's) and xgrammar (when
installed), driving each schema with random logits.

The last line is one JSON object of the measured figures and ratios. --smoke: four short
requests (two constrained) on the tiny test model, one run, the libraries too: a check
that the bench runs, not a measurement.

    python bench/structured.py [--requests 32] [--runs 3] [--max-tokens 128] [--libraries]
        [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.workload import (  # noqa: E402
    SMOKE_KV_BYTES,
    add_smoke_arg,
    bench_model,
    cpu_isa,
    json_line,
    mixed,
    smoke_model,
)

# bounded strings (a pattern, an enum or a maxLength): a random-weight model would rarely
# close a free one, and the outputs must end by themselves to be checked
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{2,8}@[a-z]{2,8}\\.com$"},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "topics": {
                "type": "array",
                "items": {"enum": ["price", "service", "quality", "delivery"]},
                "minItems": 1,
                "maxItems": 4,
            },
        },
        "required": ["label", "confidence", "topics"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "invoice": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
            "lines": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 5,
            },
            "paid": {"type": "boolean"},
        },
        "required": ["invoice", "lines", "paid"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 24},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            # a multipleOf bounds the digits too: a random-weight model, free to write a
            # number's fraction, may write digits until max_tokens (a cut-off, "length")
            "rating": {"type": ["number", "null"], "minimum": 0, "maximum": 10, "multipleOf": 0.1},
            "meta": {
                "type": "object",
                "properties": {
                    "lang": {"enum": ["en", "fr", "de"]},
                    "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
                },
                "required": ["lang"],
                "additionalProperties": False,
            },
        },
        "required": ["title", "year", "meta"],
        "additionalProperties": False,
    },
]


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def run(
    model: Path, prompts: list[list[int]], params: list, dtype: str, kv_bytes: int | None = None
) -> tuple[float, list, dict]:
    """One batch on a fresh engine: seconds, completions, and the constraint's own figures.
    kv_bytes: the engine's KV budget (None: the default)."""
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig
    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    kv = {"kv_cache_bytes": kv_bytes} if kv_bytes else {}
    engine = Engine(EngineConfig(model=str(model), dtype=dtype, prefix_caching=False, **kv))
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4))  # warm-up
    masks = {"s": 0.0, "calls": 0}
    allowed = engine.grammars.allowed

    def timed(matchers: list, drafts: list | None = None) -> Any:
        t = time.perf_counter()
        try:
            return allowed(matchers, drafts)
        finally:
            masks["s"] += time.perf_counter() - t
            masks["calls"] += 1

    engine.grammars.allowed = timed  # type: ignore[method-assign]
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return (
        elapsed,
        out,
        {"mask_s": masks["s"], "mask_steps": masks["calls"], "steps": engine.num_steps},
    )


def compare_libraries(model: Path, tokens: int = 200) -> dict[str, Any]:
    """Compile and per-token mask times of llguidance and xgrammar on this tokenizer."""
    import llguidance
    import llguidance.hf
    import numpy as np
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    vocab = AutoConfig.from_pretrained(str(model)).vocab_size
    words = (vocab + 31) // 32
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}

    def drive(start: Any, fill: Any, consume: Any, done: Any) -> float:
        """Seconds per token of fill + consume over a random-logits walk."""
        bits = torch.zeros(1, words, dtype=torch.int32)
        n, spent = 0, 0.0
        while not done() and n < tokens:
            t = time.perf_counter()
            fill(bits)
            spent += time.perf_counter() - t
            ok = np.unpackbits(bits.numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)
            logits = torch.randn(vocab, generator=gen)
            logits[~torch.from_numpy(ok)] = float("-inf")
            t = time.perf_counter()
            consume(int(logits.argmax()))
            spent += time.perf_counter() - t
            n += 1
        return spent / max(n, 1)

    lt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    ex = llguidance.LLExecutor()
    compile_s, per_token = [], []
    for s in SCHEMAS:
        t = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(s), defaults={"whitespace_flexible": False}
        )
        m = llguidance.LLMatcher(lt, g)
        compile_s.append(time.perf_counter() - t)
        per_token.append(
            drive(
                m,
                lambda b, m=m: ex.unsafe_compute_mask_ptr([(m, 0)], b.data_ptr(), words * 4, 1),
                m.consume_token,
                m.is_stopped,
            )
        )
    out["llguidance"] = {
        "version": llguidance.__version__ if hasattr(llguidance, "__version__") else "?",
        "compile_ms_median": round(sorted(compile_s)[len(compile_s) // 2] * 1e3, 2),
        "mask_us_per_token_median": round(sorted(per_token)[len(per_token) // 2] * 1e6, 1),
        "refuses_unenforceable": True,
    }
    try:
        import xgrammar as xgr
    except ImportError:
        out["xgrammar"] = "not installed"
        return out
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    comp = xgr.GrammarCompiler(info, cache_enabled=False)
    compile_s, per_token = [], []
    for s in SCHEMAS:
        t = time.perf_counter()
        cg = comp.compile_json_schema(json.dumps(s), any_whitespace=False)
        compile_s.append(time.perf_counter() - t)
        gm = xgr.GrammarMatcher(cg)
        per_token.append(
            drive(
                gm,
                lambda b, gm=gm: gm.fill_next_token_bitmask(b, 0),
                gm.accept_token,
                gm.is_terminated,
            )
        )
    # does it refuse a keyword it cannot enforce, as llguidance does?
    try:
        comp.compile_json_schema(json.dumps({"type": "array", "uniqueItems": True}))
        refuses = False
    except Exception:
        refuses = True
    out["xgrammar"] = {
        "compile_ms_median": round(sorted(compile_s)[len(compile_s) // 2] * 1e3, 2),
        "mask_us_per_token_median": round(sorted(per_token)[len(per_token) // 2] * 1e6, 1),
        "refuses_unenforceable": refuses,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="models/bench-llama")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160, help="of each constrained request")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--libraries", action="store_true", help="also compare grammar libraries")
    add_smoke_arg(ap)
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.runs, args.max_tokens, args.libraries = 4, 1, 64, True

    import jsonschema

    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    model = smoke_model() if args.smoke else bench_model(args.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(model)).vocab_size
    lengths = {"prompt_median": 16, "output_median": 8} if args.smoke else {}
    reqs = mixed(args.requests, vocab, args.seed, **lengths)
    kv = SMOKE_KV_BYTES if args.smoke else None
    prompts = [r.prompt for r in reqs]

    def sampling(i: int) -> dict[str, Any]:
        # a third of the rows sample (seeded, so every run draws the same tokens)
        return {"temperature": 0.8, "top_p": 0.95, "seed": i} if i % 3 == 1 else {}

    schema_of = {i: SCHEMAS[(i // 2) % len(SCHEMAS)] for i in range(0, len(reqs), 2)}
    constrained = [
        SamplingParams(
            max_tokens=args.max_tokens, response_format=response_format(schema_of[i]), **sampling(i)
        )
        if i in schema_of
        else SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, **sampling(i))
        for i, r in enumerate(reqs)
    ]
    print(
        f"{len(reqs)} requests, {len(schema_of)} constrained ({len(SCHEMAS)} schemas); "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    times: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    mask_share: list[float] = []
    lengths: list[int] | None = None
    valid = total = cut = 0
    result: dict[str, Any] = {
        "bench": "structured",
        "requests": len(reqs),
        "constrained_requests": len(schema_of),
    }
    for n in range(args.runs):
        t, out, figures = run(model, prompts, constrained, args.dtype, kv)
        got = [len(c.token_ids) for c in out]
        assert lengths is None or got == lengths, "a constrained run gave other lengths"
        lengths = got
        for i in schema_of:
            total += 1
            cut += out[i].finish_reason == "length"
            try:
                jsonschema.validate(json.loads(out[i].text), schema_of[i])
                valid += out[i].finish_reason == "stop"
            except (ValueError, jsonschema.ValidationError):
                pass
        times["constrained"].append(t)
        mask_share.append(figures["mask_s"] / t)
        # the same work unconstrained: each request produces as many tokens as it did above
        plain = [
            SamplingParams(max_tokens=got[i], ignore_eos=True, **sampling(i))
            for i in range(len(reqs))
        ]
        u, out_u, _ = run(model, prompts, plain, args.dtype, kv)
        assert [len(c.token_ids) for c in out_u] == got
        times["unconstrained"].append(u)
        tokens = sum(got)
        print(
            f"run {n + 1}: constrained {tokens / t:7.1f} tok/s ({t:.2f}s, masks {figures['mask_s'] * 1e3:.0f} ms "
            f"over {figures['mask_steps']} steps), unconstrained {tokens / u:7.1f} tok/s ({u:.2f}s)",
            flush=True,
        )
    assert lengths is not None
    tokens = sum(lengths)

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    result.update(
        {
            "output_tokens": tokens,
            "constrained_output_tokens": sum(lengths[i] for i in schema_of),
            "constrained_tok_s": round(tokens / med(times["constrained"]), 1),
            "unconstrained_tok_s": round(tokens / med(times["unconstrained"]), 1),
            "constrained_runs_tok_s": [round(tokens / x, 1) for x in times["constrained"]],
            "unconstrained_runs_tok_s": [round(tokens / x, 1) for x in times["unconstrained"]],
            "mask_share_of_time_median": round(med(mask_share), 4),
            "schema_valid": f"{valid}/{total}",
            "schema_valid_share": round(valid / total, 4) if total else None,
            "cut_off_at_max_tokens": cut,
        }
    )
    result["ratio_constrained_vs_unconstrained"] = round(
        result["constrained_tok_s"] / result["unconstrained_tok_s"], 3
    )
    if args.libraries:
        result["libraries"] = compare_libraries(model)
    result["dtype"] = args.dtype
    result["machine"] = f"{platform.machine()} {os.cpu_count()} cpus"
    result["isa"] = cpu_isa()
    from plurai.gpu_workers.kernels import build_isa

    result["kernels_isa"] = build_isa()
    json_line(result, args.smoke)


if __name__ == "__main__":
    main()
