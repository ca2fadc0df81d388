"""A request of n > 1 choices on the vLLM backend: vLLM's own `n`, each output naming its
choice, choice i the request seeded seed + i, the prompt counted once; a cut-off request of
n > 1 is refused (bad_progress) and starts over."""

from __future__ import annotations

import pytest

from plurai.gpu_workers.backend import AddRequest, RequestError, StepOutput
from plurai.gpu_workers.engine.errors import ErrorCode
from tests.helpers import prompt

pytest.importorskip("vllm", reason="runs in vLLM's environment: make test-vllm")


def choices(backend, rid: str, params: dict) -> list[list[StepOutput]]:
    """Each choice's outputs, in order."""
    texts = backend.add(AddRequest(rid, token_ids=prompt(24, 5), params=params))
    assert texts == [""] * params.get("n", 1)
    outs: list[list[StepOutput]] = [[] for _ in texts]
    while backend.has_unfinished():
        for o in backend.step():
            assert o.request_id == rid
            outs[o.index].append(o)
    return outs


def tokens(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_two_seeded_choices_are_the_requests_of_their_seeds(backend) -> None:
    params = {"max_tokens": 12, "temperature": 1.0, "seed": 21, "ignore_eos": True}
    two = choices(backend, "two", {**params, "n": 2})
    for outs in two:
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 12
        assert all(o.num_prompt_tokens == 24 for o in outs)
    assert tokens(two[0]) != tokens(two[1])
    for i in range(2):
        (alone,) = choices(backend, f"alone-{i}", {**params, "seed": 21 + i})
        assert tokens(alone) == tokens(two[i])
        assert "".join(o.text_delta for o in alone) == "".join(o.text_delta for o in two[i])


def test_greedy_choices_are_equal(backend) -> None:
    outs = choices(backend, "greedy", {"max_tokens": 10, "ignore_eos": True, "n": 2, "logprobs": 1})
    assert tokens(outs[0]) == tokens(outs[1]) and len(tokens(outs[0])) == 10
    assert all(len(o.logprobs or []) == len(o.new_token_ids) for c in outs for o in c)


def test_a_cut_off_request_of_two_choices_starts_over(backend) -> None:
    params = {"max_tokens": 8, "ignore_eos": True, "n": 2}
    with pytest.raises(RequestError) as e:
        backend.add(
            AddRequest("cut", token_ids=prompt(24, 5), params=params, output_ids=[[20, 21], []])
        )
    assert e.value.code == ErrorCode.BAD_PROGRESS and "n > 1" in e.value.message
    with pytest.raises(RequestError) as e:
        backend.add(AddRequest("short", token_ids=prompt(24, 5), params=params, output_ids=[[20]]))
    assert e.value.code == ErrorCode.BAD_PROGRESS
    assert not backend.has_unfinished()
    assert backend.add(
        AddRequest("fresh", token_ids=prompt(24, 5), params=params, output_ids=[[], []])
    ) == [
        "",
        "",
    ]
    assert backend.abort("fresh") and not backend.has_unfinished()


def test_an_abort_ends_every_choice(backend) -> None:
    backend.add(AddRequest("gone", token_ids=prompt(24, 6), params={"max_tokens": 60, "n": 3}))
    backend.step()
    assert backend.abort("gone")
    assert all(o.request_id != "gone" for o in backend.step())
    assert not backend.has_unfinished()
