"""Requests as OpenAI's API and its official client send them, and bodies an attacker
sends: what the gateway takes and what it refuses (Starlette's test client against a real
redis-server; a worker's heartbeat and what it writes for the job are written by hand)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import openai
import pytest
import redis
from starlette.testclient import TestClient

from broker_config import keys, protocol
from results import tokens
from tests.helpers import gateway, serve_model

JOB = "gwaudit0123456789abcdef"  # the id every job of a test gets
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_url)
    serve_model(r)
    yield r
    r.close()


@pytest.fixture
def api(redis_url: str, r: redis.Redis, monkeypatch) -> Iterator[TestClient]:
    monkeypatch.setattr(protocol, "new_job_id", lambda: JOB)
    with gateway(redis_url) as c:
        yield c


def answer(r: redis.Redis) -> None:
    """Writes what a worker would for the job once it is queued: "ab", then its end."""

    def write() -> None:
        try:
            while not r.exists(keys.job(JOB)):
                time.sleep(0.01)
        except redis.ConnectionError:  # the test ended without queueing the job
            return
        r.xadd(keys.output(JOB), {"type": tokens.DELTA, "text": "ab", "token_ids": "[1,2]"})
        r.xadd(
            keys.output(JOB), {"type": tokens.END, "state": "completed", "finish_reason": "length"}
        )
        record = {"state": "completed", "final": "1", "text": "ab", "token_ids": "[1, 2]"}
        r.hset(keys.job(JOB), mapping={**record, "finish_reason": "length", "output_tokens": "2"})

    threading.Thread(target=write, daemon=True).start()


def refused(resp, status: int, code: str, r: redis.Redis) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code and set(err) == {"message", "type", "param", "code"}
    assert not r.exists(keys.job(JOB))  # nothing queued
    return err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "extra",
    [
        {"stream": None},  # the client's types: stream: Optional[...]
        {"logprobs": None},
        {"extra_body": {"background": None}},
        {"safety_identifier": "user-1"},  # OpenAI's successors of `user`, which is ignored
        {"prompt_cache_key": "k"},
        {"stream": True, "stream_options": {"include_usage": None}},
        {"stream": True, "stream_options": {"include_obfuscation": False}},
    ],
)
def test_what_the_openai_client_sends_is_served(api, r, extra) -> None:
    answer(r)
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=api)
    reply = client.chat.completions.create(**CHAT, **extra)  # type: ignore[call-overload]
    if extra.get("stream"):
        text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
    else:
        text = reply.choices[0].message.content
    assert text == "ab"


@pytest.mark.timeout(30)  # taken before: then it waited for a worker
@pytest.mark.parametrize(
    ("extra", "code", "param"),
    [
        (
            {"stream": True, "stream_options": {"include_usage": "false"}},
            "bad_field",
            "stream_options.include_usage",
        ),
        (
            {"stream": True, "stream_options": {"include_obfuscation": 0}},
            "bad_field",
            "stream_options.include_obfuscation",
        ),
        ({"max_completion_tokens": 2, "max_tokens": "2"}, "bad_field", "max_tokens"),
        (
            {"messages": [{"role": "user", "content": "hi", "name": 5}]},
            "invalid_prompt",
            "messages[0].name",
        ),
    ],
)
def test_mistyped_fields_are_refused(api, r, extra, code, param) -> None:
    resp = api.post("/v1/chat/completions", json={**CHAT, **extra})
    assert refused(resp, 400, code, r)["param"] == param


@pytest.mark.timeout(30)  # taken before: then it waited for a worker
@pytest.mark.parametrize(
    "data",
    [
        b'{"model":"m","prompt":"caf\xe9","max_tokens":2}',  # Latin-1
        '{"model":"m","prompt":"hi","max_tokens":2}'.encode("utf-16"),
        '{"model":"m","prompt":"hi","max_tokens":2}'.encode("utf-32"),
    ],
    ids=["latin-1", "utf-16", "utf-32"],
)
def test_a_body_not_in_utf8_is_refused(api, r, data) -> None:
    resp = api.post("/v1/completions", content=data, headers={"content-type": "application/json"})
    refused(resp, 400, "invalid_utf8", r)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded"],
)
def test_a_body_a_browser_may_send_cross_site_is_refused(api, r, content_type) -> None:
    """What a web page can POST to another origin without a CORS preflight: on a gateway
    open to its own machine, any page its browser loads could otherwise queue jobs."""
    data = b'{"model":"m","prompt":"hi","max_tokens":2}'
    resp = api.post("/v1/completions", content=data, headers={"content-type": content_type})
    refused(resp, 400, "bad_body", r)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("content_type", [None, "application/json; charset=utf-8"])
def test_a_json_body_without_or_with_its_content_type_is_served(api, r, content_type) -> None:
    answer(r)
    data = b'{"model":"m","prompt":"hi","max_tokens":2}'
    headers = {"content-type": content_type} if content_type else {}
    resp = api.post("/v1/completions", content=data, headers=headers)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "ab"
