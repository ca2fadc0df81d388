"""Which new work a worker takes now: the admission policy, one object fed by figures.

It reads the engine's figures (room, slots, prompts not computed yet), the running jobs'
(a top-lane prompt with no token yet, lower-lane jobs running, top-lane jobs making
tokens) and the top lane's pace (pace.py); it holds no Redis and no engine of its own, and
the clock is passed in. The worker asks it between steps (take.py), and the
fleet simulation (bench/serving/simulation.py) asks the same object of its simulated
engines, so that the two cannot drift apart.

The rules, by default (no objective set): a request goes in while the engine has room for
it (KV, a sequence slot), as it would behind a router; lower lanes keep top_lane_reserve
slots and the KV of that many recent top-lane requests free for the top lane while it runs
here, their prompts wait behind a top-lane prompt not computed yet, and they wait in the
queue while the top lane's tokens come top_lane_slowdown times slower than unloaded. With
an objective (top_lane_tpot_ms), every lane keeps to the engine's step budget and, while
the top lane is over its target, nothing new starts but a top-lane entry that has waited
top_lane_wait_ms, with the lower lanes' fair turn among those takes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from plurai.broker_config import protocol
from plurai.broker_config.settings import Settings
from plurai.gpu_workers.pace import Pace

log = logging.getLogger("plurai.worker")


class Engine(Protocol):
    """What the policy reads of the engine (gpu_workers/backend.py's Backend has it)."""

    max_num_seqs: int
    step_tokens: int

    @property
    def prompt_backlog(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def has_unfinished(self) -> bool: ...

    def can_admit(
        self, prompt_tokens: int, max_tokens: int, priority: int | None = None, spare: int = 0
    ) -> bool: ...


class Jobs(Protocol):
    """What the policy reads of the jobs running (gpu_workers/job.py's Runs has it)."""

    def top_backlog(self) -> int:
        """Prompt tokens of the top lane's jobs that have no token yet."""
        ...

    def lower_running(self) -> bool:
        """Whether jobs of lanes below the top one run."""
        ...

    def top_making(self) -> bool:
        """Whether top-lane jobs run that have made tokens."""
        ...


@dataclass
class Admission:
    engine: Engine
    jobs: Jobs
    # the knobs, from Settings (`of`), where their defaults live
    slowdown: float  # top_lane_slowdown
    target_s: float  # top_lane_tpot_ms / 1000: the objective; 0: none
    wait_ms: float  # top_lane_wait_ms
    poll_s: float  # poll_ms / 1000: how often to look for a waited entry
    fair_every: int
    reserve: int  # top_lane_reserve
    lower_bound: int  # prefill_backlog_tokens
    takes_per_step: int | None
    preempt: bool
    lanes: int  # how many
    pace: Pace = field(init=False)
    prompt_size: float = 0.0  # mean prompt tokens of the entries taken (moving)
    top_size: float = 0.0  # mean prompt plus max_tokens of the top lane's (moving)
    output_size: float = 0.0  # mean max_tokens times n of the entries taken (moving)
    next_waited: float = 0.0  # when to look for a top-lane entry waiting too long next
    waited_takes: int = 0  # top-lane entries taken for their wait since a fair turn
    _lower_open: bool = True  # the pace gate's state, logged when it changes
    _slow: bool = False  # whether the top lane is over its target, logged when it changes

    def __post_init__(self) -> None:
        self.pace = Pace(self.slowdown, target_s=self.target_s)

    @classmethod
    def of(cls, settings: Settings, engine: Engine, jobs: Jobs) -> Admission:
        return cls(
            engine,
            jobs,
            slowdown=settings.top_lane_slowdown,
            target_s=settings.top_lane_tpot_ms / 1000,
            wait_ms=settings.top_lane_wait_ms,
            poll_s=settings.poll_ms / 1000,
            fair_every=settings.fair_every,
            reserve=settings.top_lane_reserve,
            lower_bound=settings.prefill_backlog_tokens,
            takes_per_step=settings.takes_per_step,
            preempt=settings.preempt,
            lanes=len(settings.lanes),
        )

    def takes(self) -> int:
        """Most entries moved into the engine between two steps."""
        return self.takes_per_step or max(4, self.engine.max_num_seqs // 16)

    def taken(self, prompt_tokens: int, max_tokens: int, n: int, top: bool) -> None:
        """An entry goes into the engine: the sizes the next reads are asked by."""
        self.prompt_size = moving(self.prompt_size, prompt_tokens)
        self.output_size = moving(self.output_size, max_tokens * n)
        if top:
            self.top_size = moving(self.top_size, prompt_tokens + max_tokens)

    def slow(self) -> bool:
        """Whether the top lane's tokens come slower here than its target while top-lane
        jobs make tokens: then the worker starts nothing new of the lower lanes, nor of the
        top lane unless lower-lane jobs run here (their arrivals are not held: that would
        put batch work ahead of interactive)."""
        slow = self.pace.over_target() and self.jobs.top_making()
        if slow != self._slow:
            self._slow = slow
            self._said("new work held" if slow else "new work taken again", "target")
        return slow

    def look_for_waited(self, now: float) -> bool:
        """Whether to look now for a top-lane entry that has waited wait_ms in the queue
        (at most once per poll): taken even over the target, since every worker may be."""
        if self.wait_ms <= 0 or now < self.next_waited:
            return False
        self.next_waited = now + self.poll_s
        return True

    def fair_turn(self) -> bool:
        """Whether the next take for a wait is the lower lanes' instead (their oldest entry,
        started over the target): after fair_every - 1 top-lane takes for their wait,
        which say that holding new work does not bring the top lane under its target."""
        return 0 < self.fair_every <= self.waited_takes + 1 and self.lanes > 1

    def took_waited(self, n: int, fair: bool) -> None:
        self.waited_takes = 0 if fair else self.waited_takes + n

    def bound(self, top: bool, now: float) -> int | None:
        """The prompt tokens not computed yet that a new request may join (None: no bound:
        the engine's KV room and sequence slots alone decide, as they would behind a
        router, and its scheduler chunks the prompts over its steps). With no objective set
        that is every lane's case, but for the lanes below the top one while the top lane
        runs here (within the pace window): then prefill_backlog_tokens (or the engine's
        step budget where lower, or without it), which keeps the steps short that the top
        lane's tokens wait for. With an objective, every lane keeps to the step budget
        (the top lane counting its own prompts only), so that the rest of a burst waits in
        Redis for whichever worker frees up first."""
        step, lower, objective = self.engine.step_tokens, self.lower_bound, self.target_s > 0
        if top:
            return step if objective else None
        if now - self.pace.top_seen_s <= self.pace.window_s:
            return min(step, lower) if lower else step
        return step if objective else None

    def backlog(self, top: bool) -> int:
        """The prompt tokens not computed yet that a request of the lane counts beside
        its own: all of them, or for the top lane its own only (the engine runs it ahead)."""
        return self.jobs.top_backlog() if top else self.engine.prompt_backlog

    def admits(self, prompt_tokens: int, output_tokens: int, top: bool, now: float) -> bool:
        """Whether the engine has room (KV, a sequence slot) for a request of this size."""
        # a top-lane request may take what lower lanes' jobs hold: the engine preempts them
        preempt = top and self.preempt
        priority = protocol.engine_priority(0, protocol.MAX_PRIORITY) if preempt else None
        spare = 0 if top else self.top_kv_reserve(now)
        return self.engine.can_admit(prompt_tokens, output_tokens, priority, spare)

    def fits(self, prompt_tokens: int, output_tokens: int, top: bool, now: float) -> bool:
        """Whether the engine has room for the request now, and its prompt fits in the
        backlog bound beside the prompts not computed yet (a prompt alone always does).
        A request's n choices count as one request of n times its max_tokens."""
        bound, backlog = self.bound(top, now), self.backlog(top)
        if bound is not None and backlog and backlog + prompt_tokens > bound:
            return False  # left in the queue, for whichever worker frees up first
        return self.admits(prompt_tokens, output_tokens, top, now)

    def top_kv_reserve(self, now: float) -> int:
        """Tokens of KV that lower-lane work leaves free for the top lane: room for
        top_lane_reserve of its requests of the recent mean size, while it has run here
        within the pace window. Without it a batch flood fills the cache and a top-lane
        arrival waits for batch jobs to finish: vLLM preempts only to let running
        requests grow, never to admit a waiting one, whatever its priority."""
        if not self.top_size or now - self.pace.top_seen_s > self.pace.window_s:
            return 0
        return self.reserve * round(self.top_size)

    def room(self, top: bool, now: float) -> int:
        """How many entries to ask for now: as many prompts of the recent mean size as fit
        in the bound beside the prompts not computed yet; at least one while none is
        pending (and one at first, with no size to go by), none while the next would
        probably not fit. With no bound, as many as the engine has room for (KV, sequence
        slots), up to a turn's takes: an entry read that cannot start would wait here
        while another worker might start it."""
        bound, size = self.bound(top, now), round(self.prompt_size)
        if bound is None:
            if not self.engine.has_unfinished() or not size:
                return self.takes()
            output, n = round(self.output_size), 0
            while n < self.takes() and self.admits((n + 1) * size, (n + 1) * output, top, now):
                n += 1
            return n
        backlog = self.backlog(top)
        room = (bound - backlog) // size if size else 1
        return room if backlog else max(1, room)

    def room_below_top(self, now: float) -> int:
        """How many entries of lanes below the top one may be taken now: only while the
        engine keeps top_lane_reserve sequence slots free beyond them, so that a top-lane
        arrival is admitted at once rather than after lower-lane work finishes, and none
        while they would slow the top lane's tokens (pace.py) or while a top-lane prompt
        is not computed yet: the engine would compute a lower-lane prompt in the same
        step, and the top-lane job's first token would wait for both."""
        engine = self.engine
        if not engine.has_unfinished():
            return engine.max_num_seqs
        if self.slowdown and self.jobs.top_backlog():
            return 0
        open_ = self.pace.lower_lanes_open(now)
        if open_ != self._lower_open:
            self._lower_open = open_
            self._said("lower lanes open" if open_ else "lower lanes held", "unloaded")
        if not open_:
            return 0  # lower-lane work would slow the top lane's tokens further
        if self.reserve <= 0:
            return engine.max_num_seqs
        busy = engine.num_running + engine.num_waiting
        return max(0, engine.max_num_seqs - self.reserve - busy)

    def _said(self, change: str, against: str) -> None:
        """Log a change of the gates' state with the figures that made it."""
        pace = self.pace
        base = pace.target_s if against == "target" else pace.unloaded_s
        log.info(
            "%s: the top lane's time per token %.0f ms, %s %.0f ms",
            change,
            1000 * pace.tpot_s,
            against,
            1000 * base,
        )

    def startable(self, prompt_tokens: int, output_tokens: int, room: int, now: float) -> bool:
        """Whether a held lower-lane entry may start now (`room`: `room(False, now)`)."""
        if room <= 0 or not self.room_below_top(now):
            return False
        return not self.engine.has_unfinished() or self.fits(
            prompt_tokens, output_tokens, False, now
        )


def moving(mean: float, value: float) -> float:
    """A moving mean over about the last 8 values; the first value is its own mean."""
    return mean + (value - mean) / 8 if mean else value
