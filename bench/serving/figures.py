"""The serving bench's figures, from one result per request: latency percentiles per lane,
SLO attainment, goodput over a sweep of offered load, prefill computed against served from
a cache, failed and lost requests. Pure functions; times in seconds on any one clock.

Percentiles are linear interpolation between the closest ranks (numpy's default, as
`vllm bench serve` reports them): for sorted x of n values, p lies at rank
h = (n - 1) * p / 100 and is x[floor h] + (h - floor h) * (x[floor h + 1] - x[floor h]).
TPOT is (end - first token) / (output tokens - 1), for requests of 2 tokens or more.
Goodput is the highest offered rate of a sweep at which >= 90% of the requests met their
lane's SLO; failed and lost requests count as misses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

LANES = ("interactive", "batch")


@dataclass
class Result:
    id: str
    lane: str
    sent_s: float
    first_token_s: float | None  # None: no token came
    end_s: float | None  # None: never finished
    output_tokens: int
    ok: bool
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, served from a cache instead of computed

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Result:
        """A result from a line of a run's results file, which also holds what the stack's
        own records say of the request (bench/serving/: queue_ms, engine_ms, ...)."""
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row})

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.sent_s

    @property
    def tpot(self) -> float | None:
        if self.first_token_s is None or self.end_s is None or self.output_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.output_tokens - 1)


@dataclass
class Slo:
    """A lane's latency targets in seconds; None: not a target."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None


def percentile(xs: Iterable[float], p: float) -> float:
    """The p-th percentile (0..100), linear between closest ranks; NaN for no values."""
    xs = sorted(xs)
    if not xs:
        return math.nan
    h = (len(xs) - 1) * p / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def saturated_rate(ends: Iterable[float]) -> float:
    """Completions per second of a saturating burst sent at time 0, while it saturates: its
    first three quarters of completions over the time of the last of them (the last few
    requests run alone on an emptying stack, and would count as the stack's pace)."""
    done = sorted(ends)
    count = max(1, 3 * len(done) // 4)
    return count / done[count - 1] if done else 0.0


def latency(results: list[Result]) -> dict:
    """TTFT, TPOT and end-to-end p50/p99 in ms over the requests that succeeded."""
    ok = [r for r in results if r.ok]
    out: dict = {}
    for name in ("ttft", "tpot", "e2e"):
        xs = [v for r in ok if (v := getattr(r, name)) is not None]
        for p in (50, 99):
            v = percentile(xs, p)
            out[f"{name}_p{p}_ms"] = None if math.isnan(v) else round(1000 * v, 3)
    return out


def meets(r: Result, slo: Slo) -> bool:
    """A failed request misses; a request of one token has no TPOT to miss."""
    if not r.ok:
        return False
    checks = [(slo.ttft_s, r.ttft), (slo.e2e_s, r.e2e)]
    if r.output_tokens >= 2:
        checks.append((slo.tpot_s, r.tpot))
    return all(
        target is None or (value is not None and value <= target) for target, value in checks
    )


def attainment(results: list[Result], slos: dict[str, Slo], offered: int | None = None) -> float:
    """The share of requests that met their lane's SLO. `offered`: how many were sent;
    those without a result (lost) count as misses."""
    n = max(len(results), offered or 0)
    if n == 0:
        return math.nan
    return sum(meets(r, slos[r.lane]) for r in results) / n


def goodput(
    sweep: list[tuple[float, list[Result]]],
    slos: dict[str, Slo],
    target: float = 0.9,
    offered: dict[float, int] | None = None,
) -> float | None:
    """The offered rate of a sweep [(rate, results)] at which `target` of the requests meet
    their SLO: the highest rate that made it, moved towards the next rate up by where the
    attainment, linear between the two, crosses `target` (so that a figure moves with the
    attainment, not in steps of the sweep); the highest rate if every rate made it, None if
    none did. `offered`: requests sent per rate (those without a result count as misses)."""
    points = sorted(
        (rate, attainment(results, slos, (offered or {}).get(rate))) for rate, results in sweep
    )
    good = [i for i, (_, a) in enumerate(points) if a >= target]
    if not good:
        return None
    i = good[-1]
    if i + 1 == len(points):
        return points[i][0]
    (r0, a0), (r1, a1) = points[i], points[i + 1]
    return round(r0 + (r1 - r0) * (a0 - target) / (a0 - a1), 4)


def failures(results: list[Result], expected: Iterable[str] | None = None) -> dict:
    """failed: results that are errors; lost: expected ids with no result at all."""
    seen = {r.id for r in results}
    lost = [i for i in expected or () if i not in seen]
    return {"failed": sum(not r.ok for r in results), "lost": len(lost)}


def prefill(results: list[Result]) -> dict:
    """Prompt tokens computed against served from a cache."""
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(min(r.cached_tokens, r.prompt_tokens) for r in results)
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": prompt - cached,
        "cached_share": round(cached / prompt, 4) if prompt else None,
    }


