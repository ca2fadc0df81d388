"""Whether a worker may take lower-lane work now: not while it slows the top lane.

Where a step's time grows with its batch (a CPU; a GPU at large batches), every lower-lane
sequence a worker takes slows each running top-lane request, and a batch flood can make an
interactive request's tokens come several times slower than on an unloaded engine. So the
worker measures the top lane's time per output token as its tokens arrive: recently (the
time between arrivals over the tokens they brought, summed over the last `SPAN_S`) and
unloaded (the lowest that recent time has been over at least `MIN_TOKENS` tokens; it rises
by a tenth a minute while never reached again, so a changed engine is learnt). Sums, not a
per-arrival average: tokens reach the worker in uneven bunches (a backend hands over every
step made since its last call), and an arrival that brings three tokens a moment after the
last one is as real as the long gap before it; only their sum says how fast tokens come.
While a top-lane job ran here within `window_s`, entries of the lanes below are taken only
while the recent time stays within `slowdown` times the unloaded one. Nothing running is
stopped: new lower-lane work waits in the queue, in its order, until this worker's steps
are fast again or another worker with room takes it.

An operator who has a target for the top lane's time per token (their latency objective,
`target_s`) can hold every lane to it: while the recent time is over the target, a worker
that runs top-lane jobs starts nothing new, so excess work waits in the queue (for a faster
worker, or for this one's running jobs to finish) instead of slowing every running job;
only a top-lane entry that has waited past its bound is taken, and among those takes the
lower lanes keep their fair turn (admission.py, `fair_turn`).
The target then replaces the slowdown as the lower lanes' bound: the operator has said how
slow the top lane may get, and a gate at `slowdown` times the unloaded time, below it,
would hold back batch work the engine had room for (docs/operations.md, "Top-lane target").
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

SPAN_S = 1.0  # the recent time per token sums the arrivals of the last second
MIN_TOKENS = 8  # fewer tokens than this are too few to set the unloaded time by
DRIFT, DRIFT_EVERY_S = 1.1, 60.0  # how the unloaded time rises while never reached again


@dataclass
class Pace:
    slowdown: float  # allowed ratio of recent to unloaded time per token; 0: no gate
    window_s: float = 10.0
    target_s: float = 0.0  # the top lane's target time per token, for every lane; 0: none
    tpot_s: float = 0.0  # the top lane's recent time per output token; 0: none yet
    unloaded_s: float = 0.0  # the lowest tpot_s over MIN_TOKENS or more; 0: none yet
    unloaded_at_s: float = 0.0  # when tpot_s was last that low (or it last rose)
    top_seen_s: float = -math.inf  # when a top-lane job last started or made a token
    # (when, seconds since the job's previous tokens, tokens) of the last SPAN_S
    arrivals: deque[tuple[float, float, int]] = field(default_factory=deque)

    def seen(self, now: float) -> None:
        self.top_seen_s = now

    def tokens(self, interval_s: float, n: int, now: float) -> None:
        """A top-lane job made `n` tokens `interval_s` after its previous ones."""
        if n <= 0:
            return
        self.top_seen_s = now
        self.arrivals.append((now, max(0.0, interval_s), n))
        while now - self.arrivals[0][0] > SPAN_S:
            self.arrivals.popleft()
        spent = sum(a[1] for a in self.arrivals)
        made = sum(a[2] for a in self.arrivals)
        if spent <= 0:
            return  # tokens that came together: their time is in arrivals not seen yet
        self.tpot_s = spent / made
        if made < MIN_TOKENS:
            return
        if not self.unloaded_s or self.tpot_s <= self.unloaded_s:
            self.unloaded_s, self.unloaded_at_s = self.tpot_s, now
        elif now - self.unloaded_at_s >= DRIFT_EVERY_S:
            self.unloaded_s, self.unloaded_at_s = self.unloaded_s * DRIFT, now

    def lower_lanes_open(self, now: float) -> bool:
        """Whether the top lane's recent time per token leaves room for lower-lane work:
        within `slowdown` times the unloaded time; with a target, always here, since the
        worker holds every lane to the target itself (`over_target`)."""
        if self.target_s > 0 or self.slowdown <= 0 or not self.unloaded_s:
            return True
        if now - self.top_seen_s > self.window_s:
            return True
        return self.tpot_s <= self.slowdown * self.unloaded_s

    def over_target(self) -> bool:
        """Whether the top lane's recent time per token is over the target (call it only
        while top-lane jobs run: the recent time is theirs)."""
        return 0 < self.target_s < self.tpot_s
