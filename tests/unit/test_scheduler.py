"""Scheduling order: priority, FCFS within a priority, aging, preemption victims."""

from __future__ import annotations

import pytest

from gpu_workers.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def path(model_factory):
    return model_factory("llama")


def finish_order(engine) -> list[str]:
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


def test_lower_priority_value_runs_first_fcfs_within(path, engine_factory):
    engine = engine_factory(path, max_num_seqs=1)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    for rid, prio in [("low-1", 5), ("high-1", 0), ("mid", 2), ("high-2", 0), ("low-2", 5)]:
        engine.add(rid, token_ids=[20, 21, 22], params=sp, priority=prio)
    assert finish_order(engine) == ["high-1", "high-2", "mid", "low-1", "low-2"]


def test_aging_keeps_low_priority_moving(path, engine_factory):
    def run(aging_steps: int) -> int:
        """Steps until a priority-9 request finishes under a stream of priority-0 ones."""
        engine = engine_factory(path, max_num_seqs=1, priority_aging_steps=aging_steps)
        sp = SamplingParams(max_tokens=2, ignore_eos=True)
        engine.add("low", token_ids=[30, 31], params=sp, priority=9)
        for step in range(1, 400):
            engine.add(f"high{step}", token_ids=[40, 41], params=sp, priority=0)
            if any(o.request_id == "low" and o.finished for o in engine.step()):
                return step
        return -1

    assert run(aging_steps=1_000_000) == -1  # starved without aging
    finished_at = run(aging_steps=4)
    assert 0 < finished_at < 100


def test_preemption_takes_the_worst_priority_newest_sequence(path, engine_factory):
    engine = engine_factory(path, num_kv_blocks=8, block_size=16, max_num_batched_tokens=256)
    sp = SamplingParams(max_tokens=60, ignore_eos=True)
    engine.add("vip", token_ids=[50] * 20, params=sp, priority=0)
    engine.add("old-bulk", token_ids=[51] * 20, params=sp, priority=3)
    engine.add("new-bulk", token_ids=[52] * 20, params=sp, priority=3)
    seqs = dict(engine.seqs)
    while engine.scheduler.num_preemptions == 0 and engine.has_unfinished():
        engine.step()
    assert seqs["new-bulk"].num_preemptions == 1
    assert seqs["vip"].num_preemptions == seqs["old-bulk"].num_preemptions == 0
    while engine.has_unfinished():
        engine.step()
    assert seqs["vip"].num_preemptions == 0
    assert all(s.num_output_tokens == 60 for s in seqs.values())
