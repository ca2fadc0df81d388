"""Bad input is refused with a stable code for that request only; abort and capacity; an
exception in one sequence's step (model, sampler, detokenizer) fails only that request."""

from __future__ import annotations

import pytest

from plurai.gpu_workers.backend import AddRequest
from plurai.gpu_workers.engine.errors import ErrorCode, RequestError
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from tests.helpers import drain, greedy, prompt, tokens


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

    engine.add(AddRequest("before", **good))
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
            engine.add(AddRequest(rid, **kwargs))
        assert e.value.code == code, (kwargs, e.value)
        assert e.value.message
    too_long = pytest.raises(RequestError, engine.add, AddRequest("long", token_ids=[7] * 64)).value
    assert "63" in too_long.message  # says how short the prompt must be

    engine.add(
        AddRequest("edge", token_ids=[7] * 63, params=SamplingParams(max_tokens=5, ignore_eos=True))
    )
    engine.add(AddRequest("after", **good))
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
        AddRequest(
            "a",
            token_ids=list(range(20, 60)),
            params=SamplingParams(max_tokens=100, ignore_eos=True),
        )
    )
    engine.add(
        AddRequest(
            "b",
            token_ids=list(range(30, 50)),
            params=SamplingParams(max_tokens=10, ignore_eos=True),
        )
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
    engine.add(AddRequest("w", token_ids=[9, 10, 11], params=SamplingParams(max_tokens=3)))
    assert engine.abort("w") and not engine.has_unfinished()


def test_capacity_query_reserves_what_running_requests_will_need(path, engine_factory):
    engine = engine_factory(path, num_kv_blocks=40, watermark=0.0, max_num_seqs=8)
    assert engine.max_model_len == 640  # lowered to what the cache holds
    engine.add(
        AddRequest("r", token_ids=[11] * 40, params=SamplingParams(max_tokens=280, ignore_eos=True))
    )
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
    few_slots.add(AddRequest("x", token_ids=[3, 4], params=SamplingParams(max_tokens=2)))
    assert not few_slots.can_admit(2, 2)  # no sequence slot left


def test_a_better_priority_request_may_take_what_worse_ones_hold(path, engine_factory):
    engine = engine_factory(path, num_kv_blocks=40, watermark=0.0, max_num_seqs=2)
    batch = SamplingParams(max_tokens=280, ignore_eos=True)
    engine.add(AddRequest("low", token_ids=[11] * 40, params=batch, priority=5))
    engine.add(AddRequest("low2", token_ids=[12] * 40, params=batch, priority=5))
    engine.step()
    assert not engine.can_admit(20, 12)  # both slots taken, every block reserved
    assert not engine.can_admit(20, 12, priority=5)  # an equal one preempts nothing
    assert engine.can_admit(20, 12, priority=0)
    engine.add(
        AddRequest("top", token_ids=[13] * 20, params=SamplingParams(max_tokens=12), priority=0)
    )
    outs = {o.request_id: o for o in engine.step()}
    assert "top" in outs and engine.scheduler.num_preemptions >= 1  # it ran at once
    done = {}
    while engine.has_unfinished():  # the preempted one goes on and keeps its output
        for o in engine.step():
            done.setdefault(o.request_id, 0)
            done[o.request_id] += len(o.new_token_ids)
    assert done["top"] == 11 and done["low"] + done["low2"] > 0


# -- a failing step ---------------------------------------------------------------------

FAULT = 7  # below 16, so the random prompts never hold it


def batch(engine, faulty: bool, with_seeded: bool = False) -> None:
    engine.add(AddRequest("short", token_ids=prompt(5, 10), params=greedy(14)))
    engine.add(AddRequest("long", token_ids=prompt(70, 11), params=greedy(10)))  # chunked prefill
    if faulty:
        p = prompt(40, 12)
        engine.add(AddRequest("bad", token_ids=p[:20] + [FAULT] + p[20:], params=greedy(10)))
    engine.add(AddRequest("mid", token_ids=prompt(30, 13), params=greedy(12)))
    if with_seeded:
        sp = SamplingParams(max_tokens=12, temperature=0.8, seed=99, ignore_eos=True)
        engine.add(AddRequest("seeded", token_ids=prompt(9, 14), params=sp))


def check_only_bad_failed(engine, outs: dict[str, list], reference: dict[str, list]) -> None:
    bad = outs.pop("bad")
    assert bad[-1].finished and bad[-1].finish_reason == "error"
    assert all(not o.finished for o in bad[:-1])
    assert {rid: tokens(o) for rid, o in outs.items()} == {
        rid: tokens(o) for rid, o in reference.items()
    }
    assert all(o[-1].finish_reason == "length" and o[-1].error is None for o in outs.values())
    assert not engine.seqs and not engine.has_unfinished()
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_fault_fails_only_its_request(path, engine_factory):
    ref_engine = engine_factory(path, max_num_batched_tokens=32)
    batch(ref_engine, faulty=False)
    reference = drain(ref_engine)

    engine = engine_factory(path, max_num_batched_tokens=32, fault_token_id=FAULT)
    batch(engine, faulty=True)
    outs = drain(engine)
    error = outs["bad"][-1].error
    assert error is not None and error.startswith("RuntimeError: injected fault")
    check_only_bad_failed(engine, outs, reference)
    # the engine goes on serving, and the prefix cache holds nothing of the failed prompt
    batch(engine, faulty=False)
    assert {rid: tokens(o) for rid, o in drain(engine).items()} == {
        rid: tokens(o) for rid, o in reference.items()
    }


def test_the_fault_hook_is_a_config_field():
    from plurai.gpu_workers.engine.config import EngineConfig

    assert EngineConfig(model="m").fault_token_id is None
    assert EngineConfig(model="m", fault_token_id=3).fault_token_id == 3
    with pytest.raises(ValueError, match="fault_token_id"):
        EngineConfig(model="m", fault_token_id="3")  # type: ignore[arg-type]


def test_a_kv_redis_ttl_below_one_second_is_refused():
    """Redis refuses an expiry of 0 or less: every write to the KV tier would fail, unseen."""
    from plurai.gpu_workers.engine.config import EngineConfig

    for ttl in (0, -5):
        with pytest.raises(ValueError, match="kv_redis_ttl_s"):
            EngineConfig(model="m", kv_redis_ttl_s=ttl)


class FailingSampler:
    """Samples as usual (drawing random numbers), then raises if `bad` is in the batch."""

    def __init__(self, sampler, bad: str) -> None:
        self.sampler, self.bad = sampler, bad
        self.generator = sampler.generator
        self.failed: list[list[str]] = []  # the request ids of each batch it raised on

    def __call__(self, logits, seqs, positions=None):
        out = self.sampler(logits, seqs, positions)
        if any(s.request_id == self.bad for s in seqs):
            self.failed.append([s.request_id for s in seqs])
            raise ValueError("no logits for this row")
        return out


def test_a_sampler_exception_fails_only_its_request(path, engine_factory):
    # one step prefills every prompt, so all of them sample in the batch that fails
    ref_engine = engine_factory(path)
    batch(ref_engine, faulty=False, with_seeded=True)
    reference = drain(ref_engine)

    engine = engine_factory(path)
    engine.sampler = FailingSampler(engine.sampler, "bad")
    batch(engine, faulty=True, with_seeded=True)
    outs = drain(engine)
    assert engine.sampler.failed == [["short", "long", "bad", "mid", "seeded"], ["bad"]]
    assert outs["bad"][-1].error == "ValueError: no logits for this row"
    # the seeded request drew the same numbers: the failed batch's draws were given back
    check_only_bad_failed(engine, outs, reference)


def test_a_detokenizer_exception_fails_only_its_request(path, engine_factory):
    ref_engine = engine_factory(path, max_num_batched_tokens=32)
    batch(ref_engine, faulty=False)
    reference = drain(ref_engine)

    engine = engine_factory(path, max_num_batched_tokens=32)
    batch(engine, faulty=True)
    detok = engine.seqs["bad"].detok
    real = detok.add

    def add(token: int) -> str:
        if len(detok.ids) > 12:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
        return real(token)

    detok.add = add  # type: ignore[method-assign]
    outs = drain(engine)
    assert len(tokens(outs["bad"])) > 0  # it failed after some tokens
    assert outs["bad"][-1].error.startswith("UnicodeDecodeError")
    check_only_bad_failed(engine, outs, reference)


def test_a_failure_in_the_recovery_propagates(path, engine_factory):
    engine = engine_factory(path, fault_token_id=FAULT)
    engine.add(AddRequest("bad", token_ids=[20, FAULT, 21], params=greedy(3)))

    def broken(seq) -> None:
        raise AssertionError("block accounting is broken")

    engine.scheduler.finish = broken  # type: ignore[method-assign]
    with pytest.raises(AssertionError, match="accounting"):
        engine.step()


def test_a_fault_in_a_tensor_parallel_group(path, engine_factory):
    """Rerunning one sequence at a time works in a group too: the ranks stay in step."""
    ps = [prompt(9, 20), prompt(25, 21)]
    ref = engine_factory(path).generate(ps, greedy(8))
    engine = engine_factory(path, tensor_parallel=2, fault_token_id=FAULT)
    try:
        engine.add(AddRequest("a", token_ids=ps[0], params=greedy(8)))
        engine.add(AddRequest("bad", token_ids=[30, FAULT, 31, 32], params=greedy(8)))
        engine.add(AddRequest("b", token_ids=ps[1], params=greedy(8)))
        outs = drain(engine)
        assert outs["bad"][-1].finish_reason == "error"
        assert [tokens(outs["a"]), tokens(outs["b"])] == [c.token_ids for c in ref]
        assert engine.blocks.num_free == engine.blocks.num_blocks
        assert engine.generate([ps[0]], greedy(8))[0].token_ids == ref[0].token_ids
    finally:
        engine.close()
