"""bench/serving/'s own arithmetic and wiring: recovery after a kill, ratios against
the best router, CPU used, the saturated rate, the stacks' settings, its results file."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from bench.serving.client import Run, slos_from, slowest_share
from bench.serving.figures import (
    Result,
    Slo,
    saturated_rate,
)
from bench.serving.report import ratios, recovery_s, summary
from bench.serving.stacks import EngineSpec, PluraiStack, RouterStack, cpu_used, rounds
from bench.serving.workload import (
    INTERACTIVE,
)

# -- bench/serving/'s own arithmetic --------------------------------------------------
from .test_serving_figures import res


def _done(i: int, end: float) -> Result:
    return Result(f"r{i}", INTERACTIVE, end - 1.0, end - 0.5, end, 8, True)


def test_recovery_after_a_kill() -> None:

    # 2 completions/s for 10 s, nothing for 4 s after the kill at 10 s, then 2/s again
    ends = [0.25 + 0.5 * i for i in range(20)] + [14.25 + 0.5 * i for i in range(20)]
    results = [_done(i, e) for i, e in enumerate(ends)]
    got = recovery_s(results, at=10.0)
    assert got == 4.25  # the first completion after the gap
    # a stack that never serves again does not recover
    assert recovery_s(results[:20], at=10.0) is None
    # one that never slowed down: recovered at once
    steady = [_done(i, 0.25 + 0.5 * i) for i in range(60)]
    assert recovery_s(steady, at=10.0) == 0.25


def test_ratios_against_the_best_router_on_each_figure() -> None:

    stacks = {
        "plurai-vllm": {
            "goodput_req_s": 1.3,
            "flood_interactive_ttft_p99_s": 0.5,
            "prefill_computed_tokens": 900,
            "kill_failed": 0,
            "kill_lost": 0,
            "add_ready_to_load_s": 0.4,
        },
        "round_robin": {
            "goodput_req_s": 0.65,
            "flood_interactive_ttft_p99_s": 2.0,
            "prefill_computed_tokens": 1500,
            "kill_failed": 3,
            "kill_lost": 0,
            "add_ready_to_load_s": 1.0,
        },
        "cache_aware": {
            "goodput_req_s": 1.0,
            "flood_interactive_ttft_p99_s": 1.0,
            "prefill_computed_tokens": 1000,
            "kill_failed": 2,
            "kill_lost": 1,
            "add_ready_to_load_s": 1.2,
        },
    }
    # a Plurai stack of another variant is no router, and has its own ratios
    stacks["plurai-vllm-notier"] = {"goodput_req_s": 2.0, "prefill_computed_tokens": 500}
    r = ratios(stacks)
    assert r["goodput_req_s"] == {"ratio": 1.3, "best_router": "cache_aware", "target": ">= 1.3"}
    assert ratios(stacks, "plurai-vllm-notier")["goodput_req_s"]["ratio"] == 2.0
    assert r["flood_interactive_ttft_p99_s"]["ratio"] == 0.5
    assert r["flood_interactive_ttft_p99_s"]["best_router"] == "cache_aware"
    assert r["prefill_computed_tokens"]["ratio"] == 0.9
    assert r["kill_failed_or_lost"]["plurai"] == 0
    assert r["kill_failed_or_lost"]["cache_aware"] == 3
    assert r["add_ready_to_load_s"]["round_robin"] == 1.0
    # a router with no goodput at all (no rate met the SLOs) is no best
    stacks["cache_aware"]["goodput_req_s"] = None
    assert ratios(stacks)["goodput_req_s"]["best_router"] == "round_robin"
    # with rounds: each round against that round's best router, the median and spread
    stacks["plurai-vllm"]["trace_goodput_req_s"] = 3.0
    stacks["plurai-vllm"]["trace_goodput_req_s_rounds"] = [3.0, 2.0, None]
    stacks["round_robin"]["trace_goodput_req_s"] = 2.0
    stacks["round_robin"]["trace_goodput_req_s_rounds"] = [2.0, 1.0, 1.0]
    stacks["cache_aware"]["trace_goodput_req_s_rounds"] = [1.0, 2.0, None]
    t = ratios(stacks)["trace_goodput_req_s"]
    assert t["rounds"] == [1.5, 1.0, 0.0] and t["spread"] == [0.0, 1.5]
    assert t["ratio"] == 1.0


def test_cpu_used_counts_the_processes_alive_at_the_end() -> None:

    before = {"engines": {1: 10.0, 2: 20.0}, "front": {3: 1.0}}
    after = {"engines": {2: 26.5, 4: 3.0}, "front": {3: 1.5}, "redis": {}}
    # engine 1 was killed (its time went with it), engine 4 started in between
    assert cpu_used(before, after) == {"engines": 9.5, "front": 0.5, "redis": 0}


def test_the_saturated_rate_leaves_out_the_drain_tail() -> None:
    # eight completions a second for 1.5 s, then the last few alone, slowly
    ends = [0.125 * i for i in range(1, 13)] + [3.0, 5.0, 8.0, 12.0]
    assert saturated_rate(ends) == pytest.approx(12 / 1.5)
    assert saturated_rate([2.0]) == pytest.approx(0.5)
    assert saturated_rate([]) == 0.0


def test_the_slowest_interactive_first_tokens_split_into_queue_and_engine() -> None:

    def res(i: int, ttft: float, lane: str = "interactive") -> Result:
        return Result(f"r{i}", lane, 0.0, ttft, ttft + 1.0, 8, True)

    # 40 interactive requests: the two slowest (5%) waited 3 of 4 s and 1 of 5 s queued,
    # then 0.5 s and 3 s to the worker's first token; the second's intake is not known
    results = [res(i, 0.1) for i in range(38)] + [res(38, 4.0), res(39, 5.0), res(40, 9.0, "batch")]
    times = {f"r{i}": {"intake_ms": 1, "queue_ms": 10, "engine_ms": 50} for i in range(38)}
    times["r38"] = {"intake_ms": 200, "queue_ms": 3000, "engine_ms": 500}
    times["r39"] = {"intake_ms": None, "queue_ms": 1000, "engine_ms": 3000}
    times["r40"] = {"intake_ms": 0, "queue_ms": 9000, "engine_ms": None}
    got = slowest_share(results, times)
    assert got == {
        "n": 2,
        "ttft_ms": 4500.0,
        "intake_share": 0.05,
        "queue_share": pytest.approx(0.475),
        "engine_share": pytest.approx((0.125 + 0.6) / 2, abs=1e-3),
    }
    assert slowest_share([res(0, 0.2, "batch")], {"r0": {"queue_ms": 5}}) == {"n": 0}


def test_bound_peers_run_wholly_on_their_engines_core(tmp_path: Path) -> None:
    import shutil

    if shutil.which("taskset") is None:
        pytest.skip("taskset is not installed")
    spec = EngineSpec(model=tmp_path, name="m", dtype="bfloat16", max_model_len=768)
    cmd, env = RouterStack("round_robin", spec, 2, tmp_path).engine_cmd(1, 8000)
    assert "taskset" not in cmd and env["VLLM_CPU_OMP_THREADS_BIND"] == str(spec.core(1))
    bound = EngineSpec(
        model=tmp_path, name="m", dtype="bfloat16", max_model_len=768, bind_peers=True
    )
    cmd, _ = RouterStack("round_robin", bound, 2, tmp_path).engine_cmd(1, 8000)
    assert cmd[:3] == ["taskset", "-c", str(bound.core(1))] and "serve" in cmd


def test_a_plurai_stack_gives_its_workers_the_operators_targets(tmp_path: Path) -> None:

    spec = EngineSpec(model=tmp_path, name="m", dtype="bfloat16", max_model_len=768)
    stack = PluraiStack("vllm", spec, 2, tmp_path)
    _, env = stack.engine_cmd(0)
    assert "PLURAI_TOP_LANE_TPOT_MS" not in env and "PLURAI_TOP_LANE_WAIT_MS" not in env
    stack.tpot_ms, stack.wait_ms = 24.4, 105.2
    _, env = stack.engine_cmd(0)
    assert env["PLURAI_TOP_LANE_TPOT_MS"] == "24" and env["PLURAI_TOP_LANE_WAIT_MS"] == "105"


def test_a_results_file_line_with_the_stacks_record_reads_back() -> None:
    # bench/serving/ writes each result with what the job's record says beside it
    row = {
        **asdict(Result("r1", "batch", 1.0, 1.5, 3.0, 8, True, None, 200, 128)),
        "job": "abc",
        "created_ms": 5,
        "queue_ms": 10,
        "engine_ms": None,
        "intake_ms": 2,
    }
    got = Result.from_row(json.loads(json.dumps(row)))
    assert got == Result("r1", "batch", 1.0, 1.5, 3.0, 8, True, None, 200, 128)
    assert got.ttft == pytest.approx(0.5)


def test_the_trace_is_judged_by_its_own_slos() -> None:
    """The trace's prompts are of other lengths than the mixed workload's: its runs are
    scored by the SLOs of its own idle requests, the sweep's by the mixed ones'."""

    mixed, trace = {INTERACTIVE: Slo(ttft_s=1.0)}, {INTERACTIVE: Slo(ttft_s=3.0)}
    rs = [res(i, ttft=2.0) for i in range(10)]
    runs = [
        Run(n, 1.0, rs, dict.fromkeys([r.id for r in rs], INTERACTIVE), {})
        for n in ("sweep@1.0", "trace@1.0")
    ]
    s = summary({"x": runs}, mixed, trace)["x"]
    assert s["sweep_attainment"] == {"1.0": 0.0} and s["goodput_req_s"] is None
    assert s["trace_attainment"] == {"1.0": 1.0} and s["trace_goodput_req_s"] == 1.0
    assert s["runs"]["trace@1.0"]["all"]["slo_attainment"] == 1.0
    assert s["runs"]["sweep@1.0"]["all"]["slo_attainment"] == 0.0


def test_a_bench_scripts_folder_shadows_nothing_transformers_imports() -> None:
    # `python -m bench.serving` puts bench/ first on sys.path: a file there named like a
    # package transformers probes for (bench/kernels.py against `kernels`) broke making the
    # bench model on a fresh clone
    bench = Path(__file__).resolve().parents[2] / "bench"
    code = "import transformers; from transformers import LlamaConfig, Qwen3Config"
    run = subprocess.run([sys.executable, "-c", code], cwd=bench, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_a_later_run_takes_an_earlier_runs_slos(tmp_path: Path) -> None:

    slos = {
        "interactive": {"ttft_s": 0.5, "tpot_s": 0.08, "e2e_s": None},
        "batch": {"ttft_s": None, "tpot_s": None, "e2e_s": 6.2},
    }
    out = tmp_path / "out.json"
    out.write_text("progress\n" + json.dumps({"slos": slos, "stacks": {}}) + "\n")
    got, trace = slos_from(str(out))
    assert got["interactive"] == Slo(ttft_s=0.5, tpot_s=0.08)
    assert got["batch"] == Slo(e2e_s=6.2)
    assert trace is None
    # and the trace's own, where that run replayed it
    trace_slos = {"interactive": {"ttft_s": 1.5, "tpot_s": 0.06, "e2e_s": None}}
    out.write_text(json.dumps({"slos": slos, "trace_slos": trace_slos}) + "\n")
    assert slos_from(str(out))[1] == {"interactive": Slo(ttft_s=1.5, tpot_s=0.06)}
    out.write_text('{"stacks": {}}\n')  # a run that did not finish
    with pytest.raises(SystemExit, match="no SLOs of a finished run"):
        slos_from(str(out))


def test_each_round_of_the_sweep_runs_every_stack_in_turn() -> None:

    stacks = ["round_robin", "cache_aware", "plurai-vllm"]
    # a slow stretch of the machine lands on every stack's rounds, not on the last stack's
    assert rounds(stacks, ["idle", "sweep"], 2) == [
        (0, "round_robin"),
        (0, "cache_aware"),
        (0, "plurai-vllm"),
        (1, "round_robin"),
        (1, "cache_aware"),
        (1, "plurai-vllm"),
    ]
    # without a sweep there is nothing to go round again
    assert rounds(stacks, ["idle", "flood", "kill"], 3) == [(0, s) for s in stacks]
    assert rounds(stacks[:1], ["sweep"], 0) == [(0, "round_robin")]
