"""gpu_workers/pace.py: lower lanes yield while the top lane's tokens come slower than on
an unloaded engine, and only while top-lane work is around."""

from __future__ import annotations

import pytest

from gpu_workers.pace import Pace


def test_lower_lanes_close_while_the_top_lane_slows_and_reopen() -> None:
    p = Pace(slowdown=3.0)
    assert p.lower_lanes_open(0.0)  # nothing measured yet
    for i in range(5):  # unloaded: 30 ms a token
        p.tokens(0.03, 1, now=float(i))
    assert p.unloaded_s == pytest.approx(0.03) and p.lower_lanes_open(5.0)
    for i in range(10):  # a batch flood: 200 ms a token, 4 tokens an arrival
        p.tokens(0.8, 4, now=5.0 + i)
    assert p.tpot_s > 3 * 0.03 and not p.lower_lanes_open(15.0)
    assert p.unloaded_s == pytest.approx(0.03)  # slow arrivals leave the unloaded time alone
    for i in range(10):  # the batch drained: 40 ms again
        p.tokens(0.04, 1, now=16.0 + i)
    assert p.lower_lanes_open(26.0)


def test_the_unloaded_time_is_relearnt_slowly() -> None:
    p = Pace(slowdown=3.0)
    p.tokens(0.03, 1, now=0.0)
    for i in range(1, 11):  # ten minutes at 60 ms: each minute the unloaded time rises 10%
        p.tokens(0.06, 1, now=60.0 * i)
    assert 0.05 <= p.unloaded_s <= 0.03 * 1.1**10 + 1e-9  # learnt again, never faster


def test_no_gate_without_recent_top_lane_work_or_when_off() -> None:
    p = Pace(slowdown=3.0, window_s=10.0)
    p.tokens(0.03, 1, now=0.0)
    p.tokens(1.0, 1, now=1.0)
    p.tokens(1.0, 1, now=2.0)
    assert not p.lower_lanes_open(3.0)
    assert p.lower_lanes_open(12.5)  # no top-lane job for 10 s: batch work may fill it
    p.seen(13.0)  # a top-lane job started
    assert not p.lower_lanes_open(13.5)
    off = Pace(slowdown=0.0)
    off.tokens(0.03, 1, now=0.0)
    off.tokens(5.0, 1, now=1.0)
    assert off.lower_lanes_open(1.5)


def test_an_interval_of_no_length_measures_nothing() -> None:
    p = Pace(slowdown=3.0)
    for i in range(5):
        p.tokens(0.03, 1, now=float(i))
    for i in range(20):  # outputs that came together: no time between them
        p.tokens(0.0, 1, now=5.0 + i)
    assert p.unloaded_s == pytest.approx(0.03) and p.tpot_s == pytest.approx(0.03)
    p.tokens(0.08, 1, now=26.0)
    assert p.lower_lanes_open(26.0)  # 0.03 + 0.3 * 0.05 = 45 ms: within 3x
