"""The fuzz test's entries (tests/integration/test_fuzz_worker.py): the worker's limits it
runs under, and the fixed catalog's cases, each a raw entry and the outcome expected."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import msgpack
import pytest

from plurai.broker_config.protocol import Code
from plurai.results.records import JobRecord

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
LIMIT = 64  # PLURAI_MAX_TOKENS_LIMIT of the worker
VOCAB = 2048  # the tiny test model's vocabulary
WORKER_ARGS = ("--engine", f"max_model_len={MAX_MODEL_LEN}")
WORKER_ENV = {"PLURAI_MAX_TOKENS_LIMIT": str(LIMIT), "PLURAI_HEARTBEAT_INTERVAL_S": "1"}
JSON_CT = b"application/json"
MSGPACK_CT = b"application/msgpack"
SETTLE_S = 90.0  # a batch must be answered within this (never a timing assertion)

# Every documented error code: protocol.Code less INTERNAL, plus the codes being added.
DOCUMENTED = {
    v for k, v in vars(Code).items() if k.isupper() and isinstance(v, str) and v != "internal"
} | {getattr(Code, "TOO_LARGE", "too_large"), getattr(Code, "BAD_RECORD", "bad_record")}
DOCUMENTED.discard(getattr(Code, "INTERNAL", "internal"))
TERMINAL = {"completed", "failed", "cancelled"}

USABLE_ID = re.compile(rb"[A-Za-z0-9_-]{8,128}")
ID = object()  # placeholder: a fresh usable id is put here when the entry is written

GOOD_PROMPT = "The river rose overnight and"  # < one KV block: never a prefix-cache hit
GOOD_MAX_TOKENS = 12

COMPLETED, FAILED, ANY = "completed", "failed", "any"


# -- building entries ------------------------------------------------------------------------


def js(obj: Any) -> bytes:
    """JSON as a careless client writes it: NaN/Infinity literals, \\uXXXX escapes."""
    return json.dumps(obj, allow_nan=True).encode()


def mp(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def fields_of(
    body: bytes | None,
    content_type: bytes | None = JSON_CT,
    max_tokens: bytes | None = b"4",
    **extra: bytes | None,
) -> dict[bytes, Any]:
    """A request entry's flat fields; a value given as None is left out."""
    f: dict[bytes, Any] = {
        b"v": b"1",
        b"id": ID,
        b"max_tokens": max_tokens,
        b"content_type": content_type,
        b"body": body,
    }
    f.update({k.encode(): v for k, v in extra.items()})
    return {k: v for k, v in f.items() if v is not None}


@dataclass(repr=False)
class Case:
    label: str
    fields: dict[bytes, Any]
    # COMPLETED; FAILED; a frozenset of codes: failed with one of them; ANY: any terminal
    # state (always with a documented code, never internal)
    expect: str | frozenset[str] = ANY
    wrong_type: tuple[str, str] | None = None  # ("job" | "output", redis type) pre-created
    cancelled_ok: bool = False  # a cancel for this job is published
    record_check: Callable[[JobRecord], str | None] | None = None  # more, on the final record

    def __repr__(self) -> str:  # short: hypothesis prints failing batches
        return f"Case({self.label!r})"


def F(*codes: str) -> frozenset[str]:
    return frozenset(codes)


def J(label: str, body: Any, expect: str | frozenset[str] = ANY, **kw: Any) -> Case:
    raw = body if body is None or isinstance(body, bytes) else js(body)
    return Case(label, fields_of(raw, **kw), expect)


def M(label: str, body: Any, expect: str | frozenset[str] = ANY, **kw: Any) -> Case:
    raw = body if isinstance(body, bytes) else mp(body)
    return Case(label, fields_of(raw, content_type=MSGPACK_CT, **kw), expect)


def nested_json(depth: int) -> bytes:
    return b'{"prompt": "deep", "metadata": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"


