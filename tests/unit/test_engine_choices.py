"""A request with n > 1 (SamplingParams.n): its choices share the prompt, computed once
(the lead's full prompt blocks forked to the others), and choice i gives exactly what a
request of seed + i gives alone; a resume keeps every choice."""

from __future__ import annotations

import pytest

from plurai.gpu_workers.backend import AddRequest
from plurai.gpu_workers.engine.errors import ErrorCode, RequestError
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from tests.helpers import greedy, prompt

BLOCK = 16


@pytest.fixture(scope="module")
def path(model_factory):
    return model_factory("llama")


def seeded(seed: int = 7, n: int = 1, max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True, n=n
    )


def computed_per_step(engine) -> list[int]:
    """Tokens each step computes (prompt chunks, decodes), recorded from the next step on."""
    steps: list[int] = []
    run = engine.runner.run

    def counted(seqs):
        steps.append(sum(s.num_scheduled for s in seqs))
        return run(seqs)

    engine.runner.run = counted
    return steps


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("batched", [512, 16])  # 16: the lead's prompt in chunks
def test_the_prompt_is_computed_once(path, engine_factory, prefix_caching, batched):
    engine = engine_factory(
        path, prefix_caching=prefix_caching, max_num_batched_tokens=batched, chunked_prefill=True
    )
    steps = computed_per_step(engine)
    p = prompt(50, 1)  # 3 full blocks and 2 tokens
    engine.add(AddRequest("r", token_ids=p, params=seeded(n=3, max_tokens=4)))
    lead, *others = engine.seqs["r"].choices
    shared: list[int] = []
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
        if not shared and all(s.block_table for s in others):
            shared = lead.block_table[:3]
            assert all(s.block_table[:3] == shared for s in others)
            assert all(engine.blocks.blocks[b].ref_count == 3 for b in shared)
            assert all(s.num_cached_tokens == 3 * BLOCK for s in others)
    assert shared
    # the lead computes the prompt, each other choice its last partial block; then one
    # token a choice a step
    assert sum(steps) == 50 + 2 * 2 + 3 * 4 - 3
    assert sorted(len(o.new_token_ids) for o in outs) == [1] * 12
    assert {o.index for o in outs} == {0, 1, 2}
    assert all(o.num_prompt_tokens == 50 and o.num_cached_tokens == 0 for o in outs)
    assert not engine.seqs and engine.blocks.num_free == engine.blocks.num_blocks


def test_a_choice_waits_for_its_leads_prompt(path, engine_factory):
    engine = engine_factory(path, max_num_batched_tokens=16)
    engine.add(AddRequest("r", token_ids=prompt(50, 2), params=seeded(n=2, max_tokens=4)))
    lead, other = engine.seqs["r"].choices
    while lead.num_computed_tokens < 50:
        engine.step()
        assert not other.block_table  # nothing of its own computed meanwhile
    engine.step()
    assert other.block_table[:3] == lead.block_table[:3]


def test_each_choice_is_the_request_of_its_seed(path, engine_factory):
    engine = engine_factory(path)
    p = prompt(37, 3)
    got = engine.generate([p], seeded(seed=11, n=3))
    assert [c.index for c in got] == [0, 1, 2]
    alone = [engine_factory(path).generate([p], seeded(seed=11 + i))[0] for i in range(3)]
    assert [c.token_ids for c in got] == [c.token_ids for c in alone]
    assert [c.text for c in got] == [c.text for c in alone]
    assert len({tuple(c.token_ids) for c in got}) == 3
    # the same request again gives the same choices
    assert [c.token_ids for c in engine.generate([p], seeded(seed=11, n=3))] == [
        c.token_ids for c in got
    ]


def test_greedy_choices_are_equal(path, engine_factory, reference):
    engine = engine_factory(path)
    ps = [prompt(20, 4), prompt(48, 5)]  # the second: 3 full blocks, one recomputed
    got = engine.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True, n=3))
    want = reference(path, ps, 12)
    assert [c.token_ids for c in got] == [want[0]] * 3 + [want[1]] * 3


def test_seed_near_the_top_wraps(path, engine_factory):
    top = 2**63 - 1
    assert SamplingParams(seed=top, n=3).for_choice(2).seed == 1
    assert SamplingParams(seed=top, n=3).for_choice(0).seed == top
    assert SamplingParams(n=3).for_choice(1).seed is None


def test_choices_under_preemption_match(path, engine_factory, reference):
    # 14 blocks of 16 for two requests of two choices that grow to ~90 tokens each
    engine = engine_factory(path, num_kv_blocks=14, max_num_batched_tokens=64)
    ps = [prompt(40, 6), prompt(35, 7)]
    got = engine.generate(ps, SamplingParams(max_tokens=48, ignore_eos=True, n=2))
    assert engine.scheduler.num_preemptions > 0
    want = reference(path, ps, 48)
    assert [c.token_ids for c in got] == [want[0], want[0], want[1], want[1]]
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_bad_n_is_refused(path, engine_factory):
    engine = engine_factory(path)
    for n in (0, -1, "2", 1.0, True):
        with pytest.raises(RequestError) as e:
            engine.add(AddRequest("bad", token_ids=[20, 21], params={"n": n}))
        assert e.value.code == ErrorCode.INVALID_PARAMS and "n must" in e.value.message
    assert not engine.seqs and not engine.has_unfinished()


