"""The gateway's requests: what it takes as OpenAI's API and its official client send them,
and what it refuses of bodies an attacker sends or of odd Redis content, in OpenAI's error
shape and never a bare 500 (Starlette's test client against a real redis-server; a worker's
entry in the model directory and what it writes for a job are written by hand).

One file, though long: one request handler's inputs, each test a request and its answer.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import openai as openai_client
import pytest
import redis
from kombu.exceptions import OperationalError
from starlette.requests import Request
from starlette.testclient import TestClient

from plurai.broker_config import keys, protocol
from plurai.broker_config.routes import Routes, registry_value
from plurai.broker_config.settings import Settings
from plurai.gateway import errors, openai
from plurai.results import tokens
from plurai.results.records import BadRecord
from tests.helpers import gateway, serve_model

JOB = "gwrequests0123456789ab"  # the id every job of a test gets
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


def worker(r: redis.Redis, *entries: dict, record: dict | None = None) -> threading.Thread:
    """Writes what a worker would, once the job is queued: `entries` to its token stream,
    then `record` to its record."""

    def write() -> None:
        while not r.exists(keys.job(JOB)):
            time.sleep(0.01)
        for e in entries:
            r.xadd(keys.output(JOB), e)
        if record is not None:
            r.hset(keys.job(JOB), mapping=record)

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


def openai_error(resp, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code and set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize(
    "extra",
    [
        {"seed": 2**70},
        {"prompt": [2**70]},
        {"metadata": {"a": -(2**64)}},
        {"stop_token_ids": [2**64]},
    ],
)
def test_an_integer_over_64_bits_is_a_400(api, extra) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, **extra}
    openai_error(api.post("/v1/completions", json=body), 400, "bad_field")


def test_a_submit_no_replica_acknowledged_is_a_503(redis_url, r, monkeypatch) -> None:
    # PLURAI_SUBMIT_REPLICAS=1 on a Redis without replicas: WAIT never gets its ack
    monkeypatch.setattr(protocol, "new_job_id", lambda: JOB)
    with gateway(redis_url, submit_replicas=1, submit_replicas_timeout_ms=10) as api:
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        resp = api.post("/v1/completions", json=body)
    openai_error(resp, 503, "not_replicated")
    assert resp.headers["retry-after"] == "1"


STREAM = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}
DAMAGED = {"type": tokens.DELTA, "text": "x", "token_ids": "[1,"}  # not JSON


def test_a_damaged_token_stream_before_the_first_text_is_an_error(api, r) -> None:
    worker(r, DAMAGED)
    openai_error(api.post("/v1/completions", json=STREAM), 500, "bad_record")
    assert cancelled(r)  # nobody can read its answer


def cancelled(r: redis.Redis) -> bool:
    give_up = time.monotonic() + 5
    while r.hget(keys.job(JOB), "state") != b"cancelled":
        if time.monotonic() > give_up:
            return False
        time.sleep(0.02)
    return True


def test_a_damaged_record_is_an_error(api, r) -> None:
    worker(r, record={"state": "completed", "final": "1", "text": "a", "prompt_tokens": "x"})
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    openai_error(api.post("/v1/completions", json=body), 500, "bad_record")


def test_a_damaged_token_stream_ends_the_stream_with_an_error_event(api, r) -> None:
    worker(r, {"type": tokens.DELTA, "text": "a", "token_ids": "[1]"})
    with api.stream("POST", "/v1/completions", json=STREAM) as resp:
        assert resp.status_code == 200
        r.xadd(keys.output(JOB), DAMAGED)
        lines = [x for x in resp.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["choices"][0]["text"] == "a"
    assert json.loads(lines[-2][6:])["error"]["code"] == "bad_record"
    assert cancelled(r)


def test_a_client_gone_while_its_body_is_read_is_no_server_error(api) -> None:
    sent = []

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    api.portal.call(api.app, scope, receive, send)  # raised before
    assert sent[0]["status"] == 499


def test_redis_lost_while_the_model_directory_is_read_is_a_503(api, monkeypatch) -> None:
    async def read_async(self, r) -> dict:
        raise redis.ConnectionError("gone")

    monkeypatch.setattr(Routes, "read_async", read_async)
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    openai_error(api.post("/v1/completions", json=body), 503, "unavailable")


@pytest.mark.parametrize("unserved", ["refuse", "wait"])
def test_one_directory_answers_404_for_a_model_no_live_worker_serves(
    redis_url, r, unserved
) -> None:
    """A model whose entry in plurai:models is stale is not served (404 model_not_found),
    whatever PLURAI_UNSERVED says, while another is; with none live, 503 no_workers."""
    serve_model(r, "old", beat_ms=int(time.time() * 1000) - 3_600_000)
    with gateway(redis_url, unserved=unserved) as api:
        body = {"model": "old", "prompt": "hi", "max_tokens": 2}
        err = openai_error(api.post("/v1/completions", json=body), 404, "model_not_found")
        assert err["param"] == "model"
        assert [m["id"] for m in api.get("/v1/models").json()["data"]] == ["m"]
    r.delete(keys.MODELS)
    serve_model(r, "old", beat_ms=1)
    with gateway(redis_url, unserved=unserved) as api:
        resp = api.post("/v1/completions", json=body)
        openai_error(resp, 503, "no_workers")
        assert resp.headers["retry-after"] == "5"
    assert not r.exists(keys.job(JOB))


def test_a_bug_is_a_500_internal_and_cancels_nothing(api, r, monkeypatch) -> None:
    """A TypeError in the gateway's own code is an internal error, not a damaged record:
    the job is not cancelled for it."""

    def broken(job, rec):
        raise TypeError("a bug")

    monkeypatch.setattr(openai, "completion", broken)
    worker(r, record={"state": "completed", "final": "1", "text": "a"})
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    openai_error(api.post("/v1/completions", json=body), 500, "internal")
    assert r.hget(keys.job(JOB), "state") == b"completed"


def test_an_idempotency_key_held_by_no_job_is_a_409(api, r) -> None:
    r.set(keys.idempotency("inv-1", "m"), "not a job id {x}")
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    resp = api.post("/v1/completions", json=body, headers={"Idempotency-Key": "inv-1"})
    err = openai_error(resp, 409, "idempotency_key_conflict")
    assert "plurai" not in err["message"]  # no Redis key names in what a client reads
    assert not r.exists(keys.job(JOB))  # nothing queued, no record left behind


def test_a_streamed_repeat_after_its_stream_expired_gets_the_answer(api, r, monkeypatch) -> None:
    """The same Idempotency-Key again, streamed, once the first job's token stream has
    expired (its record lives longer): the record's text and [DONE], not a wait forever."""
    ids = iter([JOB, "gwerrorsrepeat456789abc"])
    monkeypatch.setattr(protocol, "new_job_id", lambda: next(ids))
    done = {"type": tokens.END, "state": "completed", "finish_reason": "length"}
    record = {"state": "completed", "final": "1", "text": "ab", "token_ids": "[1, 2]"}
    record |= {"finish_reason": "length", "output_tokens": "2"}
    worker(r, {"type": tokens.DELTA, "text": "ab", "token_ids": "[1,2]"}, done, record=record)
    headers = {"Idempotency-Key": "inv-2"}
    first = api.post("/v1/completions", json=STREAM, headers=headers)
    assert first.status_code == 200 and first.text.endswith("data: [DONE]\n\n")
    r.delete(keys.output(JOB))  # expired
    with api.stream("POST", "/v1/completions", json=STREAM, headers=headers) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [x for x in resp.iter_lines() if x]
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ab"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert lines[-1] == "data: [DONE]"