def nested_msgpack(depth: int) -> bytes:
    """{"prompt": "deep", "metadata": {"a": [[[...nil...]]]}}, built by hand: msgpack's
    packer refuses to nest this deep itself."""
    return b"\x82\xa6prompt\xa4deep\xa8metadata\x81\xa1a" + b"\x91" * depth + b"\xc0"


def huge_int_json(name: str, digits: int) -> bytes:
    return b'{"prompt": "x", "' + name.encode() + b'": 1' + b"0" * digits + b"}"


P = {"prompt": "hello there"}
BIG = 2_000_000

# The fixed cases. Each expects what docs/protocol.md promises: COMPLETED for a well-formed
# job, a set of codes for a refused one (more than one where the text allows either), ANY
# where the protocol leaves the outcome open (any terminal state with a documented code).
BF, BB, TL, UTF = F("bad_field"), F("bad_body"), F("too_large"), F("invalid_utf8")
IP, PR = F("invalid_params"), F("invalid_prompt")
PTL = F("prompt_too_long")
INT64_MAX_ISH = b"9000000000000000000"  # 19 digits, within 64 bits


def prompt_tokens_is(n: int) -> Callable[[JobRecord], str | None]:
    def check(rec: JobRecord) -> str | None:
        if n == 1 and rec.prompt_tokens != 1:
            return f"prompt_tokens {rec.prompt_tokens}: the special token was not one token"
        if n > 1 and (rec.prompt_tokens or 0) < n:
            return f"prompt_tokens {rec.prompt_tokens}: special-token text became a control token"
        return None

    return check


