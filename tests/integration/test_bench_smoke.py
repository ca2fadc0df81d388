"""Every bench under bench/ that needs only this environment runs to its end with --smoke,
as a user runs it (`python bench/X.py --smoke`, or `python -m bench.serving --smoke` for a
module of a package, from the repository root, with this environment's python), and ends with its one JSON line of figures. Those with a vLLM peer
(backends, throughput, model_sizes, quantized, speculative) run in tests/vllm/test_bench_smoke.py, in
vLLM's environment, which `make test` installs beside this suite; the serving bench runs
in both: here its native stack alone (every scenario), there its vLLM stacks.

Each bench is a fresh interpreter running a whole bench end to end: `slow`, and `server`
or `model` where it starts a redis-server or builds or loads a model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from bench.__main__ import source
from tests.integration.conftest import ROOT

pytestmark = pytest.mark.slow

TIMEOUT_S = 300  # a smoke run takes 1-30 s here; the rest is room for a busy machine


@dataclass
class Bench:
    name: str
    expect: tuple[str, ...]  # a figure the bench always reports (a path into its JSON)
    args: list[str] = field(default_factory=list)
    server: bool = False  # starts a redis-server
    model: bool = False  # builds or loads a model
    module: str = ""  # run as `python -m <module>`; else bench/<name>.py

    @property
    def command(self) -> list[str]:
        return ["-m", self.module] if self.module else [f"bench/{self.name}.py"]

    @property
    def file(self) -> str:
        return source(self.module) if self.module else self.name

    def param(self) -> Any:
        marks = [pytest.mark.server] * self.server + [pytest.mark.model] * self.model
        return pytest.param(self, id=self.name, marks=marks)


BENCHES = [
    Bench("bulk", ("pipeline_tokens_per_s",), server=True, model=True),
    Bench("cpu_kernels", ("in_place_tok_s", "all_kernels"), model=True),
    Bench("dashboard", ("per_reading", "100"), server=True),
    Bench("fleet_sim", ("jobs_per_s", "4"), server=True),
    Bench("gateway", ("gateway_jobs_per_s",), server=True, model=True),
    Bench("overhead", ("overhead_share_median",), model=True),
    Bench("parallel", ("step_ratio_vs_first",), model=True),
    Bench("simulation", ("sizes", "4", "pull"), module="bench.serving.simulation"),
    Bench("prefix_reuse", ("ttft_redis_ms",), server=True, model=True),
    Bench("priority", ("p99_ratio",), server=True, model=True),
    Bench("queue_overhead", ("redis_cost", "every_token"), server=True, model=True),
    # every scenario, the production trace's too (../shared/traces, else bench/traces)
    Bench(
        "serving",
        ("stacks", "plurai-native", "trace_attainment"),
        ["--stacks", "plurai-native"],
        True,
        True,
        "bench.serving",
    ),
    Bench("workload", ("vllm_trace_args",), model=True, module="bench.serving.workload"),
    Bench("step_profile", ("run_over_gemm",), model=True),
    Bench("structured", ("libraries", "llguidance"), model=True),
    Bench("tracing", ("spans_per_job",), server=True, model=True),
]
# scripts that are no bench: the vLLM side of other benches, run by them, and the index
HELPERS = {"vllm_peer", "plurai_peer", "vllm_cli", "__main__"}


def run_smoke(bench: Bench, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """`python bench/<name>.py --smoke` (or `python -m <module> --smoke`) from the repository root: its JSON line, once it has
    exited 0. Run in a session of its own, so that a run cut off at the timeout takes the
    workers and redis-servers it started with it."""
    cmd = [sys.executable, *bench.command, "--smoke", *bench.args]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not end in {timeout_s} s:\n{err[-3000:]}")
    seconds = time.monotonic() - start
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{err[-3000:]}"
    lines = out.strip().splitlines()
    assert lines, f"{' '.join(cmd)} printed nothing:\n{err[-3000:]}"
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict), lines[-1][:300]
    print(f"{bench.name}: {seconds:.1f} s")  # shown with -s or on failure
    return figures


def check(bench: Bench, figures: dict[str, Any]) -> None:
    """The ISA of this machine, the smoke mark, and the figure the bench always reports."""
    assert isinstance(figures.get("isa"), str) and figures["isa"], figures.get("isa")
    assert figures.get("smoke") is True
    assert isinstance(figures.get("wall_s"), float | int) and figures["wall_s"] >= 0
    at: Any = figures
    for key in bench.expect:
        assert isinstance(at, dict) and key in at, f"no {'.'.join(bench.expect)} in {figures}"
        at = at[key]


@pytest.mark.parametrize("bench", [b.param() for b in BENCHES])
def test_bench_runs_to_its_end(bench: Bench) -> None:
    check(bench, run_smoke(bench))


def test_every_bench_script_has_a_smoke_test() -> None:
    """A script added under bench/ is run here or in tests/vllm, or it rots unseen."""
    from tests.vllm.test_bench_smoke import BENCHES as VLLM_BENCHES

    scripts = {
        str(p.relative_to(ROOT / "bench").with_suffix(""))
        for p in (ROOT / "bench").rglob("*.py")
        if 'if __name__ == "__main__"' in p.read_text()
    }
    tested = {b.file for b in BENCHES + VLLM_BENCHES}
    assert scripts - HELPERS <= tested, scripts - HELPERS - tested
