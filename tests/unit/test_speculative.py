"""Speculative decoding: outputs equal decoding without it, token for token. The random
models copy nothing, so most tests propose from known outputs with some tokens changed
(tests/helpers.oracle): proposals are accepted and refused at known places; prompt lookup
itself is tested on its own and in bench/speculative.py on a trained model."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.gpu_workers.engine.sequence import Sequence
from plurai.gpu_workers.engine.speculator import SpecState, Speculator, row_cost
from tests.conftest import FAMILIES
from tests.helpers import oracle
from tests.unit.test_structured import SCHEMAS, rf, unbounded

SPEC = dict(speculative="ngram", ngram_min=1, ngram_max=3, num_speculative_tokens=4)


def looping(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a segment: their continuations are proposed from themselves."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        seg = [rng.randrange(16, vocab) for _ in range(max(2, n // 4))]
        out.append((seg * 4)[:n])
    return out


def run(engine, prompts, params):
    return engine.generate(prompts, params)


def test_lookup_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    spec = Speculator(EngineConfig(model="x", ngram_min=2, ngram_max=3), max_model_len=1000)

    def brute(ids: list[int], k: int) -> list[int]:
        for size in range(min(3, len(ids)), 1, -1):
            suffix = ids[len(ids) - size :]
            for end in range(len(ids) - 2, size - 2, -1):
                if ids[end - size + 1 : end + 1] == suffix:
                    return ids[end + 1 : end + 1 + k]
        return []

    assert spec.lookup(SpecState(), [1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    assert spec.lookup(SpecState(), [1, 2, 3, 4], 3) == []
    rng = random.Random(0)
    for _ in range(50):  # the incremental index against a scan, as a sequence grows
        st, ids = SpecState(), [rng.randrange(4) for _ in range(3)]
        for _ in range(40):
            assert spec.lookup(st, ids, 4) == brute(ids, 4), ids
            ids.append(rng.randrange(4))


def test_row_cost_is_the_slope_over_the_time_per_token() -> None:
    # 2 ms a step plus 0.5 ms a row; each step makes as many tokens as it has rows
    steps = [(r, 0.002 + 0.0005 * r, r) for r in (4, 8, 16, 8, 4, 32)]
    per_token = sum(s[1] for s in steps) / sum(s[2] for s in steps)
    assert row_cost(steps) == pytest.approx(0.0005 / per_token)
    # a few slow steps (a collection, a kernel built for a new row count) tilt no line
    noisy = (
        steps + [(4, 0.05, 4), (5, 0.04, 5)] + [(r, 0.002 + 0.0005 * r, r) for r in range(6, 20)]
    )
    per_token = sum(s[1] for s in noisy) / sum(s[2] for s in noisy)
    assert row_cost(noisy) == pytest.approx(0.0005 / per_token)
    assert row_cost([(8, 0.01, 8)] * 5) is None  # rows never varied: nothing to tell
    assert row_cost([(4, 0.02, 4), (8, 0.01, 8)]) == 0.0  # time fell as rows grew


def test_the_row_cost_is_refitted_every_few_steps(monkeypatch) -> None:
    """A fit compares every two steps of the window: done at every step, it cost a small
    model's decode step a third of its time (once the window was full)."""
    from plurai.gpu_workers.engine import speculator

    fits = []
    monkeypatch.setattr(speculator, "row_cost", lambda steps: fits.append(len(steps)) or 0.5)
    spec = Speculator(EngineConfig(model="x"), max_model_len=1000)
    for i in range(10 * speculator.WINDOW):
        spec.observe(1 + i % 3, 0.001, 1, 1)
    assert len(fits) == 10 * speculator.WINDOW // speculator.REFIT
    assert max(fits) == speculator.WINDOW and spec.need == 0.5


