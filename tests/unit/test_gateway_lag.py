"""The gateway's loop watch: a callback that holds the event loop is timed and named."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram

from plurai.gateway.lag import LoopWatch


def lag_histogram() -> tuple[Histogram, CollectorRegistry]:
    reg = CollectorRegistry()
    return Histogram("lag_seconds", "lag", registry=reg, buckets=(0.1, 0.5, 1, 5)), reg


def held_by_a_blocking_call(seconds: float) -> None:
    time.sleep(seconds)


def held_by_python_work(seconds: float) -> None:
    """Busy for `seconds` of this thread's CPU time: longer on a loaded machine."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def watched(hold, seconds: float) -> tuple[LoopWatch, float]:
    """The watch, and how long the hold held the loop."""
    lag, _ = lag_histogram()
    watch = LoopWatch(lag, tick_s=0.02, stall_s=0.3)
    watch.start()
    await asyncio.sleep(0.1)
    start = time.monotonic()
    hold(seconds)
    held = time.monotonic() - start
    await asyncio.sleep(0.1)
    await watch.stop()
    return watch, held


@pytest.mark.parametrize(
    ("hold", "busy"), [(held_by_a_blocking_call, False), (held_by_python_work, True)]
)
def test_a_stall_is_logged_once_with_its_length_cpu_and_the_holders_name(
    hold, busy: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="plurai.gateway"):
        watch, held = asyncio.run(watched(hold, 0.8))
    stalls = [r for r in caplog.records if "event loop stalled" in r.getMessage()]
    assert watch.stalls == 1 and len(stalls) == 1
    text = stalls[0].getMessage()
    assert hold.__name__ in text  # the stack taken during the stall names the holder
    late = float(text.split("stalled for ")[1].split(" s")[0])
    cpu = float(text.split("using ")[1].split(" s")[0])
    assert held - 0.05 <= late < held + 2
    # a blocking call used no CPU; a busy loop used about its length
    assert (cpu > 0.4) if busy else (cpu < 0.3)


def test_short_delays_are_observed_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    lag, reg = lag_histogram()

    async def run() -> LoopWatch:
        watch = LoopWatch(lag, tick_s=0.02, stall_s=0.5)
        watch.start()
        for _ in range(3):
            await asyncio.sleep(0.05)
            held_by_a_blocking_call(0.15)
        await asyncio.sleep(0.05)
        await watch.stop()
        return watch

    with caplog.at_level(logging.WARNING, logger="plurai.gateway"):
        watch = asyncio.run(run())
    assert watch.stalls == 0 and "stalled" not in caplog.text
    count = reg.get_sample_value("lag_seconds_count")
    over = count - reg.get_sample_value("lag_seconds_bucket", {"le": "0.1"})
    assert count >= 5 and over >= 3  # each 0.15 s hold made one tick late by about that
