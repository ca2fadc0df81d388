"""Resuming a cut-off request from its output tokens (`Engine.add(output_ids=...)`): after
the cut, tokens, text, logprobs, counts and finish reason are the uninterrupted run's, on
the engine that ran it (its prefix cache warm) and on a fresh one. Progress the engine
cannot continue is refused with bad_progress and changes nothing."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from plurai.gpu_workers.backend import AddRequest
from plurai.gpu_workers.engine.errors import ErrorCode, RequestError
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from tests.helpers import greedy, prompt


@pytest.fixture(scope="module")
def path(model_factory):
    return model_factory("llama")


@dataclass
class Run:
    text: str  # what add returned, then every text delta
    tokens: list[int] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)
    counts: list[tuple[int, int]] = field(default_factory=list)  # (prompt, output) per output
    logprobs: list[dict] = field(default_factory=list)
    reason: str | None = None


def run(engine, rid: str, p: list[int], sp: SamplingParams, output_ids=None) -> Run:
    given = None if output_ids is None else [output_ids]  # the one choice's
    r = Run(engine.add(AddRequest(rid, token_ids=p, params=sp, output_ids=given))[0])
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == rid and len(o.new_token_ids) == 1
            r.tokens += o.new_token_ids
            r.deltas.append(o.text_delta)
            r.text += o.text_delta
            r.counts.append((o.num_prompt_tokens, o.num_output_tokens))
            r.logprobs += o.logprobs or []
            r.reason = o.finish_reason
    return r


def cuts(n: int, seed: int) -> list[int]:
    """1, n - 1 and two cuts between (n: the uninterrupted run's output tokens)."""
    rng = random.Random(seed)
    return sorted({1, n - 1, rng.randrange(1, n), rng.randrange(1, n)})


def check_resume(engine_factory, path, p: list[int], sp: SamplingParams, ks=None) -> Run:
    engine = engine_factory(path)
    full = run(engine, "full", p, sp)
    assert full.reason is not None and len(full.tokens) >= 2
    assert full.text == "".join(full.deltas)
    for k in ks or cuts(len(full.tokens), sum(full.tokens)):
        for where, e in (("same", engine), ("fresh", engine_factory(path))):
            got = run(e, f"cut-{k}-{where}", p, sp, full.tokens[:k])
            assert got.tokens == full.tokens[k:], (k, where)
            assert got.text == full.text, (k, where)
            assert got.deltas == full.deltas[k:], (k, where)
            assert got.counts == full.counts[k:], (k, where)
            assert got.reason == full.reason, (k, where)
            assert len(got.logprobs) == len(full.logprobs[k:])
            for a, b in zip(got.logprobs, full.logprobs[k:], strict=True):
                assert a["token_id"] == b["token_id"]
                assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
                assert [t for t, _ in a.get("top", [])] == [t for t, _ in b.get("top", [])]
                for (_, x), (_, y) in zip(a.get("top", []), b.get("top", []), strict=True):
                    assert x == pytest.approx(y, abs=1e-4)
    return full


CASES = {
    "greedy": SamplingParams(max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True),
    "penalties": SamplingParams(
        max_tokens=24,
        temperature=0.8,
        seed=3,
        presence_penalty=0.6,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        ignore_eos=True,
    ),
    "logprobs": SamplingParams(max_tokens=16, temperature=0.9, seed=5, logprobs=3, ignore_eos=True),
    "json_schema": SamplingParams(
        max_tokens=40,
        temperature=0.7,
        seed=2,
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "pair",
                "schema": {
                    "type": "object",
                    "properties": {
                        "n": {"type": "integer", "minimum": 0, "maximum": 999},
                        "tag": {"enum": ["red", "green", "blue"]},
                    },
                    "required": ["n", "tag"],
                    "additionalProperties": False,
                },
            },
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_request_continues_as_the_uninterrupted_run(case, path, engine_factory):
    full = check_resume(engine_factory, path, prompt(20, 1), CASES[case])
    if case == "json_schema":
        assert full.reason == "stop" and full.text.startswith('{"n":')
    if case == "logprobs":
        assert all(len(lp["top"]) == 3 for lp in full.logprobs)


def test_seeded_draws_differ_by_seed_also_after_a_cut(path, engine_factory):
    engine = engine_factory(path)
    p = prompt(20, 1)
    a = run(engine, "a", p, CASES["seeded"])
    other = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True)
    b = run(engine, "b", p, other, a.tokens[:12])
    assert b.tokens != a.tokens[12:]


def test_a_stop_string_across_the_cut(path, engine_factory):
    p = prompt(16, 2)
    plain = run(engine_factory(path), "plain", p, greedy(40))
    ends = [len("".join(plain.deltas[: i + 1])) for i in range(len(plain.deltas))]
    text, tried = plain.text, 0
    for k in (4, 12, 25):
        cut = ends[k - 1]  # the output text after k tokens (no stop string: nothing held)
        # a stop string from just before the cut to just after, whose first match ends past
        # the cut: the uninterrupted run stops after it, the resumed one must match it too
        stops = [
            text[a:b]
            for a in range(max(0, cut - 3), cut)
            for b in range(cut + 1, min(len(text), cut + 4) + 1)
            if text.find(text[a:b]) + b - a > cut
        ]
        if not stops:
            continue
        tried += 1
        stop = stops[0]
        sp = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop])
        full = check_resume(engine_factory, path, p, sp, ks=[k])
        assert full.reason == "stop" and full.text == text[: text.find(stop)]
        assert full.tokens == plain.tokens[: len(full.tokens)] and len(full.tokens) > k
    assert tried >= 2


