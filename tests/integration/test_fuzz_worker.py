"""Hostile input against one real worker process and a real redis-server (one file: every
test shares the one worker it starts, which must outlive all of them).

Entries are written raw (XADD of flat fields, as any client in any language can): random and
broken flat fields, JSON and msgpack bodies that are broken, deeply nested, huge, non-finite,
with lone surrogates, msgpack bin / ext / timestamp values, non-string map keys, oversized
strings and lists, special-token text; cancel messages of any bytes on the cancel channel;
job ids whose record or token stream already exists with the wrong Redis type.

What a user relies on, checked after every batch:

* the worker process is still alive;
* every entry with a usable id (8-128 of [A-Za-z0-9_-]) has exactly one final record
  (completed, failed or cancelled, with one `end` entry in its token stream) whose
  error_code, if any, is a documented code and never `internal`; when no record can be
  written (its key holds another Redis type) the entry is in the dead-letter stream;
* an entry without a usable id is in the dead-letter stream;
* a well-formed job completes (or is cancelled when a cancel for it was sent), and a
  clearly malformed one fails;
* nothing stays pending in any lane;
* a good job sent afterwards gives exactly the text of the same prompt run offline on the
  same engine settings.

`test_catalog` runs a fixed list of nasty entries one at a time (so a crash names its
input, and every case is reported, not just the first); `test_fuzz_batches` draws random
batches with hypothesis.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from broker_config import keys
from broker_config.protocol import Code
from results.records import JobRecord

from .conftest import ENGINE_ARGS
from .faults import LANES, drained, pending

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


# -- the worker under test ---------------------------------------------------------------


class Served:
    """One worker process; restarted (after clearing what it held) when a case killed it."""

    def __init__(self, url: str, model: Path, log_dir: Path, workers_class: type) -> None:
        self.url = url
        self.model = model
        self.r = redis.Redis.from_url(url)
        self.w = workers_class(url, model, log_dir)
        self.proc: Any = None
        self.index = -1
        self._dead_from = "0-0"
        # (lane, entry id) -> its dead letters; entry ids repeat across streams
        self.dead: dict[tuple[bytes, bytes], list[dict[bytes, bytes]]] = {}

    def start(self) -> None:
        self.index = len(self.w.procs)
        (self.proc,) = self.w.start(1, *WORKER_ARGS, env=WORKER_ENV)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 2500) -> str:
        return self.w.log(self.index)[-n:]

    def death(self) -> str:
        return f"worker exited with code {self.proc.poll()}; its log ends:\n{self.log_tail()}"

    def ready(self) -> None:
        """A live worker and empty lanes: after a crash, drop what the dead one held (its
        failure is already reported) so the next case starts clean."""
        if self.alive():
            return
        for lane in LANES:
            stream = keys.request_stream(lane)
            try:
                held = self.r.xpending_range(stream, keys.GROUP, "-", "+", 100_000)
            except redis.ResponseError:
                continue
            for p in held:
                self.r.xack(stream, keys.GROUP, p["message_id"])
                self.r.xdel(stream, p["message_id"])
            self.r.delete(stream)  # unread entries of the crashed case, too
        self.start()

    def read_dead(self) -> None:
        """Index the dead-letter stream's new entries by the entry id they carry."""
        while True:
            reply = self.r.xread({keys.DEAD_LETTER: self._dead_from}, count=1000)
            if not reply:
                return
            for entry_id, f in reply[0][1]:
                self._dead_from = entry_id.decode()
                key = (f.get(b"lane", b""), f.get(b"entry_id", b""))
                self.dead.setdefault(key, []).append(f)


@pytest.fixture(scope="module")
def served(module_redis_url, tiny_model, tmp_path_factory, workers_class) -> Iterator[Served]:
    s = Served(module_redis_url, tiny_model, tmp_path_factory.mktemp("fuzzlogs"), workers_class)
    s.start()
    yield s
    s.w.stop()


@pytest.fixture(scope="module")
def expected_good(tiny_model) -> tuple[str, list[int]]:
    """The good job's output, run offline on the worker's engine settings (fp32, greedy)."""
    from gpu_workers.engine.engine import Engine, EngineConfig
    from gpu_workers.engine.sampling_params import SamplingParams

    kv = int(ENGINE_ARGS[ENGINE_ARGS.index("--engine") + 1].split("=")[1])
    engine = Engine(
        EngineConfig(
            model=str(tiny_model),
            dtype="fp32",
            threads=1,
            kv_cache_bytes=kv,
            max_model_len=MAX_MODEL_LEN,
        )
    )
    try:
        (out,) = engine.generate(
            [GOOD_PROMPT],
            SamplingParams(max_tokens=GOOD_MAX_TOKENS, temperature=0, ignore_eos=True),
        )
    finally:
        engine.close()
    assert len(out.token_ids) == GOOD_MAX_TOKENS
    return out.text, list(out.token_ids)


