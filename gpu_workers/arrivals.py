"""Arrivals: a busy worker hears of a new entry at once instead of at its next poll.

Every submit that goes through Plurai (SDK, gateway, bulk) publishes the entry's stream on
its model's arrivals channel (keys.arrivals) in the script that adds the entry. A thread
here listens on that channel, marks that something arrived (`take` reads and clears the
mark: worker.py then reads every lane, not only the top one) and calls `wake`, the
backend's: a backend that waits for its engine's outputs between steps (vLLM's engine
process) stops waiting, so the worker takes the entry now rather than after the wait.

An idle worker needs none of this (its blocking read wakes on the entry itself), and an
entry added by a client that writes XADD itself is still read: the top lane every step,
the others after poll_ms.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

log = logging.getLogger("plurai.worker")

RETRY_S = 1.0  # after the channel's connection failed


class Arrivals:
    def __init__(self, r: redis.Redis, channel: str, wake: Callable[[], None]) -> None:
        self.r, self.channel, self.wake = r, channel, wake
        self._arrived = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._listen, name="arrivals", daemon=True)
        self._thread.start()

    def take(self) -> bool:
        """Whether an entry arrived since the last call (read before the lanes are, so
        that an entry marked after the read is read next time)."""
        if not self._arrived.is_set():
            return False
        self._arrived.clear()
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * RETRY_S)

    def _listen(self) -> None:
        failed = False
        while not self._stop.is_set():
            pubsub = self.r.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.channel)
                if failed:
                    log.info("arrivals channel back")
                    failed = False
                self._arrived.set()  # anything added while not subscribed
                while not self._stop.is_set():
                    if pubsub.get_message(timeout=RETRY_S) is not None:
                        self._arrived.set()
                        self.wake()
            except (redis.RedisError, OSError, ValueError) as e:
                if not failed:  # once per outage: the worker logs Redis's failures itself
                    log.warning("arrivals channel lost (%s); lanes are polled meanwhile", e)
                    failed = True
                self._stop.wait(RETRY_S)
            finally:
                try:
                    pubsub.close()
                except (redis.RedisError, OSError):
                    pass
