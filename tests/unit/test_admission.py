"""The admission policy as a pure object: known figures in, the worker's decision out (no
Redis, no engine). The fleet simulation runs the same object (bench/serving/simulation.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from plurai.broker_config.settings import Settings
from plurai.gpu_workers.admission import Admission


@dataclass
class Engine:
    """Recorded engine figures; can_admit by KV tokens and slots, as a backend counts."""

    running: int = 0
    kv_free: int = 10_000  # tokens of KV left
    prompt_backlog: int = 0
    max_num_seqs: int = 64
    step_tokens: int = 2048
    num_waiting: int = 0
    asked: list[tuple] = field(default_factory=list)

    @property
    def num_running(self) -> int:
        return self.running

    def has_unfinished(self) -> bool:
        return self.running > 0

    def can_admit(self, prompt: int, max_tokens: int, priority=None, spare: int = 0) -> bool:
        self.asked.append((prompt, max_tokens, priority, spare))
        return self.running < self.max_num_seqs and prompt + max_tokens + spare <= self.kv_free


@dataclass
class Jobs:
    top_pending: int = 0  # prompt tokens of top-lane jobs with no token yet
    lower: bool = False
    making: bool = True

    def top_backlog(self) -> int:
        return self.top_pending

    def lower_running(self) -> bool:
        return self.lower

    def top_making(self) -> bool:
        return self.making


def policy(**knobs) -> tuple[Admission, Engine, Jobs]:
    engine, jobs = Engine(), Jobs()
    settings = Settings.model_construct(lanes=["interactive", "batch"], **knobs)
    return Admission.of(settings, engine, jobs), engine, jobs


def top_tokens(a: Admission, tpot_s: float, now: float, n: int = 10) -> None:
    """A top-lane job made n tokens at tpot_s each, ending at `now`."""
    a.pace.tokens(tpot_s * n, n, now)


def test_the_pace_gate_holds_lower_lanes_while_the_top_lane_slows() -> None:
    a, engine, _ = policy()  # top_lane_slowdown 3
    engine.running = 2
    top_tokens(a, 0.010, now=100.0)  # unloaded: 10 ms a token
    assert a.room_below_top(100.0) == 64 - 4 - 2  # slots beyond the top lane's reserve
    top_tokens(a, 0.025, now=101.5)  # 2.5x: within the gate
    assert a.room_below_top(101.5) > 0
    top_tokens(a, 0.040, now=103.0)  # 4x the unloaded time
    assert a.room_below_top(103.0) == 0
    assert a.room_below_top(103.0 + a.pace.window_s + 1) > 0  # the top lane left: open


def test_no_lower_lane_entry_beside_a_top_lane_prompt_not_computed() -> None:
    a, engine, jobs = policy()
    engine.running, jobs.top_pending = 1, 300
    assert a.room_below_top(0.0) == 0
    jobs.top_pending = 0
    assert a.room_below_top(0.0) == 64 - 4 - 1
    engine.running = 0  # an idle engine takes anything
    jobs.top_pending = 300
    assert a.room_below_top(0.0) == 64


def test_over_the_target_only_top_lane_entries_that_waited_their_bound() -> None:
    a, _, jobs = policy(top_lane_tpot_ms=20.0, top_lane_wait_ms=500.0, poll_ms=20)
    top_tokens(a, 0.010, now=1.0)
    assert not a.slow()
    top_tokens(a, 0.050, now=2.5)  # the last second's tokens: 50 ms each
    assert a.slow()
    jobs.making = False  # no top-lane job makes tokens here: not this worker's to hold
    assert not a.slow()
    jobs.making = True
    assert a.wait_ms == 500.0  # the bound the worker asks the queue for (take_waited)
    assert a.look_for_waited(10.0)
    assert not a.look_for_waited(10.019)  # once a poll
    assert a.look_for_waited(10.02)


def test_no_wait_bound_never_looks() -> None:
    a, _, _ = policy(top_lane_tpot_ms=20.0, top_lane_wait_ms=0.0)
    assert not a.look_for_waited(10.0)


def test_the_lower_lanes_fair_turn_in_a_hold() -> None:
    a, _, _ = policy(top_lane_tpot_ms=20.0, fair_every=4)
    turns = []
    for _ in range(9):
        fair = a.fair_turn()
        turns.append(fair)
        a.took_waited(1, fair)
    assert turns == [False, False, False, True, False, False, False, True, False]
    one_lane, _, _ = policy(top_lane_tpot_ms=20.0, fair_every=1)
    one_lane.lanes = 1
    assert not one_lane.fair_turn()


def test_the_backlog_bound_by_lane_and_objective() -> None:
    a, engine, _ = policy(prefill_backlog_tokens=512)
    assert a.bound(True, 0.0) is None and a.bound(False, 0.0) is None  # no objective
    a.pace.seen(10.0)  # the top lane runs here: lower lanes keep to the bound
    assert a.bound(False, 10.0) == 512 and a.bound(True, 10.0) is None
    assert a.bound(False, 10.0 + a.pace.window_s + 1) is None
    o, _, _ = policy(prefill_backlog_tokens=512, top_lane_tpot_ms=50.0)
    assert o.bound(True, 0.0) == o.bound(False, 0.0) == 2048  # the engine's step budget
    o.pace.seen(0.0)
    assert o.bound(False, 0.0) == 512


def test_fits_counts_the_backlog_of_the_lane() -> None:
    a, engine, jobs = policy(top_lane_tpot_ms=50.0)
    engine.running, engine.prompt_backlog, jobs.top_pending = 3, 1800, 100
    assert not a.fits(300, 16, False, 0.0)  # 1,800 + 300 over 2,048
    assert a.fits(300, 16, True, 0.0)  # the top lane counts its own 100 only
    engine.prompt_backlog = 0
    assert a.fits(5000, 16, False, 0.0)  # a prompt alone always may (room permitting)
    engine.kv_free = 100
    assert not a.fits(300, 16, False, 0.0)


def test_lower_lanes_leave_kv_for_the_top_lane() -> None:
    a, engine, _ = policy(top_lane_reserve=2)
    a.taken(400, 100, 1, top=True)  # a top-lane request of 500 tokens
    a.pace.seen(0.0)
    assert a.top_kv_reserve(0.0) == 1000
    a.admits(10, 10, False, 0.0)
    assert engine.asked[-1][3] == 1000  # the spare the backend keeps free
    a.admits(10, 10, True, 0.0)
    assert engine.asked[-1][2] is not None and engine.asked[-1][3] == 0  # may preempt
    assert a.top_kv_reserve(a.pace.window_s + 1) == 0


@pytest.mark.parametrize("running", [0, 3])
def test_how_many_to_read(running: int) -> None:
    a, engine, _ = policy(takes_per_step=8)
    engine.running = running
    a.taken(1000, 500, 1, top=False)
    engine.kv_free = 4600  # three requests of 1,500
    assert a.room(False, 0.0) == (8 if not running else 3)
    assert a.takes() == 8
    default, _, _ = policy()
    assert default.takes() == 4  # max(4, 64 // 16)