# -- running a batch and checking it ------------------------------------------------------


@dataclass
class Written:
    case: Case
    lane: str
    entry_id: bytes
    job_id: str | None  # the usable id, else None
    fields: dict[bytes, bytes] = field(repr=False)

    @property
    def dead_key(self) -> tuple[bytes, bytes]:
        return (self.lane.encode(), self.entry_id)

    def name(self) -> str:
        shown = {k: (v[:60] + b"..." if len(v) > 60 else v) for k, v in self.fields.items()}
        return f"[{self.case.label}] entry {self.entry_id.decode()} on {self.lane}: {shown}"[:600]


def materialize(case: Case) -> tuple[dict[bytes, bytes], str | None]:
    f = dict(case.fields)
    job_id = None
    if f.get(b"id") is ID:
        job_id = "fz-" + secrets.token_urlsafe(12)
        f[b"id"] = job_id.encode()
    raw = f.get(b"id")
    if job_id is None and raw is not None and USABLE_ID.fullmatch(raw):
        job_id = raw.decode()
    if not f:
        f = {b"x": b"y"}
    return f, job_id


def pre_create(r: redis.Redis, job_id: str, where: str, rtype: str) -> None:
    key = keys.job(job_id) if where == "job" else keys.output(job_id)
    if rtype == "string":
        r.set(key, "not a hash")
    elif rtype == "list":
        r.rpush(key, "not", "a", "hash")
    else:
        r.hset(key, mapping={"not": "a stream"})
    r.expire(key, 3600)


def write(served: Served, cases: list[Case], lanes: list[str]) -> list[Written]:
    out = []
    for case, lane in zip(cases, lanes, strict=True):
        f, job_id = materialize(case)
        if case.wrong_type is not None:
            assert job_id is not None
            pre_create(served.r, job_id, *case.wrong_type)
        entry_id = served.r.xadd(keys.request_stream(lane), f)
        out.append(Written(case, lane, entry_id, job_id, f))
    return out


def key_types(r: redis.Redis, job_ids: list[str]) -> list[tuple[str, str]]:
    pipe = r.pipeline(transaction=False)
    for j in job_ids:
        pipe.type(keys.job(j))
        pipe.type(keys.output(j))
    t = [x.decode() for x in pipe.execute()]
    return list(zip(t[::2], t[1::2], strict=True))


def answered(served: Served, w: Written, types: tuple[str, str] | None) -> bool:
    if w.dead_key in served.dead:
        return True
    if w.job_id is None or types is None or types[0] != "hash":
        return False
    return bool(served.r.hexists(keys.job(w.job_id), "final"))


def settle(served: Served, written: list[Written], timeout: float = SETTLE_S) -> list[str]:
    """Wait until every entry is answered (or the worker died, or timeout); the violations."""
    give_up = time.monotonic() + timeout
    left = list(written)  # not yet answered
    while left and time.monotonic() < give_up and served.alive():
        served.read_dead()
        ids = [w.job_id for w in left if w.job_id is not None]
        types = dict(zip(ids, key_types(served.r, ids), strict=True))
        left = [w for w in left if not answered(served, w, types.get(w.job_id or ""))]
        if left:
            time.sleep(0.1)
    served.read_dead()
    violations: list[str] = []
    if not served.alive():
        violations.append(served.death())
    unanswered = {id(w) for w in left}
    for w in written:
        violations += check_one(served, w, timed_out=id(w) in unanswered and served.alive())
    if served.alive() and not left and not drained(served.r):
        held = pending(served.r)
        violations.append(f"{held} entries still pending after every entry was answered")
    return violations


