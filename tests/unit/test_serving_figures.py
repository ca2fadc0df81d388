"""The serving bench's figures (bench/serving/figures.py) on hand-computed inputs:
percentiles, latency, SLO attainment, goodput, summaries, prefill."""

from __future__ import annotations

import math

import pytest

from bench.serving.client import Run
from bench.serving.figures import (
    Result,
    Slo,
    attainment,
    failures,
    goodput,
    latency,
    meets,
    percentile,
    prefill,
    results_from_vllm,
    slos_from_idle,
    stack_figures,
)
from bench.serving.report import summary
from bench.serving.workload import (
    BATCH,
    INTERACTIVE,
)

# -- the figures -----------------------------------------------------------------------


def res(i: int, lane: str = INTERACTIVE, ttft: float = 0.1, e2e: float = 1.0, n: int = 11, **kw):
    """A request sent at 100 + i whose first token came after ttft and last after e2e."""
    sent = 100.0 + i
    fields = dict(
        id=f"r{i}",
        lane=lane,
        sent_s=sent,
        first_token_s=sent + ttft,
        end_s=sent + e2e,
        output_tokens=n,
        ok=True,
    )
    fields.update(kw)
    return Result(**fields)


def failed(i: int, lane: str = INTERACTIVE) -> Result:
    return res(i, lane, first_token_s=None, end_s=None, n=0, ok=False, error="engine died")


def test_percentile_linear_between_closest_ranks() -> None:
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert percentile([5.0], 99) == 5.0 and math.isnan(percentile([], 50))


def test_per_request_times() -> None:
    r = res(0, ttft=0.5, e2e=2.5, n=5)
    assert (r.ttft, r.e2e, r.tpot) == (0.5, 2.5, 0.5)  # 2 s over the 4 tokens after the first
    assert res(0, n=1).tpot is None and failed(0).ttft is None


def test_latency_over_successful_requests() -> None:
    rs = [
        res(i, ttft=t, e2e=e, n=3)
        for i, (t, e) in enumerate([(0.1, 1.1), (0.2, 1.2), (0.3, 2.3), (0.4, 1.4)])
    ]
    rs.append(failed(9))
    got = latency(rs)
    assert got["ttft_p50_ms"] == 250.0 and got["ttft_p99_ms"] == pytest.approx(397.0)
    assert got["e2e_p50_ms"] == 1300.0  # 1.1 1.2 1.4 2.3
    assert got["tpot_p50_ms"] == 500.0  # (1.0 1.0 2.0 1.0) / 2 tokens
    assert latency([failed(0)])["ttft_p50_ms"] is None


def test_slo_attainment_counts_failed_and_lost_as_misses() -> None:
    slo = {INTERACTIVE: Slo(ttft_s=0.5, tpot_s=0.2), BATCH: Slo(e2e_s=10.0)}
    rs = [
        res(0, ttft=0.2, e2e=1.2, n=11),  # tpot 0.1: meets
        res(1, ttft=0.6, e2e=1.6, n=11),  # ttft over
        res(2, ttft=0.2, e2e=3.2, n=11),  # tpot 0.3 over
        res(3, ttft=0.2, e2e=0.2, n=1),  # one token: no tpot to miss
        failed(4),
        res(5, BATCH, ttft=5.0, e2e=9.0),  # batch has only an e2e target
        res(6, BATCH, ttft=1.0, e2e=11.0),
    ]
    assert [meets(r, slo[r.lane]) for r in rs] == [True, False, False, True, False, True, False]
    assert attainment(rs, slo) == pytest.approx(3 / 7)
    assert attainment(rs, slo, offered=10) == pytest.approx(3 / 10)
    assert failures(rs, [f"r{i}" for i in range(10)]) == {"failed": 1, "lost": 3}


def test_goodput_is_where_the_attainment_crosses_90_percent() -> None:
    slo = {INTERACTIVE: Slo(ttft_s=1.0)}

    def run(hits: int, misses: int = 0, fails: int = 0) -> list[Result]:
        rs = [res(i, ttft=0.5) for i in range(hits)]
        rs += [res(100 + i, ttft=2.0) for i in range(misses)]
        return rs + [failed(200 + i) for i in range(fails)]

    sweep = [(1.0, run(10)), (2.0, run(19, 1)), (3.0, run(9, 0, 1)), (4.0, run(8, 2))]
    assert goodput(sweep, slo) == 3.0  # 9 of 10 is exactly 90%
    sweep[2] = (3.0, run(8, 0, 2))  # two failures: 80%
    assert goodput(sweep, slo) == 2.3333  # 95% at 2/s, 80% at 3/s: 90% a third of the way
    assert goodput(sweep, slo, offered={2.0: 25}) == 1.4167  # 19 of 25 at 2/s: 76%
    assert goodput(sweep[:2], slo) == 2.0  # every rate made it: the highest
    assert goodput(list(reversed(sweep)), slo) == 2.3333  # in any order
    assert goodput([(1.0, run(1, 1))], slo) is None


