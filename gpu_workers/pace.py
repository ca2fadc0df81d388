"""Whether a worker may take lower-lane work now: not while it slows the top lane.

Where a step's time grows with its batch (a CPU; a GPU at large batches), every lower-lane
sequence a worker takes slows each running top-lane request, and a batch flood can make an
interactive request's tokens come several times slower than on an unloaded engine. So the
worker measures the top lane's time per output token as its tokens arrive: recently (an
average over the last few arrivals) and unloaded (the lowest that average has been; it
rises by a tenth a minute while never reached again, so a changed engine is learnt).
While a top-lane job ran here within `window_s`, entries of the lanes below are taken only
while the recent time stays within `slowdown` times the unloaded one. Nothing running is
stopped: new lower-lane work waits in the queue, in its order, until this worker's steps
are fast again or another worker with room takes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALPHA = 0.3  # weight of the newest sample in the average
DRIFT, DRIFT_EVERY_S = 1.1, 60.0  # how the unloaded time rises while never reached again


@dataclass
class Pace:
    slowdown: float  # allowed ratio of recent to unloaded time per token; 0: no gate
    window_s: float = 10.0
    tpot_s: float = 0.0  # the top lane's recent time per output token; 0: none yet
    unloaded_s: float = 0.0  # the lowest tpot_s; 0: none yet
    unloaded_at_s: float = 0.0  # when tpot_s was last that low (or it last rose)
    top_seen_s: float = -math.inf  # when a top-lane job last started or made a token

    def seen(self, now: float) -> None:
        self.top_seen_s = now

    def tokens(self, interval_s: float, n: int, now: float) -> None:
        """A top-lane job made `n` tokens `interval_s` after its previous ones (an interval
        of no length measures nothing: it would drag the unloaded time to zero and hold the
        lower lanes for good)."""
        if n <= 0 or interval_s <= 0:
            return
        x = interval_s / n
        self.tpot_s = x if not self.tpot_s else self.tpot_s + ALPHA * (x - self.tpot_s)
        if not self.unloaded_s or self.tpot_s <= self.unloaded_s:
            self.unloaded_s, self.unloaded_at_s = self.tpot_s, now
        elif now - self.unloaded_at_s >= DRIFT_EVERY_S:
            self.unloaded_s, self.unloaded_at_s = self.unloaded_s * DRIFT, now
        self.top_seen_s = now

    def lower_lanes_open(self, now: float) -> bool:
        if self.slowdown <= 0 or not self.unloaded_s or now - self.top_seen_s > self.window_s:
            return True
        return self.tpot_s <= self.slowdown * self.unloaded_s