def check_one(served: Served, w: Written, timed_out: bool) -> list[str]:
    r, case = served.r, w.case
    dead = served.dead.get(w.dead_key, [])
    if w.job_id is None:
        if not dead:
            why = "not answered in time" if timed_out else "the worker died first"
            return [f"{w.name()}: no usable id, but not in {keys.DEAD_LETTER} ({why})"]
        return []
    types = key_types(r, [w.job_id])[0]
    if case.wrong_type is not None and case.wrong_type[0] == "job":
        # The record is not a hash, so no result can be written: the entry goes to the
        # dead-letter stream, with the job id (docs/protocol.md, bad_record).
        if not dead:
            why = "not answered in time" if timed_out else "the worker died first"
            return [
                f"{w.name()}: its job key is a {case.wrong_type[1]}; the entry got no result "
                f"and is not in the dead-letter stream ({why})"
            ]
        if not any(w.job_id.encode() in b" ".join(d.values()) for d in dead):
            return [f"{w.name()}: its dead letter does not name the job id: {dead[0]!r}"[:500]]
        return []
    if types[0] != "hash":
        return [f"{w.name()}: no job record ({'timed out' if timed_out else 'worker died'})"]
    rec = JobRecord.from_hash(w.job_id, r.hgetall(keys.job(w.job_id)))
    if not rec.final:
        return [
            f"{w.name()}: no final result (state {rec.state!r})"
            + (" after the batch timed out" if timed_out else "; the worker died first")
        ]
    problems = []
    if rec.state not in TERMINAL:
        problems.append(f"final state {rec.state!r} is not terminal")
    code = rec.error_code
    if rec.state == "failed" and not code:
        problems.append("failed without an error_code")
    if code is not None and code not in DOCUMENTED:
        problems.append(f"error_code {code!r} is not documented: {rec.error_message!r}"[:400])
    if case.expect == COMPLETED and not (
        rec.state == "completed" or (case.cancelled_ok and rec.state == "cancelled")
    ):
        problems.append(
            f"a well-formed job ended {rec.state} ({code}: {rec.error_message!r})"[:400]
        )
    if case.expect == FAILED and rec.state != "failed":
        problems.append(f"a malformed entry was not refused: it ended {rec.state}")
    if isinstance(case.expect, frozenset) and (rec.state != "failed" or code not in case.expect):
        problems.append(
            f"expected failed with {' or '.join(sorted(case.expect))}, got {rec.state} "
            f"{code}: {rec.error_message!r}"[:400]
        )
    if case.record_check is not None and rec.state == "completed":
        extra = case.record_check(rec)
        if extra:
            problems.append(extra)
    if types[1] == "stream":
        ends = [f for _, f in r.xrange(keys.output(w.job_id)) if f.get(b"type") == b"end"]
        if len(ends) != 1:
            problems.append(f"{len(ends)} end entries in its token stream")
    elif case.wrong_type is None:
        problems.append(f"its token stream is a {types[1]!r}, not a stream")
    return [f"{w.name()}: {p}" for p in problems]


def check_good(served: Served, expected: tuple[str, list[int]]) -> list[str]:
    """A good job after the batch: served, and token-exact against the offline engine."""
    if not served.alive():
        return []  # already reported
    case = J(
        "good job after the batch",
        {"prompt": GOOD_PROMPT, "temperature": 0, "ignore_eos": True},
        COMPLETED,
        max_tokens=str(GOOD_MAX_TOKENS).encode(),
    )
    (w,) = write(served, [case], ["interactive"])
    violations = settle(served, [w], timeout=60)
    if violations:
        return violations
    assert w.job_id is not None
    rec = JobRecord.from_hash(w.job_id, served.r.hgetall(keys.job(w.job_id)))
    text, token_ids = expected
    if (rec.text, rec.token_ids) != (text, token_ids):
        return [
            f"the good job after the batch gave {rec.text!r} {rec.token_ids}; the same prompt "
            f"offline gives {text!r} {token_ids}"
        ]
    return []


def report(violations: list[str]) -> str:
    return f"{len(violations)} violation(s):\n" + "\n".join(f"- {v}" for v in violations)


# -- the fixed catalog ----------------------------------------------------------------------


