"""Resuming a cut-off request on the vLLM backend (add's `output_ids`): greedy requests go
on with the uninterrupted run's tokens, text, logprobs and counts; what vLLM cannot
continue exactly, and bad progress, are refused with bad_progress as the native engine
refuses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from plurai.gpu_workers.backend import AddRequest, RequestError
from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.engine import Engine
from plurai.gpu_workers.engine.errors import ErrorCode
from tests.helpers import prompt
from tests.vllm.conftest import MAX_MODEL_LEN

pytest.importorskip("vllm", reason="runs in vLLM's environment: make test-vllm")


def run(backend, rid: str, params: dict, output_ids=None) -> dict:
    given = None if output_ids is None else [output_ids]  # the one choice's
    got = {
        "text": backend.add(
            AddRequest(rid, token_ids=prompt(20, 1), params=params, output_ids=given)
        )[0]
    }
    got.update(tokens=[], counts=[], logprobs=[], reason=None)
    while backend.has_unfinished():
        for o in backend.step():
            got["tokens"] += o.new_token_ids
            got["text"] += o.text_delta
            got["counts"].append((o.num_prompt_tokens, o.num_output_tokens))
            got["logprobs"] += o.logprobs or []
            got["reason"] = o.finish_reason
    return got


def check_resume(backend, params: dict) -> dict:
    full = run(backend, "full", params)
    n = len(full["tokens"])
    assert full["reason"] is not None and n >= 2 and full["text"]
    for k in sorted({1, n // 2, n - 1}):
        got = run(backend, f"cut-{k}", params, full["tokens"][:k])
        assert got["tokens"] == full["tokens"][k:], k
        assert got["text"] == full["text"], k
        assert got["reason"] == full["reason"], k
        assert got["counts"] == full["counts"][k:], k
        for a, b in zip(got["logprobs"], full["logprobs"][k:], strict=True):
            assert a["token_id"] == b["token_id"] and a["token"] == b["token"]
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
            assert [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
    return full


@pytest.mark.parametrize(
    "params",
    [
        {"max_tokens": 24, "ignore_eos": True, "logprobs": 2},
        {"max_tokens": 16, "temperature": 0.8, "top_k": 1, "repetition_penalty": 1.3},
    ],
)
def test_a_greedy_request_resumes_as_it_would_have_gone_on(backend, params: dict) -> None:
    check_resume(backend, params)


def test_a_stop_token_after_the_cut(backend) -> None:
    # vLLM leaves a stop token's text out of the output: so does the resumed request
    plain = run(backend, "plain", {"max_tokens": 24, "ignore_eos": True})
    stop = plain["tokens"][12]
    full = check_resume(backend, {"max_tokens": 24, "ignore_eos": True, "stop_token_ids": [stop]})
    assert full["reason"] == "stop" and full["tokens"][-1] == stop


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0, "seed": 7},
        {"stop": ["ab"]},
        {"presence_penalty": 0.5},
        {"response_format": {"type": "json_object"}},
    ],
    ids=["seeded", "stop string", "presence penalty", "structured"],
)
def test_what_vllm_cannot_resume_exactly_is_refused(backend, params: dict) -> None:
    with pytest.raises(RequestError) as e:
        backend.add(AddRequest("no", token_ids=prompt(20, 1), params=params, output_ids=[[20, 21]]))
    assert e.value.code == ErrorCode.BAD_PROGRESS and "vLLM cannot resume" in e.value.message
    assert not backend.has_unfinished()
    assert backend.add(
        AddRequest("fresh", token_ids=prompt(20, 1), params=params, output_ids=[[]])
    ) == [""]
    backend.abort("fresh")


@pytest.fixture(scope="module")
def native(small_model: Path) -> Engine:
    config = EngineConfig(
        model=str(small_model), dtype="fp32", max_model_len=MAX_MODEL_LEN, kv_cache_bytes=1 << 24
    )
    return Engine(config)


def test_bad_progress_is_refused_as_the_native_engine_refuses_it(backend, native) -> None:
    eos = min(native.eos_ids)
    bad = [
        ({"max_tokens": 8}, [20, native.vocab_size]),
        ({"max_tokens": 8}, [-1]),
        ({"max_tokens": 2}, [20, 21, 22]),
        ({"max_tokens": 2}, [20, 21]),
        ({"max_tokens": 300}, [20] * (MAX_MODEL_LEN - 20)),
        ({"max_tokens": 8}, [20, eos]),
        ({"max_tokens": 8, "stop_token_ids": [21]}, [20, 21]),
    ]
    for params, ids in bad:
        with pytest.raises(RequestError) as want:
            native.add(AddRequest("bad", token_ids=prompt(20, 1), params=params, output_ids=[ids]))
        with pytest.raises(RequestError) as got:
            backend.add(AddRequest("bad", token_ids=prompt(20, 1), params=params, output_ids=[ids]))
        assert got.value.code == want.value.code == ErrorCode.BAD_PROGRESS
        assert got.value.message == want.value.message
    assert not backend.has_unfinished()
