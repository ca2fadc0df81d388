"""Bad input is refused with a stable code for that request only; abort and capacity."""

from __future__ import annotations

import pytest

from gpu_workers.engine.errors import ErrorCode, RequestError
from gpu_workers.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def path(model_factory):
    return model_factory("llama")


BAD_PARAMS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"seed": -1}, "seed"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": ["x"]}, "stop_token_ids"),
    ({"top_pp": 0.9}, "top_pp"),  # unknown field
    ({"regex": "a\ud800"}, "regex"),  # a lone surrogate: not text, cannot be compiled
    ({"choice": ["ok", "\udc80"]}, "choice"),
]


@pytest.mark.parametrize(("params", "named"), BAD_PARAMS)
def test_bad_sampling_params_are_refused(params, named):
    with pytest.raises(RequestError) as e:
        SamplingParams.from_dict(params)
    assert e.value.code == ErrorCode.INVALID_PARAMS
    assert named in e.value.message


def test_bad_requests_get_codes_and_others_keep_running(path, engine_factory):
    engine = engine_factory(path, max_model_len=64)
    good = {"token_ids": [20, 21, 22, 23], "params": SamplingParams(max_tokens=12, ignore_eos=True)}
    expected = engine_factory(path, max_model_len=64).generate([good["token_ids"]], good["params"])[
        0
    ]

    engine.add("before", **good)
    first = engine.step()  # "before" is running while the bad ones arrive
    bad = [
        (dict(prompt=""), ErrorCode.INVALID_PROMPT),
        (dict(token_ids=[]), ErrorCode.INVALID_PROMPT),
        (dict(), ErrorCode.INVALID_PROMPT),
        (dict(prompt="hi", token_ids=[1]), ErrorCode.INVALID_PROMPT),
        (dict(prompt=42), ErrorCode.INVALID_PROMPT),
        (dict(token_ids=[1, "2"]), ErrorCode.INVALID_PROMPT),
        (dict(messages=[{"role": "user"}]), ErrorCode.INVALID_PROMPT),
        (dict(token_ids=[5, -1]), ErrorCode.TOKEN_OUT_OF_VOCAB),
        (dict(token_ids=[engine.vocab_size]), ErrorCode.TOKEN_OUT_OF_VOCAB),
        (dict(token_ids=[7] * 64), ErrorCode.PROMPT_TOO_LONG),
        (dict(token_ids=[7] * 4, params={"max_tokens": 0}), ErrorCode.INVALID_PARAMS),
        (dict(token_ids=[7] * 4, params={"temprature": 0.5}), ErrorCode.INVALID_PARAMS),
        (dict(token_ids=[7] * 4, priority="high"), ErrorCode.INVALID_PARAMS),
        (dict(token_ids=[7] * 4, request_id="before"), ErrorCode.DUPLICATE_ID),
    ]
    for i, (kwargs, code) in enumerate(bad):
        rid = kwargs.pop("request_id", f"bad{i}")
        with pytest.raises(RequestError) as e:
            engine.add(rid, **kwargs)
        assert e.value.code == code, (kwargs, e.value)
        assert e.value.message
    too_long = pytest.raises(RequestError, engine.add, "long", token_ids=[7] * 64).value
    assert "63" in too_long.message  # says how short the prompt must be

    engine.add("edge", token_ids=[7] * 63, params=SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add("after", **good)
    out: dict[str, list[int]] = {"before": first[0].new_token_ids, "after": [], "edge": []}
    reasons = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert out["before"] == out["after"] == expected.token_ids
    # the 63-token prompt fits but may only grow to max_model_len
    assert len(out["edge"]) == 1 and reasons["edge"] == "length"
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_abort_frees_blocks_at_once(path, engine_factory):
    engine = engine_factory(path, num_kv_blocks=64)
    engine.add(
        "a", token_ids=list(range(20, 60)), params=SamplingParams(max_tokens=100, ignore_eos=True)
    )
    engine.add(
        "b", token_ids=list(range(30, 50)), params=SamplingParams(max_tokens=10, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    used_by_b = len(engine.seqs["b"].block_table)
    assert engine.abort("a") is True
    assert engine.abort("a") is False
    assert engine.blocks.num_free == engine.blocks.num_blocks - used_by_b
    seen = set()
    while engine.has_unfinished():
        seen |= {o.request_id for o in engine.step()}
    assert seen == {"b"}
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_abort_of_a_waiting_request(path, engine_factory):
    engine = engine_factory(path)
    engine.add("w", token_ids=[9, 10, 11], params=SamplingParams(max_tokens=3))
    assert engine.abort("w") and not engine.has_unfinished()


def test_capacity_query_reserves_what_running_requests_will_need(path, engine_factory):
    engine = engine_factory(path, num_kv_blocks=40, watermark=0.0, max_num_seqs=8)
    assert engine.max_model_len == 640  # lowered to what the cache holds
    engine.add("r", token_ids=[11] * 40, params=SamplingParams(max_tokens=280, ignore_eos=True))
    assert engine.prompt_backlog == 40  # not computed yet: what the worker bounds
    engine.step()
    assert engine.prompt_backlog == 0
    # "r" may grow to 320 tokens = 20 blocks, so 20 remain for a newcomer
    assert engine.can_admit(60, 260)
    assert not engine.can_admit(60, 261)
    with_watermark = engine_factory(path, num_kv_blocks=40, watermark=0.1)  # keeps 4 blocks
    assert with_watermark.can_admit(100, 476)
    assert not with_watermark.can_admit(100, 477)
    few_slots = engine_factory(path, num_kv_blocks=40, max_num_seqs=1)
    few_slots.add("x", token_ids=[3, 4], params=SamplingParams(max_tokens=2))
    assert not few_slots.can_admit(2, 2)  # no sequence slot left