@pytest.mark.timeout(30)
def test_a_repeat_whose_job_record_expired_is_a_404(api, r, monkeypatch) -> None:
    """The same Idempotency-Key again once the first job's record (and stream) expired but
    the key still names it: 404 job_expired at once, streamed or not, not a wait forever."""
    ids = iter([JOB, "gwerrorsrepeat456789abc", "gwerrorsrepeat456789abd"])
    monkeypatch.setattr(protocol, "new_job_id", lambda: next(ids))
    done = {"type": tokens.END, "state": "completed", "finish_reason": "length"}
    record = {"state": "completed", "final": "1", "text": "ab", "token_ids": "[1, 2]"}
    worker(r, {"type": tokens.DELTA, "text": "ab", "token_ids": "[1,2]"}, done, record=record)
    headers = {"Idempotency-Key": "inv-3"}
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    assert api.post("/v1/completions", json=body, headers=headers).status_code == 200
    r.delete(keys.output(JOB), keys.job(JOB))  # expired
    for b in (body, STREAM):
        err = openai_error(api.post("/v1/completions", json=b, headers=headers), 404, "job_expired")
        assert "no record" in err["message"]


@pytest.mark.parametrize(
    ("n", "code"),
    [(True, "bad_field"), (1.0, "bad_field"), ("2", "bad_field"), (0, "invalid_params")],
)
def test_n_other_than_a_positive_integer_is_refused(api, r, n, code) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "n": n}
    err = openai_error(api.post("/v1/completions", json=body), 400, code)
    assert err["param"] == "n" and not r.exists(keys.job(JOB))


