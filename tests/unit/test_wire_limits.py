"""Hardened wire parsing: strict numbers, JSON-only values, sizes bounded before any
tokenization, and no input that ends in anything but a documented code."""

from __future__ import annotations

import datetime
import json

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plurai.broker_config import protocol
from plurai.broker_config.protocol import Code, Limits, WireError
from plurai.gpu_workers.engine.errors import RequestError
from plurai.gpu_workers.engine.sampling_params import SamplingParams

LIMITS = Limits(max_tokens=100, prompt_tokens=1000)


def entry(body: object, content_type: str = protocol.JSON, **kw: object) -> dict[bytes, bytes]:
    if isinstance(body, bytes):
        raw = body
    elif content_type == protocol.MSGPACK:
        raw = msgpack.packb(body, use_bin_type=True, datetime=True)
    else:
        raw = json.dumps(body).encode()
    f: dict[str, object] = {
        "v": "1",
        "id": "job-0123456789",
        "max_tokens": "8",
        "content_type": content_type,
        "body": raw,
    }
    f.update(kw)
    return {
        k.encode(): (v if isinstance(v, bytes) else str(v).encode())
        for k, v in f.items()
        if v is not None
    }


def code_of(f: dict[bytes, bytes], limits: Limits = LIMITS) -> str:
    with pytest.raises(WireError) as e:
        protocol.parse_request(f, limits)
    assert e.value.message  # says what to fix
    return e.value.code


MP = protocol.MSGPACK
UTC = datetime.timezone.utc


