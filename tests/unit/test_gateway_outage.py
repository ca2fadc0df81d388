"""The gateway with its Redis gone: every route answers 503 `unavailable` with Retry-After
in OpenAI's error shape, never a 500 (Starlette's test client; the Redis URL names a port
nothing listens on)."""

from __future__ import annotations

import pytest

from plurai.broker_config.embedded import free_port
from tests.helpers import gateway


@pytest.fixture
def api():
    with gateway(f"redis://127.0.0.1:{free_port()}/0") as c:
        yield c


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}),
        (
            "POST",
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        ),
        ("GET", "/v1/models", None),
        ("GET", "/v1/batches", None),
        ("GET", "/v1/batches/batch_0123456789abcdef", None),
    ],
)
def test_no_redis_is_503_unavailable(api, method, path, body):
    r = api.request(method, path, json=body)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == "unavailable" and err["type"] == "server_error"
    assert "Redis" in err["message"]


def test_health_says_redis_is_down(api):
    r = api.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "redis unavailable"}


def test_why_is_logged_once_a_second(api, caplog, monkeypatch):
    """An operator sees why requests got 503: the exception, in one line a second at most,
    with the count of the requests it stood for."""
    from plurai.gateway import errors

    monkeypatch.setattr(errors, "_unavailable", errors._Unavailable())
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    with caplog.at_level("WARNING", logger="plurai.gateway"):
        for _ in range(3):
            assert api.post("/v1/completions", json=body).status_code == 503
    lines = [r.getMessage() for r in caplog.records if "Redis unavailable" in r.getMessage()]
    assert len(lines) == 1 and "ConnectionError" in lines[0], lines
    errors._unavailable.last -= 1.0  # a second later: the next line counts the two
    with caplog.at_level("WARNING", logger="plurai.gateway"):
        api.post("/v1/completions", json=body)
    lines = [r.getMessage() for r in caplog.records if "Redis unavailable" in r.getMessage()]
    assert len(lines) == 2 and "(2 more since the last line)" in lines[1], lines