def test_summary_pools_a_loads_repeats() -> None:

    slo = {INTERACTIVE: Slo(ttft_s=1.0)}

    def run(name: str, rate: float, hits: int, misses: int, lost: int = 0) -> Run:
        rs = [res(i, ttft=0.5) for i in range(hits)]
        rs += [res(100 + i, ttft=2.0) for i in range(misses)]
        ids = [r.id for r in rs] + [f"lost{i}" for i in range(lost)]
        return Run(name, rate, rs, dict.fromkeys(ids, INTERACTIVE), {})

    runs = [
        run("sweep@0.5", 1.0, 8, 2),  # 80% alone
        run("sweep@1.0", 2.0, 10, 0),
        run("sweep@0.5#1", 1.0, 10, 0),  # with its repeat: 18 of 20, 90%
        run("sweep@1.0#1", 2.0, 7, 2, lost=1),  # 17 of 20: 85%
    ]
    s = summary({"x": runs}, slo, slo)["x"]
    # each round's goodput (2/s met; 90% a third of the way from 1/s at 100% to 2/s at
    # 70%) and their median; each load's attainment over its rounds pooled
    assert s["goodput_req_s_rounds"] == [2.0, 1.3333]
    assert s["goodput_req_s"] == pytest.approx(1.6667, abs=1e-4)
    assert s["sweep_attainment"] == {"1.0": 0.9, "2.0": 0.85}
    assert set(s["runs"]) == {"sweep@0.5", "sweep@1.0", "sweep@0.5#1", "sweep@1.0#1"}


def test_prefill_and_stack_figures() -> None:
    slo = {INTERACTIVE: Slo(ttft_s=0.5), BATCH: Slo(e2e_s=5.0)}
    rs = [
        res(0, ttft=0.1, e2e=1.0, n=10, prompt_tokens=600, cached_tokens=512),
        res(1, ttft=0.3, e2e=2.0, n=10, prompt_tokens=700, cached_tokens=0),
        res(2, BATCH, ttft=1.0, e2e=4.0, n=20, prompt_tokens=1500, cached_tokens=32),
        failed(3, BATCH),
    ]
    assert prefill(rs[:2]) == {
        "prompt_tokens": 1300,
        "cached_tokens": 512,
        "computed_tokens": 788,
        "cached_share": round(512 / 1300, 4),
    }
    lanes = {f"r{i}": INTERACTIVE for i in range(2)} | {"r2": BATCH, "r3": BATCH, "r4": BATCH}
    figs = stack_figures(rs, slo, expected=lanes)
    assert list(figs) == [INTERACTIVE, BATCH, "all"]
    assert figs[INTERACTIVE]["slo_attainment"] == 1.0 and figs[INTERACTIVE]["lost"] == 0
    assert figs[BATCH].items() >= {"requests": 3, "failed": 1, "lost": 1}.items()
    assert figs[BATCH]["slo_attainment"] == round(1 / 3, 4)
    assert figs["all"]["requests"] == 5 and figs["all"]["slo_attainment"] == 0.6
    assert figs["all"]["computed_tokens"] == 2800 - 544
    # 3 completed, 40 tokens, from the first send (100) to the last end (102 + 4)
    assert figs["all"]["req_s"] == 0.5 and figs["all"]["output_tok_s"] == round(40 / 6, 3)


def test_slos_from_idle() -> None:
    idle = [res(i, ttft=t, e2e=t + 1.0, n=11) for i, t in enumerate([0.1, 0.2, 0.3])]
    idle.append(res(5, BATCH, ttft=0.4, e2e=2.4, n=11))
    slo = slos_from_idle(idle, ttft_factor=5, tpot_factor=2)
    assert slo[INTERACTIVE].ttft_s == pytest.approx(1.0) and slo[
        INTERACTIVE
    ].tpot_s == pytest.approx(0.2)
    assert slo[BATCH].ttft_s == pytest.approx(2.0) and slo[BATCH].tpot_s == pytest.approx(0.4)


def test_results_from_vllm_saved_json() -> None:
    saved = {
        "start_times": [10.0, 11.0],
        "ttfts": [0.2, 0.0],
        "latencies": [1.2, 0.0],
        "output_lens": [6, 0],
        "input_lens": [600, 700],
        "errors": ["", "HTTP 500"],
    }
    a, b = results_from_vllm(saved, ["r0", "r1"], [INTERACTIVE, BATCH])
    assert (a.ok, a.prompt_tokens, a.output_tokens) == (True, 600, 6)
    assert (a.ttft, a.e2e, a.tpot) == pytest.approx((0.2, 1.2, 0.2))
    assert (b.ok, b.lane, b.error, b.end_s) == (False, BATCH, "HTTP 500", None)
