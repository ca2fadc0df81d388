"""The fleet bench's simulated engine: slots, KV budget, one token a step, abort."""

from __future__ import annotations

import pytest

from bench.sim_backend import SimBackend, estimate_tokens
from plurai.gpu_workers.backend import AddRequest, RequestError


def backend(**kw: int) -> tuple[SimBackend, list[float]]:
    slept: list[float] = []
    b = SimBackend(
        max_num_seqs=kw.get("seqs", 2),
        kv_tokens=kw.get("kv", 64),
        max_model_len=32,
        step_base_ms=10.0,
        step_per_seq_ms=1.0,
        sleep=slept.append,
    )
    return b, slept


def test_runs_to_max_tokens_one_token_a_step() -> None:
    b, slept = backend()
    b.add(AddRequest("a", prompt="x" * 16, params={"max_tokens": 3}))
    b.add(AddRequest("b", token_ids=[1, 2], params={"max_tokens": 1}))
    outs = b.step()
    assert slept == [pytest.approx(0.012)]  # base + 2 sequences
    assert [(o.request_id, o.finished, o.num_prompt_tokens) for o in outs] == [
        ("a", False, 4),
        ("b", True, 2),
    ]
    assert outs[1].finish_reason == "length" and outs[0].text_delta.startswith(" ")
    assert [o.finished for o in b.step()] == [False]
    last = b.step()
    assert last[0].finished and last[0].num_output_tokens == 3
    assert not b.has_unfinished() and b.stats()["steps"] == 3


def test_slots_and_kv_limit_admission() -> None:
    b, _ = backend(seqs=2, kv=40)
    assert b.can_admit(4, 16)
    b.add(AddRequest("a", prompt="x" * 16, params={"max_tokens": 16}))  # reserves 20 of 40
    assert b.can_admit(4, 16) and not b.can_admit(4, 17)
    b.add(AddRequest("b", messages=[{"role": "user", "content": "hi"}], params={"max_tokens": 8}))
    assert not b.can_admit(1, 1)  # both slots taken
    assert b.abort("a") and not b.abort("a")
    assert b.num_waiting == 1 and b.can_admit(1, 1)


def test_refusals() -> None:
    b, _ = backend()
    with pytest.raises(RequestError) as e:
        b.add(AddRequest("a", token_ids=list(range(32))))
    assert e.value.code == "prompt_too_long"
    with pytest.raises(RequestError):
        b.add(AddRequest("a", prompt="hi", params={"max_tokens": 0}))
    b.add(AddRequest("a", prompt="hi"))
    with pytest.raises(RequestError):
        b.add(AddRequest("a", prompt="hi"))
    assert estimate_tokens(None, None, [{"content": "abcdefgh"}]) == 6
