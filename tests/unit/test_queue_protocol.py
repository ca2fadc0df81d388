"""Wire protocol v1 parsing: every refusal has its stable code."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgpack
import pytest

from plurai.broker_config import protocol
from plurai.broker_config.protocol import Code, WireError
from plurai.broker_config.settings import Settings
from plurai.gpu_workers.engine.errors import ErrorCode
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.producer.request import check, prepare
from plurai.results import jobs


def fields(body: object = None, **kw: object) -> dict[bytes, bytes]:
    if body is None:
        body = {"prompt": "hi"}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    f = {"v": "1", "id": "job-0123456789", "max_tokens": "8", "body": raw}
    f.update(kw)
    return {
        k.encode(): (v if isinstance(v, bytes) else str(v).encode())
        for k, v in f.items()
        if v is not None
    }


def code_of(f: dict[bytes, bytes], limit: int = 100) -> str:
    with pytest.raises(WireError) as e:
        protocol.parse_request(f, protocol.Limits(max_tokens=limit))
    return e.value.code


def test_sampling_fields_match_the_engine() -> None:
    assert set(protocol.SAMPLING_FIELDS) == {f.name for f in dataclasses.fields(SamplingParams)}


def test_engine_codes_match() -> None:
    assert (
        Code.INVALID_PROMPT,
        Code.PROMPT_TOO_LONG,
        Code.INVALID_PARAMS,
        Code.TOKEN_OUT_OF_VOCAB,
    ) == (
        ErrorCode.INVALID_PROMPT,
        ErrorCode.PROMPT_TOO_LONG,
        ErrorCode.INVALID_PARAMS,
        ErrorCode.TOKEN_OUT_OF_VOCAB,
    )


def test_valid_request() -> None:
    req = protocol.parse_request(
        fields(
            {"prompt": "hi", "temperature": 0.5, "metadata": {"a": 1}}, priority="2", deadline="123"
        ),
        protocol.Limits(max_tokens=100),
    )
    assert req.prompt == "hi" and req.params == {"temperature": 0.5, "max_tokens": 8}
    assert req.envelope.priority == 2 and req.envelope.deadline_ms == 123
    assert req.metadata == {"a": 1} and req.stream is True
    assert req.prompt_tokens == 1  # ceil(2 bytes / 4)


@pytest.mark.parametrize(
    ("f", "code"),
    [
        (fields(b"{nope"), Code.BAD_BODY),
        (fields(b"\xc1", content_type="application/msgpack"), Code.BAD_BODY),
        (fields([1]), Code.BAD_BODY),
        (fields(v="9"), Code.UNSUPPORTED_VERSION),
        (fields(v=None), Code.BAD_FIELD),
        (fields(max_tokens=None), Code.BAD_FIELD),
        (fields(max_tokens="x"), Code.BAD_FIELD),
        (fields(max_tokens="0"), Code.INVALID_PARAMS),
        (fields(max_tokens="101"), Code.MAX_TOKENS_OVER_LIMIT),
        (fields({"prompt": "a", "max_tokens": 9}), Code.BAD_FIELD),
        (fields({"prompt": "a", "bogus": 1}), Code.BAD_FIELD),
        (fields({}), Code.INVALID_PROMPT),
        (fields({"prompt": "a", "token_ids": [1]}), Code.INVALID_PROMPT),
        (fields({"token_ids": ["a"]}), Code.INVALID_PROMPT),
        (fields(b'{"prompt": "\xff"}'), Code.INVALID_UTF8),
        (fields(priority=b"\xff"), Code.INVALID_UTF8),
        (fields(content_type="text/csv"), Code.BAD_FIELD),
        (fields({"prompt": "a", "stream": "yes"}), Code.BAD_FIELD),
        (fields(priority=1_000_001), Code.BAD_FIELD),
        (fields(priority=-1_000_001), Code.BAD_FIELD),
    ],
)
def test_refusals(f: dict[bytes, bytes], code: str) -> None:
    assert code_of(f) == code


def test_missing_id_is_no_job_id() -> None:
    with pytest.raises(protocol.NoJobId):
        protocol.parse_request(fields(id=None), protocol.Limits(max_tokens=100))
    with pytest.raises(protocol.NoJobId):
        protocol.parse_request(fields(id="bad id!"), protocol.Limits(max_tokens=100))


def test_sdk_entry_parses_back(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(lanes=["interactive", "standard", "batch"])
    named: dict[str, Any] = {}
    real = jobs.submit

    def spy(**kw: Any) -> jobs.Call:
        named.update(kw)
        return real(**kw)

    monkeypatch.setattr(jobs, "submit", spy)
    call = prepare(
        settings,
        prompt="héllo",
        max_tokens=5,
        temperature=0.7,
        lane="batch",
        metadata={"x": 1},
        idempotency_key="k",
        deadline=1.5,
    )
    job_id = call.job_id
    assert (call.queue.script, call.lane, call.model) == ("SUBMIT", "batch", "default")
    assert call.queue.keys == ["plurai:{default}:req:batch", "plurai:{default}:idem:k"]
    assert call.record.keys == [f"plurai:job:{{{job_id}}}"]
    assert named["metadata_json"] == '{"x":1}' and named["idempotency_key"] == "k"
    entry = named["fields"]
    f = {
        str(k).encode(): (v if isinstance(v, bytes) else str(v).encode())
        for k, v in zip(entry[::2], entry[1::2], strict=True)
    }
    req = protocol.parse_request(f, protocol.Limits(max_tokens=100))
    assert req.envelope.job_id == job_id and protocol.valid_job_id(job_id)
    assert req.envelope.content_type == protocol.MSGPACK
    assert msgpack.unpackb(f[b"body"])["prompt"] == "héllo"
    assert req.params == {"temperature": 0.7, "max_tokens": 5}
    assert req.envelope.deadline_ms == 1500 and req.envelope.idem == "k"
    assert req.envelope.prompt_tokens == 2  # ceil(6 UTF-8 bytes / 4)


def test_sdk_refuses_unknown_options() -> None:
    with pytest.raises(TypeError, match="temprature"):
        prepare(Settings(), prompt="a", temprature=1.0)
    with pytest.raises(ValueError, match="exactly one"):
        prepare(Settings(), prompt="a", token_ids=[1])
    with pytest.raises(ValueError, match="priority must be an integer from -1000000"):
        prepare(Settings(), prompt="a", priority=10**7)


def test_a_higher_lane_always_ranks_before_a_lower_one() -> None:
    worst_top = protocol.engine_priority(0, protocol.MAX_PRIORITY)
    best_next = protocol.engine_priority(1, -protocol.MAX_PRIORITY)
    assert worst_top < best_next
    assert protocol.engine_priority(2, 3) < protocol.engine_priority(2, 4)
    assert (
        protocol.parse_request(
            fields(priority=-1_000_000), protocol.Limits(max_tokens=100)
        ).envelope.priority
        == -1_000_000
    )


def test_job_ids_are_unguessable() -> None:
    ids = {protocol.new_job_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 22 for i in ids)
    # about 16 of 1000 would start with '-', which `plurai get ID` reads as an option
    assert not any(i.startswith("-") for i in ids)


def test_a_job_names_its_tenant_or_belongs_to_the_default_one() -> None:
    limits = protocol.Limits(max_tokens=100)
    assert protocol.parse_envelope(fields(), limits).tenant == protocol.DEFAULT_TENANT
    for name in ("acme", "a", "Team_7.eu-west", "t" * protocol.TENANT_CHARS):
        assert protocol.parse_envelope(fields(tenant=name), limits).tenant == name
    refused = {
        b"": Code.BAD_FIELD,
        b"a:b": Code.BAD_FIELD,  # ':' scopes salts and keys under a tenant
        b"-lead": Code.BAD_FIELD,
        b"has space": Code.BAD_FIELD,
        b"t" * (protocol.TENANT_CHARS + 1): Code.BAD_FIELD,
        b"x" * 10_000: Code.BAD_FIELD,
        b"\xff\xfe": Code.INVALID_UTF8,
        "ünï".encode(): Code.BAD_FIELD,
    }
    for raw, code in refused.items():
        with pytest.raises(WireError) as e:
            protocol.parse_envelope(fields(tenant=raw), limits)
        assert e.value.code == code, raw[:20]
        assert "tenant" in e.value.message


def test_the_sdk_sends_a_tenant_and_refuses_a_bad_one() -> None:
    settings = Settings()
    entry = check(settings, prompt="hi", tenant="acme").fields
    pairs = dict(zip(entry[::2], entry[1::2], strict=True))
    assert pairs["tenant"] == "acme"
    assert "tenant" not in check(settings, prompt="hi").fields
    for bad in ("", "a:b", "x" * 65, 7):
        with pytest.raises(ValueError, match="tenant name"):
            check(settings, prompt="hi", tenant=bad)
