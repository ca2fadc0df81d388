"""Sampling: seeds, filters, penalties, stops and logprobs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from plurai.gpu_workers.backend import AddRequest
from plurai.gpu_workers.engine.sampler import Sampler
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.gpu_workers.engine.sequence import Sequence
from tests.helpers import prompt


@pytest.fixture(scope="module")
def path(model_factory):
    return model_factory("llama")


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (p, sp) in requests.items():
        engine.add(AddRequest(rid, token_ids=p, params=sp))
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(path, engine_factory):
    sp = SamplingParams(
        max_tokens=30, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True
    )
    alone = run(engine_factory(path), {"me": (prompt(20, 0), sp)})["me"]
    busy: dict[str, tuple[list[int], SamplingParams]] = {
        f"other{i}": (
            prompt(5 + 13 * i, 100 + i),
            SamplingParams(
                max_tokens=10 + 7 * i,
                temperature=[0.0, 1.0, 0.7][i % 3],
                seed=None if i % 2 else i,
                ignore_eos=True,
            ),
        )
        for i in range(8)
    }
    busy["me"] = (prompt(20, 0), sp)
    together = run(engine_factory(path, max_num_batched_tokens=32), busy)["me"]
    assert together == alone
    other_seed = run(
        engine_factory(path),
        {
            "me": (
                prompt(20, 0),
                SamplingParams(
                    max_tokens=30, temperature=0.9, top_p=0.95, top_k=50, seed=99, ignore_eos=True
                ),
            )
        },
    )["me"]
    assert other_seed != alone


def test_filters_that_leave_one_token_equal_greedy(path, engine_factory):
    p = prompt(25, 1)
    greedy = run(engine_factory(path), {"g": (p, SamplingParams(max_tokens=20, ignore_eos=True))})[
        "g"
    ]
    for sp in (
        SamplingParams(max_tokens=20, temperature=1.5, top_k=1, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.5, top_p=1e-6, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.5, min_p=1.0, ignore_eos=True),
    ):
        assert run(engine_factory(path), {"s": (p, sp)})["s"] == greedy


def test_unseeded_sampling_varies(path, engine_factory):
    p = prompt(10, 2)
    engine = engine_factory(path)
    sp = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    outs = run(engine, {f"r{i}": (p, sp) for i in range(4)})
    assert len({tuple(v) for v in outs.values()}) > 1


def test_repetition_penalty_matches_transformers(path, engine_factory):
    from transformers import AutoModelForCausalLM

    p = prompt(12, 3)
    got = run(
        engine_factory(path),
        {"r": (p, SamplingParams(max_tokens=20, repetition_penalty=1.8, ignore_eos=True))},
    )["r"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([p])
    ref = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=20,
        do_sample=False,
        repetition_penalty=1.8,
        pad_token_id=0,
    )[0, len(p) :].tolist()
    assert got == ref


def test_presence_and_frequency_penalties_subtract_per_output_count():
    seq = Sequence("s", [1, 2, 3], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    for t in (7, 7, 7, 9):
        seq.append(t)
    logits = torch.zeros(1, 16)
    out = Sampler(0)._penalize(logits.clone(), [seq])
    assert out[0, 7].item() == pytest.approx(-(0.5 + 3 * 0.25))
    assert out[0, 9].item() == pytest.approx(-(0.5 + 0.25))
    assert out[0, 1].item() == 0.0  # prompt tokens are not penalized by these two


def test_stop_string_truncates_text(path, engine_factory):
    p = prompt(15, 4)
    engine = engine_factory(path)
    full = engine.generate([p], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop and len(full.text) > 10
    cut = engine.generate([p], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    # streamed deltas never show the stop string or anything after it
    engine.add(
        AddRequest(
            "s", token_ids=p, params=SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop])
        )
    )
    streamed = ""
    while engine.has_unfinished():
        streamed += "".join(o.text_delta for o in engine.step())
    assert streamed == cut.text


def test_stop_token_ids_and_max_tokens(path, engine_factory):
    p = prompt(15, 5)
    engine = engine_factory(path)
    full = engine.generate([p], SamplingParams(max_tokens=25, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 25
    stop_id = full.token_ids[6]
    got = engine.generate(
        [p], SamplingParams(max_tokens=25, ignore_eos=True, stop_token_ids=[stop_id])
    )[0]
    assert got.finish_reason == "stop"
    assert got.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]


def test_logprobs_are_those_of_the_model(path, engine_factory):
    from transformers import AutoModelForCausalLM

    p = prompt(10, 6)
    got = engine_factory(path).generate(
        [p], SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True)
    )[0]
    assert got.logprobs is not None and len(got.logprobs) == 5
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = torch.tensor([p + got.token_ids])
    with torch.inference_mode():
        lp = hf(ids).logits[0].log_softmax(-1)
    for i, entry in enumerate(got.logprobs):
        row = lp[len(p) - 1 + i]
        assert entry["token_id"] == got.token_ids[i]
        assert entry["logprob"] == pytest.approx(row[got.token_ids[i]].item(), abs=1e-4)
        assert [t for t, _ in entry["top"]] == row.topk(3).indices.tolist()
        assert entry["top"][0][0] == got.token_ids[i]  # greedy takes the top token


def test_nucleus_keeps_the_same_tokens_as_a_full_sort():
    from plurai.gpu_workers.engine.sampler import _nucleus

    torch.manual_seed(0)
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99, 0.999])
    # a small vocabulary (one sort), peaked rows whose nucleus lies among the first
    # candidates, and flat ones where some row's nucleus is wider than them
    for vocab, spread in ((500, 2.0), (6000, 6.0), (6000, 0.5), (32000, 3.0), (32000, 0.05)):
        probs = torch.randn(8, vocab).mul(spread).softmax(-1)
        sp, order = probs.sort(-1, descending=True)
        # in float64, as _nucleus counts: a float32 running sum rounds differently with
        # each vector width, and flips a token that lies at the cutoff
        sp64 = sp.double()
        keep = (sp64.cumsum(-1) - sp64) < top_p.double()[:, None]
        expected = torch.zeros_like(probs).scatter_(1, order, keep.float()).bool()
        assert torch.equal(_nucleus(probs, top_p) > 0, expected)
    # a top_p that rounds to 0 in float32 still keeps the most probable token
    probs = torch.tensor([[0.1, 0.7, 0.2]])
    assert torch.equal(_nucleus(probs, torch.tensor([1e-46])) > 0, torch.tensor([[0, 1, 0]]) > 0)


def top_p_cases(
    seed: int, n: int, top_max: float
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Random batches for top-p: (trial, probabilities, top_p) with 1-11 rows over
    vocabularies up to 40k, flat to peaked, many exact ties every 7th, top_p 0 every 11th."""
    gen = torch.Generator().manual_seed(seed)
    for trial in range(n):
        rows = int(torch.randint(1, 12, (1,), generator=gen))
        vocab = int(torch.randint(2, 40000, (1,), generator=gen))
        spread = float(torch.rand(1, generator=gen)) * 12
        probs = (torch.randn(rows, vocab, generator=gen) * spread).softmax(-1)
        if trial % 7 == 0:  # many exact ties
            probs = torch.round(probs * 1000) / 1000
            probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-9)
        top_p = torch.rand(rows, generator=gen).clamp(min=1e-3, max=top_max)
        if trial % 11 == 0:
            top_p[:] = 0.0
        yield trial, probs, top_p


