"""Scheduling order: priority, FCFS within a priority, aging, preemption victims."""

from __future__ import annotations

import pytest

from plurai.gpu_workers.backend import AddRequest
from plurai.gpu_workers.engine.sampling_params import SamplingParams


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
        engine.add(AddRequest(rid, token_ids=[20, 21, 22], params=sp, priority=prio))
    assert finish_order(engine) == ["high-1", "high-2", "mid", "low-1", "low-2"]


def test_aging_keeps_low_priority_moving(path, engine_factory):
    def run(aging_steps: int) -> int:
        """Steps until a priority-9 request finishes under a stream of priority-0 ones."""
        engine = engine_factory(path, max_num_seqs=1, priority_aging_steps=aging_steps)
        sp = SamplingParams(max_tokens=2, ignore_eos=True)
        engine.add(AddRequest("low", token_ids=[30, 31], params=sp, priority=9))
        for step in range(1, 400):
            engine.add(AddRequest(f"high{step}", token_ids=[40, 41], params=sp, priority=0))
            if any(o.request_id == "low" and o.finished for o in engine.step()):
                return step
        return -1

    assert run(aging_steps=1_000_000) == -1  # starved without aging
    finished_at = run(aging_steps=4)
    assert 0 < finished_at < 100


def test_preemption_takes_the_worst_priority_newest_sequence(path, engine_factory):
    engine = engine_factory(path, num_kv_blocks=8, block_size=16, max_num_batched_tokens=256)
    sp = SamplingParams(max_tokens=60, ignore_eos=True)
    engine.add(AddRequest("vip", token_ids=[50] * 20, params=sp, priority=0))
    engine.add(AddRequest("old-bulk", token_ids=[51] * 20, params=sp, priority=3))
    engine.add(AddRequest("new-bulk", token_ids=[52] * 20, params=sp, priority=3))
    seqs = dict(engine.seqs)
    while engine.scheduler.num_preemptions == 0 and engine.has_unfinished():
        engine.step()
    assert seqs["new-bulk"].num_preemptions == 1
    assert seqs["vip"].num_preemptions == seqs["old-bulk"].num_preemptions == 0
    while engine.has_unfinished():
        engine.step()
    assert seqs["vip"].num_preemptions == 0
    assert all(s.num_output_tokens == 60 for s in seqs.values())


def test_a_high_priority_arrival_preempts_low_priority_work(path, engine_factory, reference):
    engine = engine_factory(path, num_kv_blocks=8, block_size=16, max_num_batched_tokens=256)
    low = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.add(AddRequest("bulk-1", token_ids=[61] * 30, params=low, priority=5))
    engine.add(AddRequest("bulk-2", token_ids=[62] * 30, params=low, priority=5))
    tokens: dict[str, list[int]] = {rid: [] for rid in ("bulk-1", "bulk-2", "urgent")}
    for _ in range(3):  # both bulk requests now hold 6 of the 8 blocks
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    seqs = dict(engine.seqs)
    urgent = [63, 64, 65] * 22
    engine.add(
        AddRequest(
            "urgent",
            token_ids=urgent,
            params=SamplingParams(max_tokens=10, ignore_eos=True),
            priority=0,
        ),
    )
    out = engine.step()
    # it needed 5 blocks, only 4 were free: the newest low-priority request made room
    assert [o.request_id for o in out] == ["urgent"]
    assert seqs["bulk-2"].num_preemptions == 1 and seqs["bulk-1"].num_preemptions == 0
    for o in out:
        tokens[o.request_id] += o.new_token_ids
    order = []
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                order.append(o.request_id)
    assert order.index("urgent") < order.index("bulk-2")
    assert seqs["bulk-1"].num_preemptions == 0
    assert tokens["urgent"] == reference(path, [urgent], 10)[0]
    assert tokens["bulk-2"] == reference(path, [[62] * 30], 40)[0]  # resumed exactly
    # its readmission reused its own blocks: not a prefix-cache hit of its prompt
    assert seqs["bulk-2"].num_cached_tokens == 0 and engine.stats()["prefix_hit_blocks"] == 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_equal_priority_never_preempts_to_get_in(path, engine_factory):
    engine = engine_factory(path, num_kv_blocks=8, block_size=16, max_num_batched_tokens=256)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.add(AddRequest("a", token_ids=[71] * 30, params=sp, priority=1))
    engine.add(AddRequest("b", token_ids=[72] * 30, params=sp, priority=1))
    for _ in range(3):
        engine.step()
    engine.add(AddRequest("c", token_ids=[73] * 36, params=sp, priority=1))
    engine.step()
    assert engine.scheduler.num_preemptions == 0
    assert [s.request_id for s in engine.scheduler.waiting] == ["c"]


def test_a_higher_priority_arrival_gets_a_step_of_its_own(path, engine_factory):
    engine = engine_factory(path)
    bulk = SamplingParams(max_tokens=40, ignore_eos=True)
    for i in range(4):
        engine.add(AddRequest(f"bulk{i}", token_ids=[60 + i] * 10, params=bulk, priority=5))
    for _ in range(3):
        engine.step()
    vip = SamplingParams(max_tokens=5, ignore_eos=True)
    engine.add(AddRequest("vip", token_ids=[70] * 12, params=vip, priority=0))
    assert [o.request_id for o in engine.step()] == ["vip"]  # its first token, alone
    assert {o.request_id for o in engine.step()} == {"vip", "bulk0", "bulk1", "bulk2", "bulk3"}
    # an arrival of the same priority as running work joins the batch at once
    engine.add(AddRequest("peer", token_ids=[71] * 12, params=bulk, priority=5))
    assert {o.request_id for o in engine.step()} == {"vip", "peer", *(f"bulk{i}" for i in range(4))}
