"""Bad input: each entry gets a terminal error result with a stable code and a message
that says what to fix; the worker keeps serving and a good job beside it completes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import msgpack
import pytest
import redis

from plurai.broker_config import keys, protocol
from plurai.results import records, wait

from .faults import drained

MAX_MODEL_LEN = 256
LIMIT = 64


@pytest.fixture(scope="module")
def served(
    module_redis_url: str, tiny_model, tmp_path_factory, workers_class
) -> Iterator[redis.Redis]:
    w = workers_class(module_redis_url, tiny_model, tmp_path_factory.mktemp("logs"))
    w.start(
        1, "--engine", f"max_model_len={MAX_MODEL_LEN}", env={"PLURAI_MAX_TOKENS_LIMIT": str(LIMIT)}
    )
    yield redis.Redis.from_url(module_redis_url)
    assert w.stop() == [0]


def entry(body: bytes | dict = b'{"prompt": "hello"}', **fields: object) -> dict:
    """A request entry; a field given as None is left out."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    f: dict = {
        "v": "1",
        "id": protocol.new_job_id(),
        "max_tokens": "4",
        "content_type": "application/json",
        "body": body,
    }
    f.update(fields)
    return {k: v for k, v in f.items() if v is not None}


# (case, entry fields, expected code, a word the message must contain)
CASES = [
    ("body not json", entry(b"{prompt: hello"), "bad_body", "JSON"),
    (
        "body not msgpack",
        entry(b"\xc1\x00", content_type="application/msgpack"),
        "bad_body",
        "msgpack",
    ),
    ("body not an object", entry(b"[1, 2]"), "bad_body", "object"),
    ("missing max_tokens", entry(max_tokens=None), "bad_field", "max_tokens"),
    ("max_tokens mistyped", entry(max_tokens="ten"), "bad_field", "max_tokens"),
    ("priority mistyped", entry(priority="high"), "bad_field", "priority"),
    (
        "temperature mistyped",
        entry({"prompt": "hi", "temperature": "hot"}),
        "invalid_params",
        "temperature",
    ),
    ("unknown body field", entry({"prompt": "hi", "temprature": 0.5}), "bad_field", "temprature"),
    ("unknown content type", entry(content_type="text/plain"), "bad_field", "content_type"),
    ("missing body", entry(**{"body": None}), "bad_field", "body"),
    ("unknown version", entry(v="3"), "unsupported_version", "'2'"),
    ("missing version", entry(v=None), "bad_field", "'v'"),
    ("missing prompt", entry({"temperature": 0}), "invalid_prompt", "prompt"),
    ("prompt not a string", entry({"prompt": 42}), "invalid_prompt", "string"),
    ("empty prompt", entry({"prompt": ""}), "invalid_prompt", "empty"),
    (
        "prompt over max_model_len",
        entry({"token_ids": [5] * (MAX_MODEL_LEN + 10)}),
        "prompt_too_long",
        str(MAX_MODEL_LEN - 1),
    ),
    ("token out of vocab", entry({"token_ids": [5, 99999]}), "token_out_of_vocab", "99999"),
    ("max_tokens zero", entry(max_tokens="0"), "invalid_params", "positive"),
    ("max_tokens negative", entry(max_tokens="-3"), "invalid_params", "positive"),
    (
        "max_tokens over limit",
        entry(max_tokens=str(LIMIT + 1)),
        "max_tokens_over_limit",
        str(LIMIT),
    ),
    ("invalid utf-8 in json", entry(b'{"prompt": "caf\xc3("}'), "invalid_utf8", "UTF-8"),
    (
        "invalid utf-8 in msgpack",
        entry(b"\x81\xa6prompt\xa2\xff\xfe", content_type="application/msgpack"),
        "invalid_utf8",
        "UTF-8",
    ),
    ("invalid utf-8 in a field", entry(lane=b"\xff\xfe"), "invalid_utf8", "lane"),
    ("unknown model", entry({"prompt": "hi", "model": "gpt-17"}), "unknown_model", "gpt-17"),
    ("n over limit", entry({"prompt": "hi", "n": 17}), "n_over_limit", "16"),
    ("n zero", entry({"prompt": "hi", "n": 0}), "invalid_params", "n must"),
    ("n mistyped", entry({"prompt": "hi", "n": "2"}), "invalid_params", "n must"),
    ("bad messages", entry({"messages": [{"role": "user"}]}), "invalid_prompt", "messages"),
]


@pytest.mark.parametrize(
    ("fields", "code", "hint"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_entry_gets_error_result(
    served: redis.Redis, fields: dict, code: str, hint: str
) -> None:
    stream = keys.request_stream("standard")
    served.xadd(stream, fields)
    good = entry({"prompt": "still serving", "temperature": 0})
    served.xadd(stream, good)
    bad_id, good_id = fields["id"], good["id"]

    bad, ok = wait.wait_many(served, [bad_id, good_id], timeout=60)
    assert bad.state == records.FAILED
    assert bad.error_code == code
    assert hint in (bad.error_message or "")
    assert ok.state == records.COMPLETED and ok.output_tokens == 4
    end = [f for _, f in served.xrange(keys.output(bad_id)) if f[b"type"] == b"end"]
    assert end == [{b"type": b"end", b"state": b"failed", b"finish_reason": b""}]


def test_entry_without_job_id_goes_to_dead_letter(served: redis.Redis) -> None:
    stream = keys.request_stream("batch")
    served.xadd(stream, {"v": "1", "max_tokens": "4", "body": b'{"prompt": "x"}', "note": "no id"})
    good = entry({"prompt": "after the dead letter"})
    served.xadd(stream, good)
    assert wait.wait(served, good["id"], timeout=60).state == records.COMPLETED
    dead = served.xrange(keys.DEAD_LETTER)
    assert len(dead) == 1
    assert b"'id'" in dead[0][1][b"error"] and b"no id" in dead[0][1][b"fields"]
    assert drained(served)


def test_msgpack_body_roundtrip(served: redis.Redis) -> None:
    body = msgpack.packb({"prompt": "a msgpack body", "temperature": 0.0}, use_bin_type=True)
    e = entry(body, content_type="application/msgpack")
    served.xadd(keys.request_stream("interactive"), e)
    rec = wait.wait(served, e["id"], timeout=60)
    assert rec.state == records.COMPLETED and rec.output_tokens == 4
