"""A serving run's figures: per run and stack (latency, SLO attainment, recovery after a
kill), summed over a sweep's loads and rounds (goodput), and the ratios against the best
router that the JSON line ends with."""

from __future__ import annotations

import math
import statistics
from typing import Any

from bench.serving import figures as sf
from bench.serving.client import Run
from bench.serving.workload import (
    INTERACTIVE,
)


def recovery_s(results: list[sf.Result], at: float, window: float = 3.0) -> float | None:
    """Seconds from `at` (a kill) to the first completion of the first `window` after it
    whose completions per second are back to 80% of the rate before `at`; None: never
    within the run."""
    ends = sorted(r.end_s for r in results if r.ok and r.end_s is not None)
    before = sum(1 for e in ends if 0 < e <= at) / at if at > 0 else 0.0
    if before <= 0 or not ends:
        return None
    t = at + window
    while t <= ends[-1] + window:
        inside = [e for e in ends if t - window < e <= t]
        if len(inside) / window >= 0.8 * before:
            return round(max(0.0, inside[0] - at), 2)
        t += 0.25
    return None


# -- the report -------------------------------------------------------------------------


def run_figures(run: Run, slos: dict[str, sf.Slo]) -> dict[str, Any]:
    return {
        "offered_req_s": run.offered_req_s,
        **sf.stack_figures(run.results, slos, run.expected),
        "cpu_s": run.cpu_s,
        **run.extra,
    }


def loads(
    rs: list[Run], scenario: str, slos: dict[str, sf.Slo], good_key: str, share_key: str
) -> dict[str, Any]:
    """Goodput over a scenario's loads, and each load's attainment (a load's repeats pooled,
    over every request sent at that rate). With --repeats, goodput is each round's own
    (`<good_key>_rounds`) and their median."""
    pooled: dict[float, list[sf.Result]] = {}
    offered: dict[float, int] = {}
    by_round: dict[int, list[Run]] = {}
    for r in rs:
        if r.scenario.startswith(f"{scenario}@"):
            pooled.setdefault(r.offered_req_s, []).extend(r.results)
            offered[r.offered_req_s] = offered.get(r.offered_req_s, 0) + len(r.expected)
            by_round.setdefault(int(r.scenario.partition("#")[2] or 0), []).append(r)
    rounds = [
        sf.goodput(
            [(r.offered_req_s, r.results) for r in runs],
            slos,
            offered={r.offered_req_s: len(r.expected) for r in runs},
        )
        for _, runs in sorted(by_round.items())
    ]
    good = median_of(rounds)
    out: dict[str, Any] = {
        good_key: good,
        share_key: {
            str(rate): round(sf.attainment(res, slos, offered[rate]), 4)
            for rate, res in sorted(pooled.items())
        },
    }
    if len(rounds) > 1:
        out[f"{good_key}_rounds"] = rounds
    return out


def median_of(values: list[float | None]) -> float | None:
    """The median, a round that met no SLO at any load counted as 0; None if none did."""
    if all(v is None for v in values):
        return None
    return round(statistics.median(v or 0.0 for v in values), 4)


def summary(
    runs: dict[str, list[Run]], slos: dict[str, sf.Slo], trace_slos: dict[str, sf.Slo]
) -> dict[str, Any]:
    """Per stack: every run's figures, goodput over the sweep and the trace (by the
    trace's own SLOs), and the target figures."""
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        by = {r.scenario: r for r in rs}
        s: dict[str, Any] = {
            **loads(rs, "sweep", slos, "goodput_req_s", "sweep_attainment"),
            "runs": {
                k: run_figures(v, trace_slos if k.startswith("trace@") else slos)
                for k, v in by.items()
            },
        }
        if any(r.scenario.startswith("trace@") for r in rs):
            s.update(loads(rs, "trace", trace_slos, "trace_goodput_req_s", "trace_attainment"))
            computed = [
                f["all"].get("computed_tokens")
                for k, f in s["runs"].items()
                if k.startswith("trace@")
            ]
            s["trace_prefill_computed_tokens"] = sum(c for c in computed if c is not None)
        if "flood" in by:
            p99 = s["runs"]["flood"][INTERACTIVE]["ttft_p99_ms"]
            s["flood_interactive_ttft_p99_s"] = None if p99 is None else round(p99 / 1000, 3)
        if "kill" in by:
            k = s["runs"]["kill"]["all"]
            s["kill_failed"], s["kill_lost"] = k["failed"], k["lost"]
            s["kill_recovery_s"] = by["kill"].extra["kill"]["recovery_s"]
        if "add" in by:
            s["add_ready_to_load_s"] = by["add"].extra["add"]["ready_to_load_s"]
        computed = [f["all"].get("computed_tokens") for f in s["runs"].values()]
        s["prefill_computed_tokens"] = sum(c for c in computed if c is not None)
        out[name] = s
    return out


def ratios(stacks: dict[str, Any], ours: str = "plurai-vllm") -> dict[str, Any]:
    """Ours against the best router policy on each target figure."""
    routers = {k: v for k, v in stacks.items() if not k.startswith("plurai-")}
    if ours not in stacks or not routers:
        return {}
    me = stacks[ours]

    def best(key: str, high: bool) -> tuple[str, Any] | None:
        vals = [(k, v.get(key)) for k, v in routers.items() if v.get(key) is not None]
        vals = [(k, v) for k, v in vals if not (isinstance(v, float) and math.isnan(v))]
        if not vals:
            return None
        return max(vals, key=lambda x: x[1]) if high else min(vals, key=lambda x: x[1])

    out: dict[str, Any] = {}
    for key, high, target in (
        ("goodput_req_s", True, ">= 1.3"),
        ("trace_goodput_req_s", True, ">= 1.3"),
        ("flood_interactive_ttft_p99_s", False, "<= 0.5"),
        ("prefill_computed_tokens", False, "<= 1.0"),
        ("trace_prefill_computed_tokens", False, "<= 0.9"),
    ):
        b, mine = best(key, high), me.get(key)
        if b is None or mine is None or not b[1]:
            continue
        out[key] = {"ratio": round(mine / b[1], 3), "best_router": b[0], "target": target}
        per = round_ratios(me, routers, f"{key}_rounds")
        if per:  # each round's against that round's best router: their median and spread
            out[key] |= {"ratio": median_of(per), "rounds": per, "spread": [min(per), max(per)]}
    if "kill_failed" in me:
        out["kill_failed_or_lost"] = {
            "plurai": me["kill_failed"] + me["kill_lost"],
            **{k: v.get("kill_failed", 0) + v.get("kill_lost", 0) for k, v in routers.items()},
            "target": "0 for plurai",
        }
    if "add_ready_to_load_s" in me:
        out["add_ready_to_load_s"] = {
            "plurai": me["add_ready_to_load_s"],
            **{k: v.get("add_ready_to_load_s") for k, v in routers.items()},
            "target": "<= 5 s",
        }
    return out


def round_ratios(me: dict[str, Any], routers: dict[str, Any], key: str) -> list[float]:
    """Per round of --repeats, our goodput over the best router's in that round."""
    mine = me.get(key) or []
    out = []
    for i, g in enumerate(mine):
        theirs = [v[key][i] for v in routers.values() if len(v.get(key) or []) > i]
        best = max((t for t in theirs if t is not None), default=None)
        if best:
            out.append(round((g or 0.0) / best, 3))
    return out
