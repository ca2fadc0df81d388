"""The serving bench's run: every scenario (idle, sweep, flood, add, kill, trace) on every
stack, in turn, each stack started fresh (bench/serving/__init__.py says what each does)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.serving import figures as sf
from bench.serving.client import (
    Run,
    client_late_ms,
    one_at_a_time,
    replay,
    slos_from,
    slowest_share,
)
from bench.serving.report import recovery_s
from bench.serving.stacks import EngineSpec, PluraiStack, RouterStack, Stack, client_cpu_s, cpu_used
from bench.serving.workload import (
    BATCH,
    INTERACTIVE,
    ServingRequest,
    Tokens,
    WorkloadConfig,
    flood_scenario,
    generate,
    write_jsonl,
)
from bench.trace_replay import read_trace
from bench.trace_replay import replay as replay_trace


class Bench:
    def __init__(self, a: argparse.Namespace, spec: EngineSpec, work: Path) -> None:
        self.a, self.spec, self.work = a, spec, work
        self.tokens = Tokens(spec.model)
        self.capacity: float | None = a.capacity
        self.slos: dict[str, sf.Slo] | None = None
        self.trace_slos: dict[str, sf.Slo] | None = None  # the trace scenario's own
        if a.slos_from:
            self.slos, self.trace_slos = slos_from(a.slos_from)
        self.idle: dict[str, Any] = {}
        # requests one at a time on the idle stack; the flood's shortest run (enough
        # interactive requests for a p99); how long arrivals go on once an added engine
        # carries load
        self.idle_n, self.flood_min_s, self.add_after_s = (
            (4, 0.0, 1.0) if a.smoke else (10, 40.0, 10.0)
        )

    def config(self, **kw: Any) -> WorkloadConfig:
        lo, hi = map(int, self.a.prompt.split("-"))
        olo, ohi = map(int, self.a.output.split("-"))
        base = dict(
            seed=self.a.seed,
            duration_s=self.a.duration,
            burstiness=self.a.burstiness,
            min_prompt=lo,
            max_prompt=hi,
            min_output=olo,
            max_output=ohi,
        )
        return WorkloadConfig(**{**base, **kw})

    def workload(self, name: str, cfg: WorkloadConfig) -> list[ServingRequest]:
        reqs = generate(cfg, self.tokens)
        for r in reqs:  # ids unique across scenarios: records are matched to requests by id
            r.id = f"{name}-{r.id}"
        write_jsonl(self.work / f"{name}.jsonl", reqs)  # what every stack replays
        return reqs

    def measure(
        self, stack: Stack, scenario: str, reqs: list[ServingRequest], rate: float, during=None
    ) -> tuple[Run, float]:
        before, client = stack.cpu(), client_cpu_s()
        results, t0, unsent = asyncio.run(replay(stack, reqs, self.a.drain, during))
        cpu = cpu_used(before, stack.cpu())
        cpu["load_generator"] = round(client_cpu_s() - client, 2)
        expected = {r.id: r.lane for r in reqs if r.id not in unsent}
        extra = {**stack.extra(), "client_late_ms": client_late_ms(reqs, results)}
        waits = getattr(stack, "queue_waits", {})
        for r in results:  # the gateway's intake: from the send to the job's record
            if r.id in waits:
                created = waits[r.id]["created_ms"] or 0
                waits[r.id]["intake_ms"] = round(created - 1000 * (stack.wall0 + r.sent_s))
        if waits:
            extra["slowest_interactive"] = slowest_share(results, waits)
        run = Run(scenario, round(rate, 3), results, expected, cpu, extra)
        with open(stack.logs / f"{scenario}.results.jsonl", "w") as f:
            for r in sorted(results, key=lambda x: x.id):
                f.write(json.dumps({**asdict(r), **waits.get(r.id, {})}) + "\n")
        ok = sum(r.ok for r in results)
        sent = len(expected)
        print(f"  {stack.name} {scenario} @ {rate:.2f} req/s: {ok}/{sent} ok", file=sys.stderr)
        return run, t0

    # the scenarios; each returns the runs it made

    def run_idle(self, stack: Stack) -> list[Run]:
        cfg = self.config(rate=1.0, duration_s=12.0, batch_share=0.3)
        reqs = self.workload("idle", cfg)
        ids = [f"idle{i}" for i in range(self.idle_n)]
        results = one_at_a_time(stack, reqs[: self.idle_n], ids)
        lanes = {
            lane: sf.latency([r for r in results if r.lane == lane])
            for lane in (INTERACTIVE, BATCH)
        }
        self.idle[stack.name] = lanes
        if self.slos is None:  # from the first stack
            a = self.a
            interactive = [r for r in results if r.lane == INTERACTIVE]
            slos = sf.slos_from_idle(interactive, a.slo_ttft, a.slo_tpot)
            batch = [r.e2e for r in results if r.lane == BATCH and r.e2e is not None]
            e2e = sf.percentile(batch, 50) if batch else float("nan")
            slos[BATCH] = sf.Slo(e2e_s=None if math.isnan(e2e) else a.slo_batch_e2e * e2e)
            slos.setdefault(INTERACTIVE, sf.Slo())
            self.slos = slos
        return []

    def warm_up(self, stack: Stack) -> None:
        """A burst of --warmup requests per engine, not measured, before anything is: a
        fresh engine's first batches of new shapes stall for seconds (kernels built for
        them), which would land on whichever run comes first. The same seeded burst on
        every stack, so their caches still see the same history."""
        n = self.a.warmup * stack.k
        if n > 0:
            results = self.burst(stack, "warmup", n, self.a.seed + 1000)
            print(f"  warm-up: {sum(r.ok for r in results)}/{len(results)} ok", file=sys.stderr)

    def burst(self, stack: Stack, name: str, n: int, seed: int) -> list[sf.Result]:
        """n requests of the mixed workload sent at once (100 per second), unmeasured."""
        cfg = self.config(rate=100.0, duration_s=n / 100.0, seed=seed)
        return asyncio.run(replay(stack, self.workload(name, cfg), 600))[0]

    def calibrate(self, stack: Stack) -> None:
        """Capacity: completed requests/s of a saturating burst of the mixed workload, while
        it saturates (sf.saturated_rate)."""
        results = self.burst(stack, "calibrate", max(16, 12 * stack.k), self.a.seed)
        ends = [r.end_s for r in results if r.ok and r.end_s is not None]
        self.capacity = round(sf.saturated_rate(ends), 3) if ends else 0.1
        print(f"  capacity {self.capacity} req/s ({len(ends)} requests)", file=sys.stderr)

    def run_sweep(self, stack: Stack, rep: int = 0) -> list[Run]:
        """Round `rep` of the sweep: every load once, with the round's seeds."""
        assert self.capacity is not None
        runs = []
        for i, scale in enumerate(self.a.scales):
            seed = self.a.seed + 1 + i + 1000 * rep
            cfg = self.config(rate=self.capacity, scale=scale, seed=seed)
            name = f"sweep@{scale}" + (f"#{rep}" if rep else "")
            reqs = self.workload(name.replace("@", "-"), cfg)
            runs.append(self.measure(stack, name, reqs, cfg.offered_rate)[0])
        return runs

    def trace_workload(
        self, name: str, rate: float, n: int, skip: int = 0, seed: int = 0
    ) -> list[ServingRequest]:
        """The trace's requests `skip` to `skip + n`, replayed at `rate` (bench/
        trace_replay.py); all interactive (its conversations), each a completion of its
        token ids. `seed` draws the blocks' tokens: runs of another seed share no prefix."""
        vocab = len(self.tokens.tokenizer)
        entries = read_trace(self.a.trace, limit=n, skip=skip)
        if len(entries) < n:
            raise SystemExit(f"--trace {self.a.trace}: {skip + n} requests needed, fewer there")
        got = replay_trace(entries, vocab, self.a.trace_scale, rate, seed=seed)
        hi = int(self.a.prompt.split("-")[1])
        ohi = int(self.a.output.split("-")[1])
        for r in got:  # within the context the stacks' engines were started with
            r.prompt_ids, r.max_tokens = r.prompt_ids[:hi], min(r.max_tokens, ohi)
        reqs = [
            ServingRequest(
                id=f"{name}-{i}",
                arrival_s=r.arrival_s,
                lane=INTERACTIVE,
                kind="trace",
                messages=[],
                max_tokens=r.max_tokens,
                prompt_tokens=len(r.prompt_ids),
                prompt_ids=r.prompt_ids,
            )
            for i, r in enumerate(got)
        ]
        write_jsonl(self.work / f"{name}.jsonl", reqs)
        return reqs

    def trace_n(self) -> int:
        """Requests of a trace run: as many as --duration holds at the capacity."""
        assert self.capacity is not None
        return max(2, round(self.capacity * self.a.duration))

    def run_trace(self, stack: Stack, rep: int = 0) -> list[Run]:
        """Round `rep` of the trace at every load of --scales: every load replays the same
        requests, only faster or slower, and round r the trace's r-th window of them (past
        the idle run's). Each load's blocks are drawn afresh (their sharing the trace's),
        so that no load finds the prefixes of the one before in the engines' caches."""
        assert self.capacity is not None
        runs = []
        n = self.trace_n()
        for i, scale in enumerate(self.a.scales):
            name = f"trace@{scale}" + (f"#{rep}" if rep else "")
            rate = self.capacity * scale
            file = name.replace("@", "-").replace("#", "-")
            seed = 1 + rep * len(self.a.scales) + i  # (the idle requests': 0)
            reqs = self.trace_workload(file, rate, n, skip=self.idle_n + rep * n, seed=seed)
            runs.append(self.measure(stack, name, reqs, rate)[0])
        return runs

    def run_trace_idle(self, stack: Stack) -> None:
        """The trace's first requests one at a time: its SLOs (the mixed workload's do not
        fit prompts of another length), the same multiples of the idle figures."""
        reqs = self.trace_workload("trace-idle", 1.0, self.idle_n)
        results = one_at_a_time(stack, reqs, [r.id for r in reqs])
        self.idle.setdefault(stack.name, {})["trace"] = sf.latency(results)
        if self.trace_slos is None:
            self.trace_slos = sf.slos_from_idle(results, self.a.slo_ttft, self.a.slo_tpot)

    def run_flood(self, stack: Stack) -> list[Run]:
        assert self.capacity is not None
        base = self.config(rate=self.capacity, scale=0.5, seed=self.a.seed + 100)
        base.batch_share = 0.0  # steady interactive traffic; the batch comes as the flood
        base.duration_s = max(base.duration_s, self.flood_min_s)
        cfg = flood_scenario(**asdict(base))
        cfg.flood_requests = self.a.flood or max(20, round(self.capacity * cfg.duration_s))
        cfg.flood_at_s = cfg.duration_s / 3
        reqs = self.workload("flood", cfg)
        return [self.measure(stack, "flood", reqs, cfg.offered_rate)[0]]

    def run_add(self, stack: Stack) -> list[Run]:
        assert self.capacity is not None
        # arrivals go on until 10 s after the new engine carries load (a router sends it new
        # requests only), at most --add-wait s after it was started: the same for every
        # stack (an engine started on cores its peers keep busy takes minutes)
        at = self.a.duration / 3
        span = at + self.a.add_wait + self.add_after_s
        cfg = self.config(rate=self.capacity, scale=1.2, seed=self.a.seed + 200, duration_s=span)
        reqs = self.workload("add", cfg)
        times: dict[str, float | None] = {"started_s": None, "ready_s": None, "first_load_s": None}

        async def add(t0: float, stop: asyncio.Event) -> None:
            await asyncio.sleep(at)
            times["started_s"] = time.monotonic() - t0
            p = stack.add_engine()
            i = len(stack.engines) - 1
            loop = asyncio.get_running_loop()
            give_up = t0 + span + self.a.drain
            while time.monotonic() < give_up and p.poll() is None:
                if isinstance(stack, PluraiStack):
                    ready = p.pid in await loop.run_in_executor(None, stack.serving)
                else:
                    try:
                        ready = (
                            await loop.run_in_executor(
                                None, lambda: httpx.get(stack.engine_url(i) + "/health", timeout=2)
                            )
                        ).status_code == 200
                    except httpx.HTTPError:
                        ready = False
                if ready:
                    times["ready_s"] = time.monotonic() - t0
                    if isinstance(stack, RouterStack):
                        await loop.run_in_executor(None, stack.join, i)
                    break
                await asyncio.sleep(0.2)
            key = p.pid if isinstance(stack, PluraiStack) else i
            while times["ready_s"] is not None and time.monotonic() < give_up:
                if await loop.run_in_executor(None, stack.carries_load, key):
                    times["first_load_s"] = time.monotonic() - t0
                    await asyncio.sleep(self.add_after_s)
                    stop.set()
                    return
                await asyncio.sleep(0.2)

        run, _ = self.measure(stack, "add", reqs, cfg.offered_rate, add)
        r, f = times["ready_s"], times["first_load_s"]
        run.extra["add"] = {
            "offered_s": round(span, 1),
            **times,
            "ready_to_load_s": None if r is None or f is None else round(f - r, 2),
        }
        return [run]

    def run_kill(self, stack: Stack) -> list[Run]:
        assert self.capacity is not None
        cfg = self.config(rate=self.capacity, scale=0.5, seed=self.a.seed + 300)
        reqs = self.workload("kill", cfg)
        at = self.a.duration / 3

        async def kill(t0: float, stop: asyncio.Event) -> None:
            await asyncio.sleep(at)
            stack.kill_engine(0)

        run, _ = self.measure(stack, "kill", reqs, cfg.offered_rate, kill)
        run.extra["kill"] = {"at_s": round(at, 2), "recovery_s": recovery_s(run.results, at)}
        return [run]