def catalog_runs() -> list[tuple[str, Callable[[Served], list[Written]]]]:
    """Each run: writes some entries (and publishes cancels); all then checked."""
    runs: list[tuple[str, Callable[[Served], list[Written]]]] = []
    for i, case in enumerate(CATALOG + HEAVY):
        runs.append((case.label, lambda s, c=case, i=i: write(s, [c], [LANES[i % 3]])))
    for bad in BAD_IDS:
        case = J(f"id {bad[:20] if bad else bad!r}", P)
        case.fields = {k: v for k, v in case.fields.items() if k != b"id"}
        if bad is not None:
            case.fields[b"id"] = bad
        runs.append((case.label, lambda s, c=case: write(s, [c], ["batch"])))
    for where, rtype in WRONG_TYPES:
        expect = F("bad_record") if where == "output" else ANY
        case = replace(J(f"{where} key is a {rtype}", P, expect), wrong_type=(where, rtype))
        runs.append((case.label, lambda s, c=case: write(s, [c], ["standard"])))
    for msg in CANCELS:

        def cancel_then_good(s: Served, msg: bytes = msg) -> list[Written]:
            s.r.publish(keys.CANCEL_CHANNEL, msg)
            return write(
                s, [J(f"a job after cancel message {msg[:12]!r}", P, COMPLETED)], ["standard"]
            )

        runs.append((f"cancel message {msg[:12]!r}", cancel_then_good))

    def cancel_running(s: Served) -> list[Written]:
        long = replace(
            J(
                "a cancelled running job",
                {"prompt": "x", "ignore_eos": True},
                COMPLETED,
                max_tokens=str(LIMIT).encode(),
            ),
            cancelled_ok=True,
        )
        (w,) = write(s, [long], ["interactive"])
        assert w.job_id is not None
        give_up = time.monotonic() + 30
        while s.r.hget(keys.job(w.job_id), "state") != b"running" and time.monotonic() < give_up:
            time.sleep(0.01)
        s.r.publish(keys.CANCEL_CHANNEL, w.job_id.encode())
        s.r.publish(keys.CANCEL_CHANNEL, w.job_id.encode())  # twice
        return [w]

    runs.append(("cancel of a running job", cancel_running))
    return runs


def test_catalog(served: Served, expected_good) -> None:
    violations: list[str] = []
    for label, run in catalog_runs():
        served.ready()
        try:
            written = run(served)
        except redis.RedisError as e:
            violations.append(f"[{label}] could not be written: {e}")
            continue
        violations += settle(served, written)
        if not served.alive():
            violations.append(f"(the worker died on [{label}]; restarted for the next case)")
    served.ready()
    violations += check_good(served, expected_good)
    assert not violations, report(violations)


# -- hypothesis: random batches ---------------------------------------------------------------

WEIRD_VALUES = [
    b"",
    b" 5",
    b"5 ",
    "١٢".encode(),
    "４".encode(),
    b"1_000",
    b"4.0",
    b"1e3",
    b"-1",
    b"0",
    b"+3",
    b"0x10",
    b"9" * 30,
    b"-" + b"9" * 30,
    b"9" * 5000,
    b"NaN",
    b"inf",
    b"\xff",
    b"\x00",
    b"true",
    b"[1]",
    b"application/json",
    b"application/msgpack",
    b"1",
    b"2",
]
FLAT_NAMES = [b"v", b"max_tokens", b"prompt_tokens", b"priority", b"deadline", b"content_type"]
FLAT_NAMES += [b"lane", b"idem", b"body"]

text_st = st.text(st.characters(codec="utf-8"), min_size=1, max_size=24)
special_st = st.sampled_from(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "\n"])
prompt_st = st.lists(st.one_of(text_st, special_st), min_size=1, max_size=4).map("".join)
meta_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=10),
)
metadata_st = st.dictionaries(st.text(max_size=8), meta_leaf, max_size=4)


@st.composite
def valid_body(draw: st.DrawFn, max_tokens: int, model: str) -> dict[str, Any]:
    kind = draw(st.sampled_from(["prompt", "messages", "token_ids"]))
    body: dict[str, Any] = {}
    if kind == "prompt":
        body["prompt"] = draw(prompt_st)
    elif kind == "messages":
        # Roles are rendered by the chat template unescaped, so one that holds (or starts or
        # ends) special-token text is refused: the catalog checks that; these are well formed.
        free = st.text(alphabet=string.ascii_letters + string.digits + " _-", max_size=8)
        role = st.one_of(st.sampled_from(["system", "user", "assistant"]), free)
        msg = st.fixed_dictionaries({"role": role, "content": prompt_st})
        body["messages"] = draw(st.lists(msg, min_size=1, max_size=3))
    else:
        body["token_ids"] = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
    optional: dict[str, st.SearchStrategy[Any]] = {
        "max_tokens": st.just(max_tokens),
        "temperature": st.sampled_from([0, 0.0, 0.5, 1, 1.3]),
        "top_k": st.integers(0, 100),
        "top_p": st.floats(0.05, 1.0),
        "min_p": st.floats(0.0, 0.5),
        "repetition_penalty": st.floats(0.5, 2.0),
        "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "seed": st.integers(0, 2**63 - 1),
        "stop": st.lists(st.text(min_size=1, max_size=5), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=5),
        "ignore_eos": st.booleans(),
        "logprobs": st.one_of(st.none(), st.integers(0, 20)),
        "skip_special_tokens": st.booleans(),
        "stream": st.booleans(),
        "metadata": metadata_st,
        "model": st.just(model),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=6)):
        body[name] = draw(optional[name])
    return body


