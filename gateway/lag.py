"""How late the gateway's event loop runs, and where it was when it stalled.

Every request of a gateway is served by one asyncio loop: anything that holds it (a slow
callback, a blocking call, the process starved of CPU) delays every request at once. A
task wakes every `TICK_S` and observes how late it woke (`plurai_gateway_loop_lag_seconds`).
A thread checks the task's last wake: once the loop has been silent `STALL_S`, it takes the
loop thread's stack then; when the loop runs again the stall is logged once, with that
stack, its length and the CPU the process used meanwhile. CPU near the stall's length
means Python work held the loop (the stack says which); far below it, a blocking call or
a machine that gave the process no CPU.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

from prometheus_client import Histogram

log = logging.getLogger("plurai.gateway")

TICK_S = 0.1
STALL_S = 1.0


class LoopWatch:
    def __init__(self, lag: Histogram, tick_s: float = TICK_S, stall_s: float = STALL_S) -> None:
        self.lag, self.tick_s, self.stall_s = lag, tick_s, stall_s
        self.beat = time.monotonic()
        self.loop_thread = 0
        self.stack = ""  # the loop thread's stack, taken while the loop is stalled
        self.beat_cpu = 0.0  # the process's CPU seconds at the last wake
        self.task: asyncio.Task | None = None
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.stalls = 0  # logged so far

    def start(self) -> None:
        self.loop_thread = threading.get_ident()
        self.beat, self.beat_cpu = time.monotonic(), time.process_time()
        self.task = asyncio.get_running_loop().create_task(self._tick())
        self.thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
        self.thread.start()

    async def stop(self) -> None:
        self.stopped.set()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        if self.thread is not None:
            self.thread.join(timeout=2)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            late = max(0.0, now - self.beat - self.tick_s)
            used = time.process_time()
            cpu, self.beat_cpu = used - self.beat_cpu, used
            self.beat = now
            # a stack taken as the loop woke belongs to no stall: dropped here
            stack, self.stack = self.stack, ""
            self.lag.observe(late)
            if late >= self.stall_s:
                self._report(late, cpu, stack)

    def _report(self, late: float, cpu: float, stack: str) -> None:
        self.stalls += 1
        log.warning(
            "the event loop stalled for %.2f s, using %.2f s of CPU; every request waited. "
            "Loop thread %g s in:\n%s",
            late,
            cpu,
            self.stall_s,
            stack or "  (not taken: the watch thread did not run during the stall)\n",
        )

    def _watch(self) -> None:
        while not self.stopped.wait(self.tick_s):
            silent = time.monotonic() - self.beat
            if silent < self.stall_s or self.stack:
                continue
            frame = sys._current_frames().get(self.loop_thread)
            if frame is not None:
                self.stack = "".join(traceback.format_stack(frame)[-12:])
