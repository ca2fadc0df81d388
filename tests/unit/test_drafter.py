"""Draft-model proposals (gpu_workers/engine/drafter.py): outputs equal decoding without
speculation, token for token, whatever the draft proposes. The model drafting for itself
proposes what it will draw (most proposals kept); a model of another family with the same
tokenizer proposes other tokens (most refused)."""

from __future__ import annotations

import pytest

from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.gpu_workers.engine.speculator import Speculator
from tests.unit.test_speculative import looping
from tests.unit.test_structured import SCHEMAS, rf, unbounded


@pytest.fixture(autouse=True)
def always_propose(monkeypatch):
    # whether proposing pays is measured (Speculator._choose); on a random model with
    # random timings it may not, and these tests are about what proposals do
    monkeypatch.setattr(Speculator, "_choose", lambda self, size: self.block.clear())


def draft_engine(engine_factory, path, draft, **kw):
    return engine_factory(path, speculative=f"draft:{draft}", num_speculative_tokens=4, **kw)


def assert_released(engine) -> None:
    drafter = engine.speculator.drafter
    assert not drafter.shadows
    assert drafter.blocks.num_free == drafter.blocks.num_blocks
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_greedy_equals_transformers(kernels, model_factory, engine_factory, reference):
    path = model_factory("llama")
    ps = looping(2048, [9, 24, 40, 70], seed=1)
    want = reference(path, ps, 40)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for draft, kept in ((path, True), (model_factory("qwen2"), False)):
        engine = draft_engine(engine_factory, path, draft, kernels=kernels)
        got = [c.token_ids for c in engine.generate(ps, params)]
        assert got == want, draft
        s = engine.stats()
        assert s["spec_proposed_tokens"] > 0
        if kept:  # drafting for itself: its proposals are its own next tokens
            assert s["spec_accepted_tokens"] > 0.8 * s["spec_proposed_tokens"]
        else:
            assert s["spec_accepted_tokens"] < s["spec_proposed_tokens"]
        assert_released(engine)


def test_preemption_and_prefix_hits_hold(model_factory, engine_factory, reference):
    path = model_factory("llama")
    # 14 blocks of 16 for four sequences that grow to ~90 tokens: preemptions; the draft's
    # cache has as many (smaller) blocks
    engine = draft_engine(engine_factory, path, path, num_kv_blocks=14, max_num_batched_tokens=64)
    ps = looping(engine.vocab_size, [40, 35, 50, 28], seed=2)
    want = reference(path, ps, 48)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    got = [c.token_ids for c in engine.generate(ps, params)]
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats()["spec_accepted_tokens"] > 0
    assert got == want
    again = engine.generate(ps[:1], params)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == got[0]
    assert_released(engine)


def test_sampled_stops_logprobs_schema_as_without(model_factory, engine_factory):
    path = model_factory("qwen2")
    off = engine_factory(path)
    on = draft_engine(engine_factory, path, path)
    ps = looping(off.vocab_size, [12, 30, 47], seed=3)
    free = off.generate(ps, SamplingParams(max_tokens=30, ignore_eos=True))
    text = free[1].text
    cases = [
        SamplingParams(max_tokens=30, temperature=0.8, top_k=50, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=30, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=30, ignore_eos=True, stop=[text[len(text) // 2 :][:3]]),
        SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=90, response_format=rf(unbounded(SCHEMAS["nested"]))),
    ]
    for params in cases:
        a = off.generate(ps, params)
        before = on.stats()["spec_proposed_tokens"]
        b = on.generate(ps, params)
        assert on.stats()["spec_proposed_tokens"] > before, params
        for x, y in zip(a, b, strict=True):
            assert (y.token_ids, y.text, y.finish_reason) == (x.token_ids, x.text, x.finish_reason)
            if params.logprobs is not None:
                assert y.logprobs is not None
                for p, q in zip(x.logprobs, y.logprobs, strict=True):
                    assert q["token_id"] == p["token_id"]
                    assert q["logprob"] == pytest.approx(p["logprob"], abs=1e-4)
    assert on.stats()["spec_accepted_tokens"] > 0
    assert_released(on)


def test_a_draft_with_another_tokenizer_is_refused(model_factory, engine_factory):
    path = model_factory("llama")
    other = model_factory("llama", seed=1)  # the factory's tokenizer is trained per seed
    with pytest.raises(ValueError, match="its tokenizer is not the model's"):
        draft_engine(engine_factory, path, other)
    with pytest.raises(ValueError, match="no tokenizer there"):
        draft_engine(engine_factory, path, path.parent / "missing")