def test_proposals_only_while_they_pay(monkeypatch) -> None:
    """A sequence proposes its j-th token while acceptance^j reaches the needed share;
    one that cannot pays a pause (doubling), then tries one token."""
    spec = Speculator(EngineConfig(model="x", num_speculative_tokens=4), max_model_len=1000)
    monkeypatch.setattr(Speculator, "lookup", lambda self, st, ids, k: [7] * k)
    seq = Sequence("r", list(range(20)), SamplingParams(max_tokens=100))

    def drafted(acceptance: float, need: float) -> int:
        seq.drop_draft()
        seq.spec = SpecState(acceptance=acceptance)
        spec.need = need
        spec.draft(seq, room=100)
        return seq.num_draft

    assert drafted(0.9, 0.0) == 4  # a step whose time does not grow with rows
    assert drafted(0.9, 0.75) == 2  # 0.9^2 = 0.81 pays, 0.9^3 = 0.73 does not
    assert drafted(0.5, 0.6) == 0 and seq.spec.pause == 8
    st = seq.spec
    for _ in range(7):
        spec.draft(seq, room=100)
        assert seq.num_draft == 0
    spec.draft(seq, room=100)  # the pause is over: one token to try
    assert seq.num_draft == 1
    spec.verify(seq, [3, 3])  # refused: the next pause is twice as long
    assert st.acceptance < 0.5
    seq.drop_draft()
    spec.draft(seq, room=100)
    assert seq.num_draft == 0 and st.pause == 16


def test_proposing_at_all_is_measured_per_batch_size() -> None:
    """Blocks of steps run with proposals on or off, each batch size in its cheaper mode
    (seconds per token made), the other tried at once, then after gaps that double while
    it keeps losing."""
    spec = Speculator(EngineConfig(model="x"), max_model_len=1000)
    # one sequence: 2 ms a token with proposals, 3 ms without; 32: the other way round
    cost = {(1, True): 0.002, (1, False): 0.003, (32, True): 0.003, (32, False): 0.002}

    def run(seqs: int, steps: int) -> float:
        on = 0
        for _ in range(steps):
            on += spec.on
            spec.observe(seqs, cost[seqs, spec.on] * seqs, seqs, seqs)
        return on / steps

    assert run(1, 16) == 0.5  # a block of each
    assert run(1, 800) > 0.93  # the other mode is tried now and then, ever less often
    assert run(32, 16) == 0.5  # another batch size, measured on its own
    assert run(32, 2000) < 0.05
    assert spec.modes[6].gap == 64 and spec.modes[1].best and not spec.modes[6].best
    # when the costs turn, the next try finds it, and the mode changes
    cost[32, True] = 0.001
    assert run(32, 1200) > 0.5