@st.composite
def valid_case(draw: st.DrawFn, model: str) -> Case:
    max_tokens = draw(st.integers(1, 8))
    body = draw(valid_body(max_tokens, model))
    use_msgpack = draw(st.booleans())
    raw = mp(body) if use_msgpack else js(body)
    extra: dict[str, bytes] = {}
    if draw(st.booleans()):
        extra["prompt_tokens"] = str(draw(st.integers(0, 200))).encode()
    if draw(st.booleans()):
        extra["priority"] = str(draw(st.integers(-1_000_000, 1_000_000))).encode()
    if draw(st.booleans()):
        extra["deadline"] = str(int(time.time() * 1000) + 3_600_000).encode()
    ct = MSGPACK_CT if use_msgpack else draw(st.sampled_from([JSON_CT, None]))
    f = fields_of(raw, content_type=ct, max_tokens=str(max_tokens).encode(), **extra)
    return Case(f"valid {'msgpack' if use_msgpack else 'JSON'} {kind_of(body)}", f, COMPLETED)


def kind_of(body: dict[str, Any]) -> str:
    return next((k for k in ("prompt", "messages", "token_ids") if k in body), "?")


@st.composite
def mutated_case(draw: st.DrawFn, model: str) -> Case:
    case = draw(valid_case(model))
    f = dict(case.fields)
    expect, notes = ANY, []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["drop", "set", "extra", "truncate", "flip"]))
        if op == "drop":
            name = draw(st.sampled_from(FLAT_NAMES))
            f.pop(name, None)
            notes.append(f"no {name.decode()}")
            if name in (b"v", b"max_tokens", b"body"):
                expect = FAILED
        elif op == "set":
            name = draw(st.sampled_from(FLAT_NAMES))
            f[name] = draw(st.one_of(st.sampled_from(WEIRD_VALUES), st.binary(max_size=12)))
            notes.append(f"{name.decode()}={f[name][:20]!r}")
        elif op == "extra":
            name = draw(
                st.one_of(
                    st.sampled_from([b"x", b"\xff\xfe", b"", b"ID", b"Body"]), st.binary(max_size=8)
                )
            )
            if name not in (b"id", *FLAT_NAMES):
                f[name] = draw(st.binary(max_size=16))
                notes.append(f"extra {name!r}")
        elif op == "truncate" and isinstance(f.get(b"body"), bytes) and f[b"body"]:
            body = f[b"body"]
            f[b"body"] = body[: draw(st.integers(0, len(body) - 1))]
            notes.append("body truncated")
        elif op == "flip" and isinstance(f.get(b"body"), bytes) and f[b"body"]:
            body = bytearray(f[b"body"])
            at = draw(st.integers(0, len(body) - 1))
            body[at] = draw(st.integers(0, 255))
            f[b"body"] = bytes(body)
            notes.append(f"body byte {at} changed")
    return Case(f"{case.label}, mutated: {'; '.join(notes)}", f, expect)


def _ext_leaf() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.binary(max_size=8),
        st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
        st.builds(msgpack.Timestamp, st.integers(0, 2**32), st.integers(0, 999_999_999)),
    )


body_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from(["\ud800", "a\udfffb", "<|endoftext|>"]),
)
body_keys = st.one_of(
    st.sampled_from(
        ["prompt", "messages", "token_ids", "temperature", "top_k", "top_p", "seed", "stop"]
        + ["stop_token_ids", "metadata", "model", "stream", "cache_salt", "special_tokens"]
        + ["logprobs", "max_tokens", "ignore_eos", "min_p", "repetition_penalty"]
    ),
    st.text(max_size=6),
)