@pytest.fixture(scope="module")
def short_engine(path):
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig

    return Engine(
        EngineConfig(model=str(path), dtype="fp32", kv_cache_bytes=4 << 20, max_model_len=64)
    )


def test_bad_progress_is_refused_and_changes_nothing(short_engine):
    engine = short_engine
    eos = min(engine.eos_ids)
    p = prompt(20, 3)
    sp = greedy(30)
    schema = CASES["json_schema"]
    matcher = engine.grammars.matcher(schema)
    allowed = engine.grammars.allowed([matcher])[0]
    refused = next(t for t in range(16, engine.vocab_size) if not allowed[t])
    bad = {
        "not a list": (sp, (1, 2)),
        "not ints": (sp, [1, True]),
        "out of vocab": (sp, [20, engine.vocab_size]),
        "negative": (sp, [20, -1]),
        "too many": (greedy(3), [20, 21, 22, 23]),
        "max_tokens reached": (greedy(3), [20, 21, 22]),
        "past max_model_len": (greedy(60), [20] * 44),
        "eos": (SamplingParams(max_tokens=30), [20, eos, 21]),
        "stop token id": (SamplingParams(max_tokens=30, stop_token_ids=[21]), [20, 21]),
        "grammar": (schema, [refused]),
    }
    before = engine.stats()
    for name, (params, ids) in bad.items():
        with pytest.raises(RequestError) as e:
            engine.add(AddRequest(name, token_ids=p, params=params, output_ids=[ids]))
        assert e.value.code == ErrorCode.BAD_PROGRESS == "bad_progress", name
        assert not engine.seqs and not engine.has_unfinished(), name
    assert engine.stats() == before
    # EOS is an ordinary token with ignore_eos; the engine still runs requests
    ok = SamplingParams(max_tokens=8, ignore_eos=True)
    assert (
        engine.add(AddRequest("eos-ok", token_ids=p, params=ok, output_ids=[[eos, 20]])) is not None
    )
    engine.add(AddRequest("fresh", token_ids=p, params=greedy(8)))
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs["eos-ok"].num_output_tokens == 8 and outs["fresh"].num_output_tokens == 8
    assert outs["eos-ok"].finish_reason == outs["fresh"].finish_reason == "length"


def test_without_output_ids_add_returns_nothing(short_engine):
    assert short_engine.add(AddRequest("none", token_ids=prompt(5, 4), params=greedy(2))) == [""]
    empty = short_engine.add(
        AddRequest("empty", token_ids=prompt(5, 4), params=greedy(2), output_ids=[[]])
    )
    assert empty == [""]
    while short_engine.has_unfinished():
        short_engine.step()
