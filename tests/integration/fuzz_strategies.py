"""The fuzz test's random entries (tests/integration/test_fuzz_worker.py), as hypothesis
strategies: valid bodies, mutated ones, random flat fields, entries with no usable id or a
record of the wrong Redis type, and batches of them."""

from __future__ import annotations

import json
import string
import time
from dataclasses import dataclass, replace
from typing import Any

import msgpack
from hypothesis import strategies as st

from .faults import LANES
from .fuzz_cases import (
    ANY,
    BAD_IDS,
    CANCELS,
    CATALOG,
    COMPLETED,
    FAILED,
    HEAVY,
    JSON_CT,
    MSGPACK_CT,
    VOCAB,
    WRONG_TYPES,
    Case,
    F,
    J,
    M,
    fields_of,
    js,
    mp,
)  # fmt: skip

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