@st.composite
def random_body_case(draw: st.DrawFn) -> Case:
    use_msgpack = draw(st.booleans())
    leaf = st.one_of(body_leaf, _ext_leaf()) if use_msgpack else body_leaf
    tree = st.recursive(
        leaf,
        lambda kids: st.one_of(
            st.lists(kids, max_size=4), st.dictionaries(body_keys, kids, max_size=4)
        ),
        max_leaves=12,
    )
    body = draw(st.dictionaries(body_keys, tree, max_size=5))
    if draw(st.booleans()):
        body.setdefault("prompt", "x")
    if use_msgpack:
        try:
            return M("random msgpack body", body)
        except (OverflowError, UnicodeEncodeError, ValueError, TypeError):
            pass  # ints over 64 bits, lone surrogates: send it as JSON instead
    return J("random JSON body", json.loads(json.dumps(body, default=repr)))


@st.composite
def no_id_case(draw: st.DrawFn, model: str) -> Case:
    case = draw(st.one_of(valid_case(model), mutated_case(model)))
    bad = draw(st.sampled_from(BAD_IDS))
    f = {k: v for k, v in case.fields.items() if k != b"id"}
    if bad is not None:
        f[b"id"] = bad
    return Case(f"{case.label}, id {bad[:20] if bad else bad!r}", f, ANY)


@st.composite
def wrong_type_case(draw: st.DrawFn, model: str) -> Case:
    case = draw(valid_case(model))
    where, rtype = draw(st.sampled_from(WRONG_TYPES))
    expect = F("bad_record") if where == "output" else ANY
    return Case(f"{case.label}, {where} key is a {rtype}", case.fields, expect, (where, rtype))


# In random batches a catalog case is held to the invariants and to failing or completing;
# its exact code is test_catalog's business (one wrong code should not hide the rest).
cheap_catalog = st.sampled_from(
    [replace(c, expect=FAILED) if isinstance(c.expect, frozenset) else c for c in CATALOG]
)
heavy = st.sampled_from(
    [replace(c, expect=FAILED) if isinstance(c.expect, frozenset) else c for c in HEAVY]
)


@dataclass
class Batch:
    cases: list[Case]
    lanes: list[str]
    cancels: list[bytes | int]  # message bytes, or the index of a case whose id to send

    def __repr__(self) -> str:
        cancels = [c if isinstance(c, int) else c[:16] for c in self.cancels]
        rows = [f"  {lane}: {c.label}" for c, lane in zip(self.cases, self.lanes, strict=True)]
        return "Batch(\n" + "\n".join(rows) + f"\n  cancels: {cancels}\n)"


@st.composite
def batch_st(draw: st.DrawFn, model: str) -> Batch:
    one = st.one_of(
        valid_case(model),
        valid_case(model),
        mutated_case(model),
        mutated_case(model),
        random_body_case(),
        cheap_catalog,
        no_id_case(model),
        wrong_type_case(model),
    )
    cases = draw(st.lists(one, min_size=10, max_size=30))
    cases += draw(st.lists(heavy, max_size=2))
    cases = draw(st.permutations(cases))
    lanes = [draw(st.sampled_from(LANES)) for _ in cases]
    cancel = st.one_of(
        st.binary(max_size=40),
        st.sampled_from(CANCELS),
        st.integers(0, len(cases) - 1),  # the id of one of this batch's jobs
    )
    cancels = draw(st.lists(cancel, max_size=5))
    return Batch(cases, lanes, cancels)


MODEL_NAME = "llama"  # the tiny model's directory name (tests/conftest.py): the worker serves it


@settings(
    max_examples=30,
    print_blob=True,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: every run costs real seconds
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
@given(batch=batch_st(MODEL_NAME))
def test_fuzz_batches(served: Served, expected_good, batch: Batch) -> None:
    assert served.model.name == MODEL_NAME
    cases, lanes, cancels = batch.cases, batch.lanes, batch.cancels
    served.ready()
    marked = set()
    for c in cancels:
        if isinstance(c, int):
            marked.add(c)
    cases = [replace(c, cancelled_ok=i in marked) for i, c in enumerate(cases)]
    written = write(served, cases, lanes)
    for c in cancels:
        if isinstance(c, int):
            job_id = written[c].job_id
            msg = job_id.encode() if job_id else written[c].entry_id
        else:
            msg = c
        served.r.publish(keys.CANCEL_CHANNEL, msg)
    violations = settle(served, written)
    violations += check_good(served, expected_good)
    assert not violations, report(violations)
