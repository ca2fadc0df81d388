"""Taking work: which entries a worker reads now and moves into its engine, between two
steps. Admission (admission.py) says what the engine may start; this reads that many
entries (intake.py), holds those that must wait, and hands the rest to the starter
(starter.py), which begins them."""

from __future__ import annotations

import time
from collections.abc import Callable

from plurai.gpu_workers.admission import Admission
from plurai.gpu_workers.backend import Backend
from plurai.gpu_workers.intake import Entry, Intake
from plurai.gpu_workers.job import Runs
from plurai.gpu_workers.starter import Batch, Starter


class Taker:
    def __init__(
        self,
        engine: Backend,
        intake: Intake,
        admission: Admission,
        starter: Starter,
        running: Runs,
        held: list[Entry],
        lanes: list[str],
        stopping: Callable[[], bool],
    ) -> None:
        self.engine, self.intake, self.admission, self.starter = engine, intake, admission, starter
        self.running, self.held, self.lanes, self.stopping = running, held, lanes, stopping
        self._fair: Entry | None = None  # the lower-lane entry a fair turn took in a hold

    def fill(self) -> None:
        """Move entries into the engine while admission lets the next one in, at most a
        turn's takes of them between two steps: a wave of finished jobs is refilled over a
        few steps instead of stalling the running ones (and a top-lane arrival). The
        entries of a turn cost two round trips together: one read (Intake.take) and one
        pipeline of BEGINs (Starter.start). Entries that end at once (cancelled, expired,
        refused) do not count. Only as many are read as admission has room for, so that a
        worker does not hold entries it cannot start while another worker could."""
        a, top, added = self.admission, self.lanes[0], 0
        limit = a.takes()
        while added < limit and not self.stopping():
            now = time.monotonic()
            slow = a.slow()
            if slow and not self.running.lower_running():
                # new work waits in the queue while the top lane's tokens are slow, a
                # top-lane entry no longer than top_lane_wait_ms
                if not self.held or self.held[0].lane != top:
                    self.held[:0] = self._waited(now)
                if not self.held or self.held[0].lane != top and self.held[0] is not self._fair:
                    return
            else:
                room = a.room(False, now)
                n = min(limit - added, max(room, a.room(True, now)))
                if n <= 0:
                    return
                if not self.held:
                    idle = not self.engine.has_unfinished() and not self.running
                    below_top = a.room_below_top(now) if room > 0 and not slow else 0
                    # a read that may reach the lower lanes asks for no more entries than
                    # they may start (their backlog bound, the top lane's reserve); the
                    # top lane's further entries come in the turn's next reads
                    lower = max(0, min(n, room, below_top))
                    self.held[:] = self.intake.take(idle, lower > 0, count=lower or n)
                    if not self.held:
                        return
                elif self.held[0].lane != top and (slow or not self._startable(room, now)):
                    # the lower-lane entries held must wait: a top-lane arrival need not
                    arrived = self.intake.take(False, False, count=n)
                    if not arrived:
                        return
                    self.held[:0] = arrived
            batch: Batch = []
            while self.held and added + len(batch) < limit:
                entry, req = self.held[0], self.held[0].req
                if self.starter.duplicate(entry, batch):
                    self.held.pop(0)
                    continue
                if entry.lane != top and (
                    slow
                    and entry is not self._fair
                    or not a.room_below_top(now)
                    or a.slowdown
                    and any(e.lane == top for e, _ in batch)  # its prompt not computed
                ):
                    break  # held until the top lane's reserve and pace allow it
                output = req.envelope.max_tokens * req.n
                if self.engine.has_unfinished() and not a.fits(
                    req.prompt_tokens, output, entry.lane == top, now
                ):
                    break
                a.taken(req.prompt_tokens, req.envelope.max_tokens, req.n, entry.lane == top)
                batch.append((self.held.pop(0), self.starter.add(entry)))
            if not batch:
                if self.held:  # the next one does not fit now
                    return
                continue  # every one was a second entry of a running job
            added += self.starter.start(batch)

    def _waited(self, now: float) -> list[Entry]:
        """The top-lane entry that has waited top_lane_wait_ms in the queue, if one has, or
        on the lower lanes' fair turn their oldest entry (admission.py)."""
        a = self.admission
        if not a.look_for_waited(now):
            return []
        if a.fair_turn():
            got = self.intake.take_waited(0, self.lanes[1:])
            if got:
                a.took_waited(len(got), fair=True)
                self._fair = got[0]
                return got
        got = self.intake.take_waited(round(a.wait_ms))
        a.took_waited(len(got), fair=False)
        return got

    def _startable(self, room: int, now: float) -> bool:
        """Whether the first lower-lane entry held may start now."""
        req = self.held[0].req
        return self.admission.startable(
            req.prompt_tokens, req.envelope.max_tokens * req.n, room, now
        )
