"""The serving bench's client: one seeded workload file replayed open-loop against a stack's
OpenAI endpoint (streamed, each request's times taken as it goes), one request at a time
for the idle figures, and the slowest first tokens split into queue and engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.serving import figures as sf
from bench.serving.stacks import Stack
from bench.serving.workload import (
    BATCH,
    INTERACTIVE,
    ServingRequest,
)

# -- the client -----------------------------------------------------------------------


def client_late_ms(reqs: list[ServingRequest], results: list[sf.Result]) -> dict[str, float]:
    """How late the load generator sent requests after their arrival times (p50, max): on
    a busy machine it shares the cores with the stack, and latencies count from the send."""
    due = {r.id: r.arrival_s for r in reqs}
    late = sorted(1000 * max(0.0, r.sent_s - due[r.id]) for r in results if r.id in due)
    if not late:
        return {"p50": 0.0, "max": 0.0}
    return {"p50": round(late[len(late) // 2], 1), "max": round(late[-1], 1)}


def slowest_share(results: list[sf.Result], times: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Of the slowest 5% of interactive first tokens (at least one): how many, their TTFT,
    and the shares of it (medians) spent in the gateway's intake (send to the job's
    record), the queue (record to a worker's start), the engine (start to the worker's
    first token); the rest is delivery (Redis, the gateway's stream, the client): where
    the tail of a time to first token is. `times`: per request id, what the records say
    (intake_ms, queue_ms, engine_ms; None where unknown)."""
    its = sorted(
        (r for r in results if r.lane == INTERACTIVE and r.ttft is not None and r.id in times),
        key=lambda r: r.ttft or 0.0,
    )
    tail = its[len(its) - max(1, len(its) // 20) :] if its else []
    if not tail:
        return {"n": 0}
    out: dict[str, Any] = {
        "n": len(tail),
        "ttft_ms": round(sf.percentile([1000 * (r.ttft or 0.0) for r in tail], 50), 1),
    }
    for part in ("intake", "queue", "engine"):
        shares = [
            times[r.id][f"{part}_ms"] / max(1e-9, 1000 * (r.ttft or 0.0))
            for r in tail
            if times[r.id].get(f"{part}_ms") is not None
        ]
        out[f"{part}_share"] = round(sf.percentile(shares, 50), 3) if shares else None
    return out


async def _one(
    http: aiohttp.ClientSession,
    stack: Stack,
    req: ServingRequest,
    t0: float,
    stop: asyncio.Event | None = None,
) -> sf.Result | None:
    delay = t0 + req.arrival_s - time.monotonic()
    if stop is None:
        await asyncio.sleep(max(0.0, delay))
    elif delay > 0:
        with contextlib.suppress(asyncio.TimeoutError):  # the arrival time came
            await asyncio.wait_for(stop.wait(), delay)
    if stop is not None and stop.is_set():
        return None  # the scenario ended its arrivals early: never sent
    sent = time.monotonic()
    first = None
    usage: dict[str, Any] = {}
    error = None
    try:
        path = "/chat/completions" if req.prompt_ids is None else "/completions"
        async with http.post(stack.base + path, json=stack.body(req)) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = str(chunk["error"])[:200]
                        break
                    if first is None and any(
                        (c.get("delta") or {}).get("content") or c.get("text")
                        for c in chunk.get("choices", [])
                    ):
                        first = time.monotonic()
                    if chunk.get("usage"):
                        usage = chunk["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # ValueError: JSON
        error = f"{type(e).__name__}: {e}"[:200]
    done = time.monotonic()
    out = int(usage.get("completion_tokens") or 0)
    if error is None and out < req.max_tokens:
        error = f"short output: {out} of {req.max_tokens} tokens"
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return sf.Result(
        id=req.id,
        lane=req.lane,
        sent_s=sent - t0,
        first_token_s=(first or done) - t0 if error is None else None,
        end_s=done - t0 if error is None else None,
        output_tokens=out,
        ok=error is None,
        error=error,
        prompt_tokens=int(usage.get("prompt_tokens") or req.prompt_tokens),
        cached_tokens=int(cached),
    )


async def replay(
    stack: Stack, reqs: list[ServingRequest], drain_s: float, during: Any = None
) -> tuple[list[sf.Result], float, set[str]]:
    """Send every request at its arrival time; results of those done within drain_s of the
    last arrival (the rest are lost). `during(t0, stop)`: a coroutine run beside (faults);
    setting `stop` ends the arrivals early: the ids of requests never sent are returned.

    The client is aiohttp, as `vllm bench serve`'s: with a few hundred streams open, httpx's
    per-chunk cost held a new request for ~0.6 s on 2 cores that engines keep busy (aiohttp: ~5 ms),
    which counted in every stack's time to first token."""
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)  # no cap: an open-loop client
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, read_bufsize=1 << 20
    ) as http:
        t0 = time.monotonic()
        stack.wall0 = time.time()
        tasks = {r.id: asyncio.create_task(_one(http, stack, r, t0, stop)) for r in reqs}
        side = asyncio.create_task(during(t0, stop)) if during else None
        last = max((r.arrival_s for r in reqs), default=0.0)
        done, pending = set(), set()
        if tasks:  # a short burst may draw no arrival at all
            done, pending = await asyncio.wait(tasks.values(), timeout=last + drain_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if side is not None:
            side.cancel()
            await asyncio.gather(side, return_exceptions=True)
    unsent = {i for i, t in tasks.items() if t in done and t.result() is None}
    return [r for t in done if (r := t.result()) is not None], t0, unsent


# -- scenarios --------------------------------------------------------------------------


@dataclass
class Run:
    scenario: str
    offered_req_s: float
    results: list[sf.Result]
    expected: dict[str, str]
    cpu_s: dict[str, float]
    extra: dict[str, Any] = field(default_factory=dict)


def slos_from(path: str) -> tuple[dict[str, sf.Slo], dict[str, sf.Slo] | None]:
    """The SLOs of an earlier run (its out.json), and its trace's if it had them, so that a
    later one, on fewer stacks, is judged by the same targets."""
    lines = Path(path).read_text().strip().splitlines()
    try:
        out = json.loads(lines[-1])
        got, trace = out["slos"], out.get("trace_slos")
        return (
            {lane: sf.Slo(**got[lane]) for lane in (INTERACTIVE, BATCH)},
            {INTERACTIVE: sf.Slo(**trace[INTERACTIVE])} if trace else None,
        )
    except (IndexError, KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"--slos-from {path}: no SLOs of a finished run there ({e!r})") from None


def one_at_a_time(stack: Stack, reqs: list[ServingRequest], ids: list[str]) -> list[sf.Result]:
    """Each request sent alone once the one before has ended (nothing waits), as `ids`."""
    results: list[sf.Result] = []
    for r, rid in zip(reqs, ids, strict=True):
        one = ServingRequest(**{**asdict(r), "arrival_s": 0.0, "id": rid})
        results += asyncio.run(replay(stack, [one], 300))[0]
    return results
