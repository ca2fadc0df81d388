"""The benches that reach vLLM run to their end with --smoke, as a user runs them, in
vLLM's environment (its python runs the bench and its vLLM peers): the vLLM backend beside
the native one, the serving stacks on vLLM engines, `vllm bench serve` against the gateway
and a router (router_latency), and the throughput, model_sizes, quantized and speculative benches with
their vLLM peers (every other step of theirs as well). Checked as
tests/integration/test_bench_smoke.py checks the others. A vLLM engine starts in ~15-20 s
here: these smoke runs take 30-60 s each."""

from __future__ import annotations

from pathlib import Path

import pytest

from plurai.gpu_workers.vllm_backend import cpu_support
from tests.integration.test_bench_smoke import Bench, check, run_smoke

pytestmark = pytest.mark.slow

ROUTER = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "vllm-router"
# the routers' stack where `make peers` installed vllm-router; `add` is left out, as each
# added engine is another vLLM start (the native stack runs it in tests/integration)
STACKS = "plurai-vllm" + (",round_robin" if ROUTER.exists() else "")
SERVING = ["--stacks", STACKS, "--scenarios", "idle,sweep,flood,kill"]

BENCHES = [
    Bench("backends", ("e2e_vllm_tokens_per_s",), server=True, model=True),
    Bench("serving", ("stacks", "plurai-vllm"), SERVING, True, True, "bench.serving"),
    Bench("throughput", ("vllm_tok_s",), model=True),
    Bench("model_sizes", ("dtypes", "fp32", "ratio_vs_vllm", "decode_32"), model=True),
    Bench("quantized", ("perplexity", "w4a16"), model=True),
    Bench("router_latency", ("ratios", "prefix_repetition", "0.9", "plurai-vllm"), model=True),
    Bench("speculative", ("documents", "vllm_batch", "ngram", "tok_s"), model=True),
]
NEEDS_ROUTER = {"router_latency"}  # `make peers` (which `make test` runs) installs it


@pytest.mark.parametrize("bench", [b.param() for b in BENCHES])
def test_bench_runs_to_its_end_with_vllm(bench: Bench) -> None:
    if bench.name in NEEDS_ROUTER and not ROUTER.exists():
        pytest.skip("vllm-router is not installed: make peers")
    figures = run_smoke(bench, timeout_s=500)
    check(bench, figures)
    if bench.name == "serving":
        assert not figures["stacks_not_started"], figures["stacks_not_started"]
        assert set(figures["stacks"]) == set(STACKS.split(","))
    if bench.name == "router_latency":  # the queue hop of every request, from its record
        hop = figures["figures"]["prefix_repetition"]["0.9"]["plurai-vllm"]["hops_ms"]["hop"]
        assert hop["n"] == 8 and 0 < hop["p50"] <= hop["p99"]
    if bench.name == "quantized":
        # vLLM serves w4a16 in bf16 with AVX-512 (on AMX with cpu_support.allow_amx); its
        # build for AVX2 has no kernel for it (tests/vllm/test_quantized.py)
        assert figures["vllm_checkpoints"] == ["w4a16"]
        if cpu_support.isa() == "avx2":
            assert list(figures["vllm_refused"]) == ["w4a16"]
        else:
            assert not figures["vllm_refused"]
            assert figures["vllm_batch_tok_s"]["w4a16"] > 0
