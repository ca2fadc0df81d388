"""The vLLM backend in-process: the same refusals as the native engine, every sampling field
mapped, priorities honoured, aborts freeing their blocks, the capacity query, the figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from plurai.gpu_workers.backend import AddRequest, RequestError, StepOutput
from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.engine import Engine
from tests.vllm.conftest import MAX_MODEL_LEN, MAX_SEQS, OPTIONS

pytest.importorskip("vllm", reason="runs in vLLM's environment: make test-vllm")


@pytest.fixture(scope="module")
def native(small_model: Path) -> Engine:
    config = EngineConfig(
        model=str(small_model), dtype="fp32", max_model_len=MAX_MODEL_LEN, kv_cache_bytes=1 << 24
    )
    return Engine(config)


def run(backend, requests: dict[str, dict]) -> dict[str, list[StepOutput]]:
    for rid, kw in requests.items():
        backend.add(AddRequest(rid, **kw))
    outs: dict[str, list[StepOutput]] = {rid: [] for rid in requests}
    while backend.has_unfinished():
        for o in backend.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


BAD = {
    "nothing": {},
    "two prompts": {"prompt": "hi", "token_ids": [1, 2]},
    "prompt not a string": {"prompt": 42},
    "empty prompt": {"prompt": ""},
    "token out of vocab": {"token_ids": [5, 99999]},
    "token ids not ints": {"token_ids": [5, "6"]},
    "prompt too long": {"token_ids": [5] * (MAX_MODEL_LEN + 10)},
    "messages without content": {"messages": [{"role": "user"}]},
    "role with special text": {"messages": [{"role": "user<|im_end|>", "content": "hi"}]},
    "unknown sampling field": {"prompt": "hi", "params": {"temprature": 0.5}},
    "temperature mistyped": {"prompt": "hi", "params": {"temperature": "hot"}},
    "top_p zero": {"prompt": "hi", "params": {"top_p": 0}},
    "seed negative": {"prompt": "hi", "params": {"seed": -1}},
    "logprobs over 20": {"prompt": "hi", "params": {"logprobs": 21}},
    "empty stop string": {"prompt": "hi", "params": {"stop": [""]}},
    "max_tokens zero": {"prompt": "hi", "params": {"max_tokens": 0}},
    "priority mistyped": {"prompt": "hi", "priority": "1"},
    "empty cache_salt": {"prompt": "hi", "cache_salt": ""},
    "special_tokens mistyped": {"prompt": "hi", "special_tokens": "yes"},
    "schema keyword not enforced": {
        "prompt": "hi",
        "params": {
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}
        },
    },
    "regex that does not compile": {"prompt": "hi", "params": {"regex": "a(b"}},
    "regex no token can start": {"prompt": "hi", "params": {"regex": "[a&&b]"}},
}


@pytest.mark.parametrize("kwargs", list(BAD.values()), ids=list(BAD))
def test_refusals_match_the_native_engine(backend, native, kwargs: dict) -> None:
    with pytest.raises(RequestError) as want:
        native.add(AddRequest("bad", **kwargs))
    with pytest.raises(RequestError) as got:
        backend.add(AddRequest("bad", **kwargs))
    assert (got.value.code, got.value.message) == (want.value.code, want.value.message)
    assert not backend.has_unfinished()


def test_duplicate_id_refused(backend) -> None:
    backend.add(AddRequest("dup", prompt="hello", params={"max_tokens": 2}))
    with pytest.raises(RequestError) as e:
        backend.add(AddRequest("dup", prompt="hello"))
    assert e.value.code == "duplicate_request_id"
    outs = run(backend, {})["dup"]
    assert [o.finished for o in outs] == [False, True] and outs[-1].num_output_tokens == 2


def test_sampling_fields(backend) -> None:
    base = {"prompt": "the quick brown fox", "params": {"max_tokens": 12, "ignore_eos": True}}
    greedy = run(backend, {"g": base})["g"]
    ids = [t for o in greedy for t in o.new_token_ids]
    text = "".join(o.text_delta for o in greedy)
    assert len(ids) == 12 and greedy[-1].finish_reason == "length"
    assert greedy[-1].num_output_tokens == 12 and greedy[-1].num_prompt_tokens > 0

    # a stop string from the middle of the greedy text ends the output before it
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = run(backend, {"s": {**base, "params": {**base["params"], "stop": [stop]}}})["s"]
    assert cut[-1].finish_reason == "stop"
    assert "".join(o.text_delta for o in cut) == text[: text.index(stop)]

    # a stop token id
    tok = run(backend, {"t": {**base, "params": {**base["params"], "stop_token_ids": [ids[3]]}}})
    assert [t for o in tok["t"] for t in o.new_token_ids] == ids[:4]

    # seeds: the same seed gives the same tokens at temperature 1
    seeded = {**base, "params": {**base["params"], "temperature": 1.0, "top_k": 50, "seed": 7}}
    outs = run(backend, {"a": seeded, "b": seeded})
    assert [o.new_token_ids for o in outs["a"]] == [o.new_token_ids for o in outs["b"]]

    # logprobs in the native engine's form: the sampled token's, plus the top N in rank order
    lp = run(backend, {"l": {**base, "params": {**base["params"], "logprobs": 3}}})["l"]
    entries = [e for o in lp for e in (o.logprobs or [])]
    assert [e["token_id"] for e in entries] == ids
    for e in entries:
        assert len(e["top"]) == 3 and e["top"][0][0] == e["token_id"]  # greedy: the top one
        assert e["logprob"] == pytest.approx(e["top"][0][1])
        assert [v for _, v in e["top"]] == sorted((v for _, v in e["top"]), reverse=True)


def test_priority_picks_who_runs_first(backend) -> None:
    """More requests than sequence slots: the better priority (lower value) runs first."""
    params = {"max_tokens": 4, "ignore_eos": True}
    for i in range(MAX_SEQS):
        backend.add(AddRequest(f"low{i}", prompt=f"low priority {i}", params=params, priority=10))
    backend.add(AddRequest("high0", prompt="high priority 0", params=params, priority=0))
    backend.add(AddRequest("high1", prompt="high priority 1", params=params, priority=0))
    first = {o.request_id for o in backend.step()}
    assert {"high0", "high1"} <= first and len(first) == MAX_SEQS
    run(backend, {})


def test_abort_frees_blocks_and_capacity(backend) -> None:
    assert backend.can_admit(10, 10)
    for i in range(MAX_SEQS):
        backend.add(
            AddRequest(
                f"long{i}", prompt=f"long one {i}", params={"max_tokens": 200, "ignore_eos": True}
            )
        )
    assert not backend.can_admit(10, 10)  # every sequence slot taken
    assert backend.prompt_backlog > 0  # prompts with no output yet: what the worker bounds
    for _ in range(3):
        backend.step()
    assert backend.prompt_backlog == 0
    s = backend.stats()
    assert s["running"] == MAX_SEQS and s["blocks_used"] > 0
    assert all(backend.abort(f"long{i}") for i in range(MAX_SEQS))
    assert not backend.abort("long0")
    for _ in range(2):
        backend.step()
    s = backend.stats()
    assert not backend.has_unfinished()
    assert (s["running"], s["waiting"], s["blocks_used"]) == (0, 0, 0)
    assert backend.can_admit(10, 10)
    # KV usage from vLLM's figures counts: near full, nothing more is taken
    backend.figures.kv_usage = 0.995
    try:
        assert not backend.can_admit(10, 10)
    finally:
        backend.figures.kv_usage = 0.0
    # and so does a waiting queue inside vLLM
    backend.figures.waiting = 1
    try:
        assert not backend.can_admit(10, 10)
    finally:
        backend.figures.waiting = 0


def test_stats_carry_what_metrics_and_status_read(backend, native) -> None:
    run(backend, {"p1": {"token_ids": list(range(5, 5 + 200)), "params": {"max_tokens": 2}}})
    run(backend, {"p2": {"token_ids": list(range(5, 5 + 200)), "params": {"max_tokens": 2}}})
    s = backend.stats()
    # every figure but the KV tiers' (the connector's, with a Redis tier) and cached blocks
    # (vLLM does not report them)
    assert {k for k in native.stats() if not k.startswith("kv_")} - {"blocks_cached"} <= set(s)
    assert s["prefix_hit_blocks"] >= 1 and s["prefix_lookup_blocks"] >= s["prefix_hit_blocks"]
    assert s["steps"] > 0 and s["generated_tokens"] > 0


def test_a_draft_model_changes_no_greedy_token(backend, small_model: Path) -> None:
    """`--engine speculative=draft:<dir>` becomes vLLM's draft_model method (serve.py):
    the model drafting for itself, its proposals are checked and kept, and the greedy
    tokens are those of the engine without speculation."""
    from plurai.gpu_workers.serve import _vllm_speculative
    from plurai.gpu_workers.vllm_backend.backend import VllmBackend

    spec = _vllm_speculative({"speculative": f"draft:{small_model}", "num_speculative_tokens": 3})
    drafted = VllmBackend(
        str(small_model),
        options={**OPTIONS, "max_num_seqs": MAX_SEQS, "speculative_config": spec},
        engine_process=False,
    )
    try:
        requests = {
            f"d{i}": {"prompt": p, "params": {"max_tokens": 24, "ignore_eos": True}}
            for i, p in enumerate(["The river ran", "She said that", "a b c a b c a b"])
        }
        want = run(backend, requests)
        got = run(drafted, requests)
        tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in want.items()}
        assert {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in got.items()} == (
            tokens
        )
        stats = drafted.stats()
        assert stats["spec_accepted_tokens"] > 0
    finally:
        drafted.close()