def throughput(results: list[Result]) -> dict:
    """Completed requests and output tokens per second, from the first send to the last end."""
    ok = [r for r in results if r.ok and r.end_s is not None]
    if not ok:
        return {"req_s": 0.0, "output_tok_s": 0.0, "span_s": 0.0}
    span = max(r.end_s for r in ok) - min(r.sent_s for r in results)
    return {
        "req_s": round(len(ok) / span, 3) if span > 0 else None,
        "output_tok_s": round(sum(r.output_tokens for r in ok) / span, 3) if span > 0 else None,
        "span_s": round(span, 3),
    }


def stack_figures(
    results: list[Result], slos: dict[str, Slo], expected: dict[str, str] | None = None
) -> dict:
    """One stack's figures on one run, per lane and over all requests. `slos` names every
    lane; `expected`: id -> lane of every request sent, so that those with no result
    count as lost, and as SLO misses."""
    expected = expected or {}

    def block(rs: list[Result], ids: list[str]) -> dict:
        fails = failures(rs, ids)
        n = len(rs) + fails["lost"]
        share = attainment(rs, slos, n)
        return {
            "requests": n,
            **fails,
            **latency(rs),
            "slo_attainment": None if math.isnan(share) else round(share, 4),
            **prefill(rs),
        }

    out: dict = {}
    lanes = {r.lane for r in results} | set(expected.values())
    for lane in sorted(lanes, key=lambda x: (LANES.index(x) if x in LANES else len(LANES), x)):
        rs = [r for r in results if r.lane == lane]
        out[lane] = block(rs, [i for i, x in expected.items() if x == lane])
    out["all"] = {**block(results, list(expected)), **throughput(results)}
    return out


def figures(
    stacks: dict[str, list[Result]], slos: dict[str, Slo], expected: dict[str, str] | None = None
) -> dict:
    """stack_figures for every stack of one run."""
    return {name: stack_figures(rs, slos, expected) for name, rs in stacks.items()}


def slos_from_idle(
    idle: list[Result], ttft_factor: float = 5.0, tpot_factor: float = 2.0
) -> dict[str, Slo]:
    """Targets from the lanes' figures on an idle stack: a multiple of each lane's median
    TTFT and TPOT."""
    out = {}
    for lane in sorted({r.lane for r in idle}):
        rs = [r for r in idle if r.lane == lane and r.ok]
        ttft = percentile([r.ttft for r in rs if r.ttft is not None], 50)
        tpot = percentile([r.tpot for r in rs if r.tpot is not None], 50)
        out[lane] = Slo(
            ttft_s=None if math.isnan(ttft) else ttft_factor * ttft,
            tpot_s=None if math.isnan(tpot) else tpot_factor * tpot,
        )
    return out


def results_from_vllm(saved: dict, ids: list[str], lanes: list[str]) -> list[Result]:
    """Results from `vllm bench serve --save-result --save-detailed` JSON, whose lists are
    in the dataset's order (run with --disable-shuffle, or the timed trace): ids and lanes
    of those requests in the same order. vLLM reports no cached prompt tokens."""
    out = []
    for i, (rid, lane) in enumerate(zip(ids, lanes, strict=True)):
        start, error = saved["start_times"][i], saved["errors"][i]
        ttft, latency_s = saved["ttfts"][i], saved["latencies"][i]
        ok = not error
        out.append(
            Result(
                id=rid,
                lane=lane,
                sent_s=start,
                first_token_s=start + ttft if ok and ttft else None,
                end_s=start + latency_s if ok else None,
                output_tokens=saved["output_lens"][i] if ok else 0,
                ok=ok,
                error=error or None,
                prompt_tokens=saved["input_lens"][i],
            )
        )
    return out
