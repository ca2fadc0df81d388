"""Stop strings and stop token ids: the stop matcher costs O(1) per token and finds what a
search of the whole text would, also with a thousand long stop strings."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from plurai.gpu_workers.backend import AddRequest
from plurai.gpu_workers.engine.detokenizer import Detokenizer, StopMatcher
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from tests.helpers import drain, greedy, prompt, tokens


def old_cut(text: str, before: int, stops: list[str]) -> int:
    """The engine's former stop check: every stop string searched over a window."""
    longest = max(len(s) for s in stops)
    hits = [i for i in (text.find(s, max(0, before - longest + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else -1


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=6), min_size=1, max_size=8),
    chunks=st.lists(st.text(alphabet="abcd", max_size=5), max_size=12),
)
def test_stop_matcher_matches_brute_force(stops, chunks):
    m = StopMatcher(stops)
    assert m.longest == max(map(len, stops))
    text = ""
    for chunk in chunks:
        before = len(text)
        text += chunk
        got = m.feed(chunk, before)
        assert got == old_cut(text, before, stops), (text, before)
        if got >= 0:
            break


def replay_stops(engine, prompt_ids: list[int], output: list[int], stops: list[str]):
    """Brute force over the text as it grew token by token: (tokens kept, text)."""
    detok = Detokenizer(engine.tokenizer, prompt_ids)
    for n, t in enumerate(output, start=1):
        before = len(detok.text)
        detok.add(t)
        cut = old_cut(detok.text, before, stops)
        if cut >= 0:
            return n, detok.text[:cut]
    return len(output), detok.text


def test_a_thousand_long_stop_strings(tiny_model, engine_factory):
    engine = engine_factory(tiny_model)
    p = prompt(12, 5)
    full = engine.generate([p], greedy(60))[0]
    text = full.text
    assert len(text) > 60
    rng = random.Random(0)
    alphabet = sorted(set(text))
    # long strings that share prefixes with the output, so the automaton follows them a while
    stops = []
    for _ in range(999):
        k = rng.randrange(len(text) - 30)
        n = rng.randrange(1, 30)
        stops.append(text[k : k + n] + "".join(rng.choices(alphabet, k=rng.randrange(60, 200))))
    mid = len(text) // 2
    stops.append(text[mid : mid + 40])  # completes about half way
    sp = SamplingParams(max_tokens=60, ignore_eos=True, stop=stops)
    engine.add(AddRequest("s", token_ids=p, params=sp))
    outs = drain(engine)["s"]
    n, expected = replay_stops(engine, p, full.token_ids, stops)
    assert outs[-1].finish_reason == "stop"
    assert tokens(outs) == full.token_ids[:n]
    streamed = "".join(o.text_delta for o in outs)
    assert streamed == expected == text[: text.index(stops[-1])]
    got = engine.generate([p], sp)[0]
    assert got.text == expected
    # shorter stops, several completing in one token's text: still the old answer
    for seed in range(5):
        r = random.Random(seed)
        k = r.randrange(len(text) - 8)
        few = [text[k + r.randrange(4) : k + 4 + r.randrange(4)] for _ in range(6)] + ["zzz"]
        got = engine.generate([p], SamplingParams(max_tokens=60, ignore_eos=True, stop=few))[0]
        n, expected = replay_stops(engine, p, full.token_ids, few)
        assert (got.token_ids, got.text) == (full.token_ids[:n], expected)


def test_stop_token_ids_are_a_set(tiny_model, engine_factory):
    engine = engine_factory(tiny_model)
    p = prompt(10, 6)
    full = engine.generate([p], greedy(20))[0]
    stop_ids = list(range(3000, 3000 + 5000)) + [full.token_ids[7]]
    engine.add(
        AddRequest(
            "s",
            token_ids=p,
            params=SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=stop_ids),
        ),
    )
    seq = engine.seqs["s"]
    assert isinstance(seq.stop_ids, frozenset) and len(seq.stop_ids) == 5001
    outs = drain(engine)["s"]
    assert tokens(outs) == full.token_ids[: full.token_ids.index(full.token_ids[7]) + 1]