def test_nucleus_matches_a_full_sort_on_random_rows():
    """Vocabularies up to 40k, flat to peaked rows, ties, top_p of 0: the kept tokens are
    exactly those of a sort of the whole row (float64 sums)."""
    from plurai.gpu_workers.engine.sampler import _nucleus

    for trial, probs, top_p in top_p_cases(seed=1, n=120, top_max=0.999):
        sp, _ = probs.sort(-1, descending=True)
        above = sp.double().cumsum(-1) - sp.double()
        keep = above < top_p.double()[:, None]
        keep[:, 0] = True  # the most probable token at least
        cut = torch.where(keep, sp, torch.full_like(sp, float("inf"))).min(-1).values
        expected = (probs >= cut[:, None]) & (probs > 0)
        assert torch.equal(_nucleus(probs, top_p) > 0, expected), trial


@pytest.mark.parametrize("temperature", [1e-40, 1e-50, 5e-324])
def test_a_tiny_temperature_samples_the_argmax(temperature):
    # divided by a temperature this small (or one that is 0 in float32) the logits overflow:
    # the draw must still be the limit, the best token, never a NaN pick
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, generator=gen) * 5
    seqs = [
        Sequence(
            f"s{i}",
            [1, 2],
            SamplingParams(temperature=temperature, top_k=[0, 10, 0, 64][i], seed=i),
        )
        for i in range(4)
    ]
    seqs[2].params.top_p = 0.5
    tokens, _ = Sampler(0)(logits.clone(), seqs)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_a_tiny_repetition_penalty_draws_a_seen_token():
    # a penalty this small sends the seen tokens' positive logits to inf: the draw must be
    # one of them, not a NaN pick
    logits = torch.full((1, 64), -1.0)
    logits[0, [3, 5]] = torch.tensor([2.0, 1.0])
    seq = Sequence(
        "s", [3, 5, 7], SamplingParams(temperature=1.0, repetition_penalty=1e-50, seed=1)
    )
    tokens, _ = Sampler(0)(logits, [seq])
    assert tokens[0] in (3, 5)


def test_a_seeded_draw_depends_on_seed_and_position_only():
    from plurai.gpu_workers.engine.sampler import seeded_uniform

    draws = [seeded_uniform(7, i) for i in range(4000)]
    assert draws == [seeded_uniform(7, i) for i in range(4000)]
    assert all(0.0 <= u < 1.0 and u * 2**24 == int(u * 2**24) for u in draws)  # exact in float32
    assert abs(sum(draws) / len(draws) - 0.5) < 0.02
    assert len(set(draws)) > 3990
    assert [seeded_uniform(8, i) for i in range(50)] != draws[:50]
    assert seeded_uniform(2**63 - 1, 10**6) < 1.0
