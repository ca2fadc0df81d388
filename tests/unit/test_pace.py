"""gpu_workers/pace.py: lower lanes yield while the top lane's tokens come slower than on
an unloaded engine, and only while top-lane work is around."""

from __future__ import annotations

import pytest

from plurai.gpu_workers.pace import Pace


def feed(p: Pace, start: float, seconds: float, tpot: float, per_arrival: int = 1) -> float:
    """Top-lane tokens at `tpot` seconds each for `seconds`, `per_arrival` at a time;
    returns the time at the end."""
    now, gap = start, tpot * per_arrival
    while now < start + seconds:
        now += gap
        p.tokens(gap, per_arrival, now)
    return now


def test_lower_lanes_close_while_the_top_lane_slows_and_reopen() -> None:
    p = Pace(slowdown=3.0)
    assert p.lower_lanes_open(0.0)  # nothing measured yet
    t = feed(p, 0.0, 2.0, 0.03)  # unloaded: 30 ms a token
    assert p.unloaded_s == pytest.approx(0.03) and p.lower_lanes_open(t)
    t = feed(p, t, 3.0, 0.2, per_arrival=4)  # a batch flood: 200 ms a token
    assert p.tpot_s == pytest.approx(0.2) and not p.lower_lanes_open(t)
    assert p.unloaded_s == pytest.approx(0.03)  # slow arrivals leave the unloaded time alone
    t = feed(p, t, 2.0, 0.04)  # the batch drained: 40 ms again
    assert p.lower_lanes_open(t)


def test_tokens_in_uneven_bunches_measure_their_true_pace() -> None:
    """20 ms a token, handed over as one token after 60 ms, then two more at once: the
    unloaded time is 20 ms, not the 0 or 10 ms a per-arrival average would learn."""
    p = Pace(slowdown=3.0)
    now = 0.0
    for _ in range(100):
        now += 0.06
        p.tokens(0.06, 1, now)
        now += 0.001
        p.tokens(0.001, 2, now)
    assert p.unloaded_s == pytest.approx(0.0203, abs=0.001)
    assert p.tpot_s == pytest.approx(0.0203, abs=0.001) and p.lower_lanes_open(now)


def test_the_unloaded_time_is_relearnt_slowly() -> None:
    p = Pace(slowdown=3.0)
    t = feed(p, 0.0, 2.0, 0.03)
    t = feed(p, t, 600.0, 0.06)  # ten minutes at 60 ms: each minute the unloaded time rises 10%
    assert 0.05 <= p.unloaded_s <= 0.03 * 1.1**10 + 1e-9  # learnt again, never faster


def test_too_few_tokens_set_no_unloaded_time() -> None:
    p = Pace(slowdown=3.0)
    p.tokens(0.001, 1, now=1.0)  # one token alone says little: a gate on it would hold all
    assert p.unloaded_s == 0.0 and p.lower_lanes_open(1.0)


def test_no_gate_without_recent_top_lane_work_or_when_off() -> None:
    p = Pace(slowdown=3.0, window_s=10.0)
    t = feed(p, 0.0, 2.0, 0.03)
    t = feed(p, t, 3.0, 1.0)
    assert not p.lower_lanes_open(t)
    assert p.lower_lanes_open(t + 10.5)  # no top-lane job for 10 s: batch work may fill it
    p.seen(t + 11.0)  # a top-lane job started
    assert not p.lower_lanes_open(t + 11.5)
    off = Pace(slowdown=0.0)
    t = feed(off, 0.0, 2.0, 0.03)
    feed(off, t, 3.0, 5.0)
    assert off.lower_lanes_open(t + 10.0)


def test_the_target_is_crossed_by_the_recent_time_only() -> None:
    p = Pace(slowdown=3.0, target_s=0.1)
    t = feed(p, 0.0, 2.0, 0.03)
    assert not p.over_target()
    t = feed(p, t, 2.0, 0.15, per_arrival=3)
    assert p.over_target()
    feed(p, t, 2.0, 0.05)
    assert not p.over_target()
    off = Pace(slowdown=3.0)
    feed(off, 0.0, 2.0, 5.0)
    assert not off.over_target()  # no target: never over


def test_with_a_target_the_lower_lanes_yield_at_the_target_not_the_slowdown() -> None:
    """An operator's target over slowdown x unloaded: lower lanes run up to the target
    (over it, the worker holds every lane), not up to the slowdown's lower bound."""
    p = Pace(slowdown=3.0, target_s=0.05)
    t = feed(p, 0.0, 2.0, 0.013)  # unloaded: 13 ms a token, so 3x is 39 ms
    t = feed(p, t, 2.0, 0.045)  # 45 ms: over 3x the unloaded time, under the target
    assert p.lower_lanes_open(t) and not p.over_target()
    t = feed(p, t, 2.0, 0.06)
    assert p.over_target()  # the worker holds every lane now
    no_target = Pace(slowdown=3.0)
    t = feed(no_target, 0.0, 2.0, 0.013)
    t = feed(no_target, t, 2.0, 0.045)
    assert not no_target.lower_lanes_open(t)