def test_directory_entries_that_are_not_utf8_are_skipped(api, r) -> None:
    """An entry of plurai:models holding bytes that are not UTF-8 (its name or its value)
    is no worker's: the others' models are listed and served, never a 500 for every
    request."""
    now = int(time.time() * 1000)
    r.hset(keys.MODELS, b"m2\xff", registry_value(1, now))
    r.hset(keys.MODELS, "m3", registry_value(1, now).encode()[:-1] + b"\xff}")
    resp = api.get("/v1/models")
    assert resp.status_code == 200, resp.text
    assert [m["id"] for m in resp.json()["data"]] == ["m"]
    body = {"model": "m3", "prompt": "hi", "max_tokens": 2}
    openai_error(api.post("/v1/completions", json=body), 404, "model_not_found")


def test_a_model_is_queued_on_its_workers_stream_by_any_of_its_names(api, r) -> None:
    """The directory routes a request naming a model by its folder's name or an alias to
    the queue its workers read."""
    now = int(time.time() * 1000)
    r.hset(keys.MODELS, "q", registry_value(1, now, model_id="tiny", names={"alias"}))
    worker(r, record={"state": "completed", "final": "1", "text": "a", "finish_reason": "stop"})
    body = {"model": "alias", "prompt": "hi", "max_tokens": 2}
    assert api.post("/v1/completions", json=body).status_code == 200
    assert r.xlen(keys.request_stream(Settings().default_lane, "q")) == 1
    assert {m["id"] for m in api.get("/v1/models").json()["data"]} == {"m", "tiny"}


def test_one_middleware_counts_each_request_once(api, r) -> None:
    body = {"model": "nope", "prompt": "hi", "max_tokens": 2}
    openai_error(api.post("/v1/completions", json=body), 404, "model_not_found")
    assert api.get("/v1/files/file-nope").status_code == 404
    page = api.get("/metrics").text
    counted = [x for x in page.splitlines() if x.startswith("plurai_gateway_requests_total")]
    assert sorted(counted) == [
        'plurai_gateway_requests_total{route="completions",status="404"} 1.0',
        'plurai_gateway_requests_total{route="files",status="404"} 1.0',
    ]


@pytest.mark.parametrize(
    "exc, status, code",
    [
        (OperationalError("the broker is down"), 503, "unavailable"),
        (redis.ConnectionError("refused"), 503, "unavailable"),
        (redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'"), 503, None),
        (redis.ResponseError("WRONGTYPE Operation against a key"), 500, "internal"),
        (BadRecord("the batch record's field 'total' is not a number"), 500, "bad_record"),
    ],
)
def test_outages_and_damaged_records_map_to_their_answers(exc, status, code) -> None:
    """Every endpoint's errors go through the same handlers: a Redis or broker outage is a
    503 to retry, a refused command or a record no Plurai process wrote a 500 naming it."""
    request = Request({"type": "http", "method": "GET", "path": "/v1/batches/x", "headers": []})
    got = errors._response(request, exc)
    assert got.status_code == status
    if code is not None:
        assert json.loads(got.body)["error"]["code"] == code
    if status == 503:
        assert got.headers["Retry-After"]


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
    client = openai_client.OpenAI(base_url="http://localhost/v1", api_key="-", http_client=api)
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


def test_client_status_is_the_4xx_the_handlers_answer():
    """What the gateway's request span reads to tell a client's mistake (no error status)
    from a failure here: the same status the handlers answer."""
    from plurai.gateway.auth import LaneError, Unauthorized
    from plurai.producer.errors import QueueFull, RedisFull
    from plurai.producer.openai_body import BadRequest

    scope = {"type": "http", "headers": [], "method": "POST", "path": "/v1/completions"}
    cases = [
        Unauthorized("no key"),
        LaneError("no such lane"),
        BadRequest("bad", status=413),
        errors.ApiError(404, "gone", "job_expired"),
        errors.model_not_found("m"),
        errors.no_workers(),
        QueueFull("standard", 10, 1.0),
        RedisFull("standard", 1.0),
        redis.ConnectionError("down"),
        BadRecord("damaged"),
        RuntimeError("a bug"),
    ]
    for e in cases:
        answered = errors._response(Request(scope), e).status_code
        assert errors.client_status(e) == (answered if answered < 500 else None), e