CATALOG: list[Case] = [
    # flat fields: integers are ASCII -?[0-9]+ within 64 bits
    J("max_tokens '١٢' (Arabic-Indic digits)", P, BF, max_tokens="١٢".encode()),
    J("max_tokens fullwidth '４'", P, BF, max_tokens="４".encode()),
    J("max_tokens '1_000'", P, BF, max_tokens=b"1_000"),
    J("max_tokens ' 5'", P, BF, max_tokens=b" 5"),
    J("max_tokens '5\\n'", P, BF, max_tokens=b"5\n"),
    J("max_tokens '+3'", P, BF, max_tokens=b"+3"),
    J("max_tokens '4.0'", P, BF, max_tokens=b"4.0"),
    J("max_tokens '1e3'", P, BF, max_tokens=b"1e3"),
    J("max_tokens ''", P, BF, max_tokens=b""),
    J("max_tokens 30 digits", P, BF, max_tokens=b"9" * 30),
    J("max_tokens 19 digits", P, F("max_tokens_over_limit"), max_tokens=INT64_MAX_ISH),
    J("max_tokens 5000 digits", P, BF, max_tokens=b"9" * 5000),
    J("max_tokens -0", P, IP, max_tokens=b"-0"),
    J("max_tokens non-UTF-8", P, UTF, max_tokens=b"\xff\xfe"),
    J("max_tokens missing", P, BF, max_tokens=None),
    J("prompt_tokens -1", P, BF, prompt_tokens=b"-1"),
    J("prompt_tokens 30 digits", P, BF, prompt_tokens=b"9" * 30),
    J("prompt_tokens 19 digits", P, PTL, prompt_tokens=INT64_MAX_ISH),
    J("prompt_tokens 5000 digits", P, BF, prompt_tokens=b"9" * 5000),
    J("prompt_tokens '١٢'", P, BF, prompt_tokens="١٢".encode()),
    J("prompt_tokens 'abc'", P, BF, prompt_tokens=b"abc"),
    J("prompt_tokens 0", P, COMPLETED, prompt_tokens=b"0"),
    J("priority 30 digits", P, BF, priority=b"9" * 30),
    J("priority '1e3'", P, BF, priority=b"1e3"),
    J("priority '١٢'", P, BF, priority="١٢".encode()),
    J("priority 1000001", P, BF, priority=b"1000001"),
    J("priority -1000000", P, COMPLETED, priority=b"-1000000"),
    J("deadline '1' (long past)", P, F("deadline_exceeded"), deadline=b"1"),
    J("deadline 30 digits", P, BF, deadline=b"9" * 30),
    J("deadline 19 digits (far future)", P, COMPLETED, deadline=INT64_MAX_ISH),
    J("deadline 5000 digits", P, BF, deadline=b"9" * 5000),
    J("deadline 'soon'", P, BF, deadline=b"soon"),
    J("deadline '1.5e12'", P, BF, deadline=b"1.5e12"),
    J("attempts 'x'", P, BF, attempts=b"x"),
    J("content_type upper case", P, BF, content_type=b"Application/JSON"),
    J("content_type empty", P, content_type=b""),
    J("content_type msgpack, JSON body", P, BB, content_type=MSGPACK_CT),
    J("v '1.0'", P, F("unsupported_version"), v=b"1.0"),
    J("v ' 1'", P, F("unsupported_version"), v=b" 1"),
    J("v '١'", P, F("unsupported_version"), v="١".encode()),
    J("v missing", P, BF, v=None),
    J("body missing", None, BF),
    J("lane non-UTF-8", P, UTF, lane=b"\xff\xfe"),
    J("idem of 1 MB", P, idem=b"k" * 1_000_000),
    J("tenant non-UTF-8", P, UTF, tenant=b"\xff\xfe"),
    J("tenant of 10 kB", P, BF, tenant=b"t" * 10_000),
    J("tenant 'a:b'", P, BF, tenant=b"a:b"),
    J("tenant empty", P, BF, tenant=b""),
    Case(
        "tenant 'acme'",
        fields_of(js(P), tenant=b"acme"),
        COMPLETED,
        record_check=lambda rec: None if rec.tenant == "acme" else f"tenant {rec.tenant!r}",
    ),
    Case("extra fields, non-UTF-8 names", {**fields_of(js(P)), b"\xff\xfe": b"x", b"": b"y"}),
    # JSON bodies
    J("body '{prompt: hello'", b"{prompt: hello", BB),
    J("body empty", b"", BB),
    J("body 'null'", b"null", BB),
    J("body '[]'", b"[]", BB),
    J("body '\"x\"'", b'"x"', BB),
    J("body with UTF-8 BOM", b'\xef\xbb\xbf{"prompt": "x"}'),
    J("body in UTF-16", '{"prompt": "x"}'.encode("utf-16")),
    J("body with trailing garbage", b'{"prompt": "x"} }', BB),
    J("body with trailing comma", b'{"prompt": "x",}', BB),
    J("body truncated", b'{"prompt": "x", "temper', BB),
    J("body invalid UTF-8 in a string", b'{"prompt": "caf\xc3("}', UTF),
    J("body nested list 200 deep", b"[" * 200 + b"]" * 200, BB | BF | TL),
    J("metadata nested 17 deep", nested_json(16), BF | TL),
    J("metadata nested 15 deep", nested_json(14), COMPLETED),
    J("metadata nested 200 deep", nested_json(200), BF | TL),
    J("metadata nested 100000 deep", nested_json(100_000), BF | TL),
    J("temperature 1e999", b'{"prompt": "x", "temperature": 1e999}', BF),
    J("top_p 1e999", b'{"prompt": "x", "top_p": 1e999}', BF),
    J("seed 1e999", b'{"prompt": "x", "seed": 1e999}', BF),
    J("max_tokens 1e999 in body", b'{"prompt": "x", "max_tokens": 1e999}', BF),
    J("metadata 1e999", b'{"prompt": "x", "metadata": {"x": 1e999}}', BF),
    J("metadata -1e999", b'{"prompt": "x", "metadata": {"x": [-1e999]}}', BF),
    J("temperature NaN", b'{"prompt": "x", "temperature": NaN}', BF),
    J("temperature Infinity", b'{"prompt": "x", "temperature": Infinity}', BF),
    J("repetition_penalty Infinity", b'{"prompt": "x", "repetition_penalty": Infinity}', BF),
    J("presence_penalty -Infinity", b'{"prompt": "x", "presence_penalty": -Infinity}', BF),
    J("metadata NaN", b'{"prompt": "x", "metadata": {"x": NaN}}', BF),
    J("top_k 10^400", huge_int_json("top_k", 400), BF),
    J("seed 10^400", huge_int_json("seed", 400), BF),
    J("logprobs 10^400", huge_int_json("logprobs", 400), BF | TL),
    J("top_k with 5000 digits (valid JSON, overflows 64 bits)", huge_int_json("top_k", 5000), BF),
    J("metadata int with 5000 digits", huge_int_json("metadata", 5000), BF),
    J("token_ids [10^30]", {"token_ids": [10**30]}, BF | F("token_out_of_vocab")),
    J("token_ids [-1]", {"token_ids": [-1]}, F("token_out_of_vocab")),
    J("token_ids [2048] (the vocabulary's size)", {"token_ids": [VOCAB]}, F("token_out_of_vocab")),
    J("token_ids [1.0]", {"token_ids": [1.0]}, PR),
    J("token_ids [true]", {"token_ids": [True]}, PR),
    J("stop_token_ids [-1]", {"prompt": "x", "stop_token_ids": [-1]}, IP),
    J("stop_token_ids [10^30]", {"prompt": "x", "stop_token_ids": [10**30]}, BF),
    J("seed 2^63", {"prompt": "x", "seed": 2**63}, BF | IP),
    J("seed -1", {"prompt": "x", "seed": -1}, IP),
    J("temperature 5e-324 (denormal)", {"prompt": "x", "temperature": 5e-324}, COMPLETED),
    J("temperature 100", {"prompt": "x", "temperature": 100}, COMPLETED),
    J("temperature 1e308", {"prompt": "x", "temperature": 1e308}, IP),
    J("temperature -0.0", {"prompt": "x", "temperature": -0.0}, COMPLETED),
    J("repetition_penalty 1e-300", {"prompt": "x", "repetition_penalty": 1e-300}, COMPLETED),
    J("top_p 5e-324", {"prompt": "x", "top_p": 5e-324, "temperature": 1}, COMPLETED),
    J("min_p 1", {"prompt": "x", "min_p": 1, "temperature": 1}, COMPLETED),
    J("max_tokens 4.0 in body", {"prompt": "x", "max_tokens": 4.0}),
    J("temperature true", {"prompt": "x", "temperature": True}, IP),
    J("temperature '0'", {"prompt": "x", "temperature": "0"}, IP),
    J("ignore_eos 1", {"prompt": "x", "ignore_eos": 1}, IP),
    J("logprobs 21", {"prompt": "x", "logprobs": 21}, TL | IP),
    J("logprobs 20", {"prompt": "x", "logprobs": 20}, COMPLETED),
    J("stream 'yes'", {"prompt": "x", "stream": "yes"}, BF),
    J("metadata []", {"prompt": "x", "metadata": []}, BF),
    J("model 5", {"prompt": "x", "model": 5}, BF),
    J("model of 1 MB", {"prompt": "x", "model": "m" * 1_000_000}, F("unknown_model") | TL),
    J("prompt and token_ids", {"prompt": "x", "token_ids": [1]}, PR),
    J("prompt ''", {"prompt": ""}, PR),
    J("messages []", {"messages": []}, PR),
    J("messages content a list", {"messages": [{"role": "user", "content": ["x"]}]}, PR),
    J("messages 1025 entries", {"messages": [{"role": "u", "content": "x"}] * 1025}, TL),
    J("stop 17 strings", {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, TL),
    J("stop string of 257 chars", {"prompt": "x", "stop": ["s" * 257]}, TL),
    J("stop_token_ids 257", {"prompt": "x", "stop_token_ids": list(range(257))}, TL),
    J("metadata over 16 KiB", {"prompt": "x", "metadata": {"m": "m" * 17_000}}, TL),
    # lone surrogates (JSON \ud800 escapes): not valid Unicode text
    J("prompt lone surrogate", {"prompt": "\ud800"}, UTF),
    J("prompt with a lone low surrogate", {"prompt": "a\udfffb"}, UTF),
    J("messages content surrogate", {"messages": [{"role": "user", "content": "\ud800"}]}, UTF),
    J("messages role surrogate", {"messages": [{"role": "\udc00", "content": "hi"}]}, UTF),
    J("stop lone surrogate", {"prompt": "x", "stop": ["\ud800"]}, UTF),
    J("metadata value lone surrogate", {"prompt": "x", "metadata": {"k": "\ud800"}}, UTF),
    J("metadata key lone surrogate", {"prompt": "x", "metadata": {"\ud800": 1}}, UTF),
    J("model lone surrogate", {"prompt": "x", "model": "\ud800"}, UTF),
    J("unknown field lone surrogate", {"prompt": "x", "\ud800": 1}, UTF | BF),
    J("prompt surrogate pair (an emoji)", {"prompt": "\ud83d\ude00"}, COMPLETED),
    # special-token text, and the new body fields
    replace(
        J("prompt '<|endoftext|>' (plain text)", {"prompt": "<|endoftext|>"}, COMPLETED),
        record_check=prompt_tokens_is(2),
    ),
    replace(
        J(
            "prompt '<|endoftext|>', special_tokens true",
            {"prompt": "<|endoftext|>", "special_tokens": True},
            COMPLETED,
        ),
        record_check=prompt_tokens_is(1),
    ),
    J("prompt chat markup", {"prompt": "<|im_start|>user\nhi<|im_end|>\n"}, COMPLETED),
    J(
        "messages with '<|im_end|>'",
        {"messages": [{"role": "user", "content": "a<|im_end|>b<|im_start|>"}]},
        COMPLETED,
    ),
    J(
        "messages role '<|im_start|>'",
        {"messages": [{"role": "user<|im_start|>system", "content": "hi"}]},
        PR,
    ),
    J("prompt 30 x '<|endoftext|>'", {"prompt": "<|endoftext|>" * 30}, COMPLETED),
    J("special_tokens false", {"prompt": "<|im_start|>x", "special_tokens": False}, COMPLETED),
    J("special_tokens 'yes'", {"prompt": "x", "special_tokens": "yes"}, BF),
    J("special_tokens 1", {"prompt": "x", "special_tokens": 1}, BF),
    J("cache_salt", {"prompt": "x", "cache_salt": "tenant-7"}, COMPLETED),
    J("cache_salt 5", {"prompt": "x", "cache_salt": 5}, BF),
    J("cache_salt ''", {"prompt": "x", "cache_salt": ""}, BF),
    J("cache_salt of 257 chars", {"prompt": "x", "cache_salt": "s" * 257}, TL),
    J("cache_salt lone surrogate", {"prompt": "x", "cache_salt": "\ud800"}, UTF),
    # msgpack bodies: JSON values only
    M("msgpack prompt as bin", {"prompt": b"hello"}, BF),
    M("msgpack prompt as ExtType", {"prompt": msgpack.ExtType(5, b"hello")}, BF),
    M("msgpack prompt as Timestamp", {"prompt": msgpack.Timestamp(1, 0)}, BF),
    M("msgpack metadata with bin", {"prompt": "x", "metadata": {"b": b"\x00\xff"}}, BF),
    M(
        "msgpack metadata, ExtType",
        {"prompt": "x", "metadata": {"e": msgpack.ExtType(7, b"z")}},
        BF,
    ),
    M(
        "msgpack metadata, Timestamp",
        {"prompt": "x", "metadata": {"t": msgpack.Timestamp(1, 5)}},
        BF,
    ),
    M("msgpack ext -1 with a bad length", b"\x81\xa6prompt\xd5\xff\x00\x01", BB | BF),
    M("msgpack metadata with int keys", {"prompt": "x", "metadata": {1: "a"}}, BF),
    M("msgpack body with int keys", {1: "x"}, BF),
    M("msgpack body with a bin key", {b"prompt": "x"}, BF),
    M("msgpack body with a nil key", b"\x81\xc0\xa1x", BF),
    M("msgpack body with a float key", {1.5: "x", "prompt": "x"}, BF),
    M("msgpack temperature inf", {"prompt": "x", "temperature": float("inf")}, BF),
    M("msgpack temperature nan", {"prompt": "x", "temperature": float("nan")}, BF),
    M("msgpack top_p -inf", {"prompt": "x", "top_p": float("-inf")}, BF),
    M("msgpack seed 2^64-1", {"prompt": "x", "seed": 2**64 - 1}, BF),
    M("msgpack top_k -2^63", {"prompt": "x", "top_k": -(2**63)}, IP),
    M("msgpack token_ids [2^64-1]", {"token_ids": [2**64 - 1]}, BF | F("token_out_of_vocab")),
    M("msgpack metadata nested 200 deep", nested_msgpack(200), BF | TL),
    M("msgpack metadata nested 100000 deep", nested_msgpack(100_000), BF | TL),
    M("msgpack trailing data", mp({"prompt": "x"}) + b"\xc0", BB),
    M("msgpack truncated", mp({"prompt": "hello"})[:-2], BB),
    M("msgpack invalid UTF-8 str", b"\x81\xa6prompt\xa2\xc3\x28", UTF),
    M("msgpack array", [1, 2], BB),
    M("msgpack nil", b"\xc0", BB),
    M("msgpack reserved byte 0xc1", b"\xc1", BB),
    M("msgpack map32 claiming 2^32-1 pairs", b"\xdf\xff\xff\xff\xff", BB),
    M("msgpack str32 claiming 4 GB", b"\x81\xa6prompt\xdb\xff\xff\xff\xff", BB),
    M(
        "msgpack float32 temperature",
        b"\x82\xa6prompt\xa2hi\xabtemperature\xca\x00\x00\x00\x00",
        COMPLETED,
    ),
    M("msgpack valid body", {"prompt": "hi", "metadata": {"k": [1, 2.5, None]}}, COMPLETED),
]

# Oversized: each costs seconds (megabytes to parse or store), so a batch takes at most two.
HEAVY: list[Case] = [
    J("prompt of 2M chars", {"prompt": "ab cd " * (BIG // 6)}, TL),
    J("messages of 2M chars", {"messages": [{"role": "user", "content": "x" * BIG}]}, TL),
    J("token_ids of 100k", {"token_ids": [7] * 100_000}, PTL),
    J("10k stop strings", {"prompt": "x", "stop": [f"s{i}" for i in range(10_000)]}, TL),
    J("100k stop_token_ids", {"prompt": "x", "stop_token_ids": list(range(100_000))}, TL),
    J("1 MB metadata", {"prompt": "x", "metadata": {"blob": "m" * 1_000_000}}, TL),
    J("stop string of 1M chars", {"prompt": "x", "stop": ["s" * 1_000_000]}, TL),
    J("body of 5 MB", {"prompt": "x", "metadata": {"b": "b" * 5_000_000}}, TL),
    M("msgpack 5 MB bin field", {"prompt": "x", "metadata": {"b": b"\x00" * 5_000_000}}, TL),
    M("msgpack 1M-element metadata list", {"prompt": "x", "metadata": {"l": [0] * 1_000_000}}, TL),
]

BAD_IDS: list[bytes | None] = [
    None,
    b"",
    b"short",
    b"a" * 129,
    b"a" * 100_000,
    b"\xff" * 10,
    b"has spaces in it",
    b"abcdefgh\n",
    b"abc/defgh",
    "١٢٣٤٥٦٧٨٩".encode(),
    "ünïcödé-id".encode(),
]

WRONG_TYPES = [("job", "string"), ("job", "list"), ("output", "string"), ("output", "hash")]

CANCELS: list[bytes] = [b"\xff", b"\xff\xfe" * 50, b"", b"x" * 1_000_000, b"\x00", "ü".encode()]