@pytest.mark.parametrize("kernels", ["torch", "auto"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers(
    family, kernels, model_factory, engine_factory, reference, monkeypatch
):
    path = model_factory(family)
    engine = engine_factory(path, kernels=kernels, **SPEC)
    ps = looping(engine.vocab_size, [9, 24, 40, 70], seed=1)
    want = reference(path, ps, 40)
    oracle(monkeypatch, want, engine.vocab_size)
    got = [c.token_ids for c in run(engine, ps, SamplingParams(max_tokens=40, ignore_eos=True))]
    stats = engine.stats()
    # both outcomes were exercised: proposals kept and proposals refused
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    assert got == want
    assert engine.blocks.num_free == engine.blocks.num_blocks  # rejected slots given back


def test_prefix_hits_and_preemption_hold(model_factory, engine_factory, reference, monkeypatch):
    path = model_factory("llama")
    # 14 blocks of 16 for four sequences that grow to ~90 tokens: preemptions, with
    # proposals the first thing dropped when blocks run short
    engine = engine_factory(path, num_kv_blocks=14, max_num_batched_tokens=64, **SPEC)
    ps = looping(engine.vocab_size, [40, 35, 50, 28], seed=2)
    want = reference(path, ps, 48)
    oracle(monkeypatch, want, engine.vocab_size)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    got = [c.token_ids for c in run(engine, ps, params)]
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats()["spec_accepted_tokens"] > 0
    assert got == want
    again = run(engine, ps[:1], params)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == got[0]


def test_sampled_stops_logprobs_as_without(model_factory, engine_factory, monkeypatch):
    """Seeded sampling, stop strings, stop tokens, logprobs and max_tokens: the same
    completions with and without speculation."""
    path = model_factory("qwen2")
    off = engine_factory(path)
    on = engine_factory(path, **SPEC)
    ps = looping(off.vocab_size, [12, 30, 47], seed=3)
    free = run(off, ps, SamplingParams(max_tokens=30, ignore_eos=True))
    text = free[1].text
    cases = [
        SamplingParams(max_tokens=30, temperature=0.8, top_k=50, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=30, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=30, ignore_eos=True, stop=[text[len(text) // 2 :][:3]]),
        SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[free[2].token_ids[9]]),
        SamplingParams(max_tokens=7, ignore_eos=True),
        # the rows of proposed positions: penalized with the proposals before them counted,
        # masked with the grammar's state after them; steered near max_tokens
        SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(
            max_tokens=30,
            temperature=0.9,
            seed=5,
            presence_penalty=0.6,
            frequency_penalty=0.4,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=40, regex="[a-z]+( [a-z]+)*"),
        SamplingParams(max_tokens=90, response_format=rf(unbounded(SCHEMAS["nested"]))),
        SamplingParams(
            max_tokens=90, temperature=1.0, seed=3, response_format=rf(unbounded(SCHEMAS["arrays"]))
        ),
    ]
    for params in cases:
        a = run(off, ps, params)
        oracle(monkeypatch, [c.token_ids for c in a], off.vocab_size)
        before = on.stats()["spec_accepted_tokens"]
        b = run(on, ps, params)
        assert on.stats()["spec_accepted_tokens"] > before, params
        for x, y in zip(a, b, strict=True):
            assert (y.token_ids, y.text, y.finish_reason) == (x.token_ids, x.text, x.finish_reason)
            if params.logprobs is not None:
                assert y.logprobs is not None and len(y.logprobs) == len(y.token_ids)
                for p, q in zip(x.logprobs, y.logprobs, strict=True):
                    assert q["token_id"] == p["token_id"]
                    assert q["logprob"] == pytest.approx(p["logprob"], abs=1e-4)
                    assert [t for t, _ in q["top"]] == [t for t, _ in p["top"]]
    assert on.stats()["spec_accepted_tokens"] > 0


def test_unseeded_sampling_keeps_its_distribution(model_factory, engine_factory, monkeypatch):
    """The token drawn after accepted proposals follows the model's distribution: over many
    unseeded runs, the counts at a late position agree with decoding without speculation
    (chi-square, on a small vocabulary: the rest pooled)."""
    path = model_factory("llama")
    off = engine_factory(path, seed=1)
    on = engine_factory(path, seed=2, **SPEC)
    prompt = looping(off.vocab_size, [24], seed=4)[0]
    params = SamplingParams(max_tokens=6, temperature=0.7, ignore_eos=True)
    likely = off.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    oracle(monkeypatch, [likely], off.vocab_size, wrong_every=100)  # the greedy ones
    n = 300
    a = Counter(c.token_ids[-1] for c in run(off, [prompt] * n, params))
    b = Counter(c.token_ids[-1] for c in run(on, [prompt] * n, params))
    assert on.stats()["spec_accepted_tokens"] > 0
    top = [t for t, _ in (a + b).most_common(5)]
    cells = [(a[t], b[t]) for t in top]
    cells.append((n - sum(x for x, _ in cells), n - sum(y for _, y in cells)))
    cells = [c for c in cells if sum(c) > 0]
    chi2 = sum((x - y) ** 2 / (x + y) for x, y in cells)  # two samples of equal size
    # 99.9% quantile of chi-square with len(cells) - 1 <= 5 degrees of freedom: 20.5
    assert chi2 < 20.5, (a, b)


def test_opt_out_decodes_as_usual(model_factory, engine_factory, monkeypatch):
    monkeypatch.setattr(Speculator, "_choose", lambda self, size: self.block.clear())
    path = model_factory("llama")
    engine = engine_factory(path, **SPEC)
    ps = looping(engine.vocab_size, [30], seed=5)
    run(engine, ps, SamplingParams(max_tokens=20, ignore_eos=True, speculate=False))
    assert engine.stats()["spec_proposed_tokens"] == 0
    run(engine, ps, SamplingParams(max_tokens=20, ignore_eos=True))
    assert engine.stats()["spec_proposed_tokens"] > 0


def test_engine_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="speculative must be"):
        EngineConfig(model="x", speculative="medusa")
    with pytest.raises(ValueError, match="ngram_min"):
        EngineConfig(model="x", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(model="x", num_speculative_tokens=0)


@pytest.mark.parametrize("bad", ["yes", 1, None, [True]])
def test_speculate_must_be_a_boolean(bad) -> None:
    from plurai.gpu_workers.engine.errors import ErrorCode, RequestError

    with pytest.raises(RequestError, match="speculate must be a boolean") as e:
        SamplingParams.from_dict({"max_tokens": 4, "speculate": bad})
    assert e.value.code == ErrorCode.INVALID_PARAMS