def test_more_choices_than_sequences_at_once(path, engine_factory, reference):
    engine = engine_factory(path, max_num_seqs=2)
    p = prompt(30, 13)
    got = engine.generate([p], SamplingParams(max_tokens=8, ignore_eos=True, n=5))
    assert [c.token_ids for c in got] == reference(path, [p], 8) * 5
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_preempted_choice_reports_its_request(path, engine_factory):
    # 12 blocks: three choices that grow to 7 blocks each (2 shared) cannot all run
    engine = engine_factory(path, num_kv_blocks=12, max_num_batched_tokens=64)
    engine.add(AddRequest("r", token_ids=prompt(40, 14), params=seeded(n=3, max_tokens=60)))
    preempted = []
    while engine.has_unfinished() and not preempted:
        engine.step()
        preempted = engine.preempted()
    assert preempted == ["r"]
    assert engine.abort("r") and engine.blocks.num_free == engine.blocks.num_blocks


def test_abort_and_a_failure_end_every_choice(path, engine_factory):
    fault = 77
    engine = engine_factory(path, fault_token_id=fault)
    engine.add(AddRequest("a", token_ids=prompt(30, 8), params=seeded(n=3, max_tokens=30)))
    engine.add(
        AddRequest("f", token_ids=[fault, *prompt(30, 9)], params=seeded(n=3, max_tokens=30))
    )
    engine.add(AddRequest("b", token_ids=prompt(20, 10), params=greedy(8)))
    outs = engine.step() + engine.step()
    assert engine.abort("a") is True
    outs = [o for o in outs if o.request_id != "a"]
    while engine.has_unfinished():
        outs += engine.step()
    failed = [o for o in outs if o.request_id == "f"]
    assert len(failed) == 1 and failed[0].finish_reason == "error" and failed[0].error
    assert all(o.request_id == "b" for o in outs if o is not failed[0])
    assert sum(len(o.new_token_ids) for o in outs) == 8
    assert not engine.seqs and engine.blocks.num_free == engine.blocks.num_blocks


def run(engine, rid: str, p: list[int], sp: SamplingParams, output_ids=None):
    """Per choice: the text add returned then every delta, the new tokens, the outputs."""
    texts = engine.add(AddRequest(rid, token_ids=p, params=sp, output_ids=output_ids))
    toks: list[list[int]] = [[] for _ in texts]
    outs: list[list] = [[] for _ in texts]
    while engine.has_unfinished():
        for o in engine.step():
            texts[o.index] += o.text_delta
            toks[o.index] += o.new_token_ids
            outs[o.index].append(o)
    return texts, toks, outs


RESUMED = {
    "seeded": seeded(seed=5, n=2, max_tokens=20),
    "greedy, logprobs": SamplingParams(max_tokens=20, ignore_eos=True, n=2, logprobs=2),
}


@pytest.mark.parametrize("params", list(RESUMED.values()), ids=list(RESUMED))
def test_a_resume_keeps_every_choice(path, engine_factory, params):
    p = prompt(26, 11)
    full_text, full, _ = run(engine_factory(path), "full", p, params)
    for cut in ([3, 12], [0, 19], [20, 7], [15, 20]):
        engine = engine_factory(path)
        given = [full[i][:k] for i, k in enumerate(cut)]
        texts, toks, outs = run(engine, "cut", p, params, given)
        assert texts == full_text, cut
        assert toks == [full[i][k:] for i, k in enumerate(cut)], cut
        for i, k in enumerate(cut):
            last = outs[i][-1]
            assert last.finished and last.finish_reason == "length"
            assert last.num_output_tokens == 20
            if k == 20:  # ended before the cut: reported ended, nothing new
                assert len(outs[i]) == 1 and not last.new_token_ids
        assert not engine.seqs and engine.blocks.num_free == engine.blocks.num_blocks


def test_a_resume_refuses_what_cannot_go_on(path, engine_factory):
    engine = engine_factory(path)
    p = prompt(10, 12)
    sp = greedy(4)
    two = SamplingParams(max_tokens=4, ignore_eos=True, n=2)
    for params, given in (
        (two, [[20]]),  # one list for two choices
        (two, [[20, 21, 22, 23], [20, 21, 22, 23]]),  # both ended: nothing to resume
        (two, [[20], [20, 21, 22, 23, 24]]),  # more than max_tokens
        (sp, [[20, 21, 22, 23]]),
    ):
        with pytest.raises(RequestError) as e:
            engine.add(AddRequest("r", token_ids=p, params=params, output_ids=given))
        assert e.value.code == ErrorCode.BAD_PROGRESS, given
        assert not engine.seqs and not engine.has_unfinished()