@pytest.mark.parametrize(
    ("f", "code"),
    [
        # msgpack values with no JSON form
        (entry({"prompt": "hi", "metadata": {"blob": b"\x00"}}, MP), Code.BAD_FIELD),
        (entry({"prompt": "hi", "metadata": {"x": msgpack.ExtType(5, b"ab")}}, MP), Code.BAD_FIELD),
        (
            entry(
                {"prompt": "hi", "metadata": {"t": datetime.datetime(2020, 1, 1, tzinfo=UTC)}}, MP
            ),
            Code.BAD_FIELD,
        ),
        (entry(msgpack.packb({"prompt": "hi", b"k": 1}, use_bin_type=True), MP), Code.BAD_FIELD),
        (entry({"prompt": "hi", "metadata": {"x": float("inf")}}, MP), Code.BAD_FIELD),
        (entry({"prompt": "hi", "temperature": float("nan")}, MP), Code.BAD_FIELD),
        # JSON constants and overflowing numbers
        (entry(b'{"prompt": "hi", "temperature": NaN}'), Code.BAD_FIELD),
        (entry(b'{"prompt": "hi", "temperature": Infinity}'), Code.BAD_FIELD),
        (entry(b'{"prompt": "hi", "temperature": 1e999}'), Code.BAD_FIELD),
        (entry(b'{"prompt": "hi", "seed": 1' + b"0" * 30 + b"}"), Code.BAD_FIELD),
        # nesting
        (
            entry({"prompt": "hi", "metadata": {"a": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}}),
            Code.BAD_FIELD,
        ),
        (
            entry(b'{"prompt": "hi", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
            Code.BAD_FIELD,
        ),
        # lone surrogates
        (entry(b'{"prompt": "a\\ud800b"}'), Code.INVALID_UTF8),
        (entry(b'{"prompt": "hi", "metadata": {"\\udfff": 1}}'), Code.INVALID_UTF8),
        (entry(b'{"messages": [{"role": "user", "content": "\\ud83d"}]}'), Code.INVALID_UTF8),
        # strict integers in flat fields
        (entry({"prompt": "hi"}, max_tokens="١٢"), Code.BAD_FIELD),
        (entry({"prompt": "hi"}, max_tokens="1_0"), Code.BAD_FIELD),
        (entry({"prompt": "hi"}, max_tokens=" 5"), Code.BAD_FIELD),
        (entry({"prompt": "hi"}, max_tokens="+5"), Code.BAD_FIELD),
        (entry({"prompt": "hi"}, priority="9" * 25), Code.BAD_FIELD),
        (entry({"prompt": "hi"}, deadline="1e3"), Code.BAD_FIELD),
        (entry({"prompt": "hi"}, attempts="-1"), Code.BAD_FIELD),
        # sizes
        (entry({"prompt": "x" * 5000}), Code.TOO_LARGE),
        (entry({"messages": [{"role": "user", "content": "x"}] * 20}), Code.TOO_LARGE),
        (entry({"messages": [{"role": "user", "content": "x" * 3000}] * 2}), Code.TOO_LARGE),
        (entry({"prompt": "hi", "stop": ["s"] * 17}), Code.TOO_LARGE),
        (entry({"prompt": "hi", "stop": ["s" * 257]}), Code.TOO_LARGE),
        (entry({"prompt": "hi", "stop": "s" * 257}), Code.TOO_LARGE),
        (entry({"prompt": "hi", "stop_token_ids": [1] * 257}), Code.TOO_LARGE),
        (entry({"prompt": "hi", "metadata": {"m": "x" * 20_000}}), Code.TOO_LARGE),
        (entry({"prompt": "hi", "logprobs": 21}), Code.TOO_LARGE),
        (entry({"prompt": "hi", "cache_salt": "s" * 257}), Code.TOO_LARGE),
        (entry({"prompt": "hi", "metadata": {"pad": "x" * 100}}), Code.TOO_LARGE),
        # claims over the model's context are refused at once
        (entry({"prompt": "hi"}, prompt_tokens="1001"), Code.PROMPT_TOO_LONG),
        (entry({"token_ids": [1] * 1001}), Code.PROMPT_TOO_LONG),
        # new body fields
        (entry({"prompt": "hi", "cache_salt": 5}), Code.BAD_FIELD),
        (entry({"prompt": "hi", "cache_salt": ""}), Code.BAD_FIELD),
        (entry({"prompt": "hi", "special_tokens": "yes"}), Code.BAD_FIELD),
    ],
)
def test_refused_with_code(f: dict[bytes, bytes], code: str) -> None:
    limits = Limits(
        max_tokens=100, prompt_tokens=1000, prompt_chars=4096, messages=16, metadata_bytes=16384
    )
    if b"pad" in f[b"body"]:
        limits = Limits(max_tokens=100, metadata_bytes=64)
    assert code_of(f, limits) == code


def test_entry_field_count_is_bounded() -> None:
    f = entry({"prompt": "hi"}, **{f"x{i}": "1" for i in range(40)})
    assert code_of(f) == Code.TOO_LARGE


def test_messages_hold_role_and_content_only() -> None:
    # another key would reach the chat template without the escaping contents get
    msg = {"role": "user", "content": "hi", "name": "<|im_end|>"}
    assert code_of(entry({"messages": [msg]})) == Code.INVALID_PROMPT


def test_body_bytes_refused_before_decoding() -> None:
    f = entry(b"not even json" * 100)
    assert code_of(f, Limits(body_bytes=100)) == Code.TOO_LARGE


def test_accepted_fields() -> None:
    req = protocol.parse_request(
        entry(
            {
                "prompt": "hi",
                "cache_salt": "tenant-a",
                "special_tokens": True,
                "metadata": {"k": [1]},
            },
            attempts="2",
            prompt_tokens="1000",
        ),
        LIMITS,
    )
    assert req.cache_salt == "tenant-a" and req.special_tokens is True
    assert req.envelope.attempts == 2 and req.envelope.prompt_tokens == 1000
    plain = protocol.parse_request(entry({"prompt": "hi"}), LIMITS)
    assert plain.cache_salt is None and plain.special_tokens is False
    assert plain.envelope.attempts == 0


def test_attempts_of_is_lenient() -> None:
    assert protocol.attempts_of({b"attempts": b"3"}) == 3
    assert protocol.attempts_of({b"attempts": b"x"}) == 0
    assert protocol.attempts_of({}) == 0


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 101},
        {"temperature": float("inf")},
        {"top_p": float("nan")},
        {"repetition_penalty": 1000},
        {"presence_penalty": 10**400},
        {"top_k": 2**40},
        {"stop_token_ids": [-1]},
    ],
)
def test_sampling_ranges(params: dict) -> None:
    with pytest.raises(RequestError) as e:
        SamplingParams.from_dict(params)
    assert e.value.code == "invalid_params"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(), children, max_size=4)
    ),
    max_leaves=20,
)
field_names = st.sampled_from(
    [
        "v",
        "id",
        "tenant",
        "max_tokens",
        "prompt_tokens",
        "priority",
        "deadline",
        "content_type",
        "body",
        "attempts",
        "lane",
        "idem",
        "x",
    ]
)
field_values = st.binary(max_size=40) | st.integers().map(lambda i: str(i).encode()) | st.just(b"1")
body_keys = st.sampled_from(sorted(protocol.BODY_FIELDS) + ["other"])


@settings(max_examples=400, deadline=None)
@given(
    flat=st.dictionaries(field_names, field_values, max_size=8),
    body=st.dictionaries(body_keys, json_values, max_size=6),
    packed=st.booleans(),
)
def test_any_input_ends_in_a_documented_code(flat: dict, body: dict, packed: bool) -> None:
    """Whatever arrives, parsing ends in a request or a WireError, and the sampling fields
    of a parsed request end in SamplingParams or a RequestError: never anything else."""
    f = {k.encode(): v for k, v in flat.items()}
    f.setdefault(b"id", b"job-0123456789")
    f.setdefault(b"v", b"1")
    f.setdefault(b"max_tokens", b"8")
    try:
        if packed:
            f[b"content_type"] = protocol.MSGPACK.encode()
            f[b"body"] = msgpack.packb(body, use_bin_type=True, strict_types=False)
        else:
            f[b"body"] = json.dumps(body, default=repr).encode()
    except (TypeError, ValueError, OverflowError):
        return
    codes = {v for k, v in vars(Code).items() if k.isupper()} - {Code.INTERNAL}
    try:
        req = protocol.parse_request(f, LIMITS)
    except WireError as e:
        assert e.code in codes
        return
    try:
        SamplingParams.from_dict(req.params)
    except RequestError as e:
        assert e.code in codes
