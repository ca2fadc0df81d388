"""One OpenAI body, one job: the same chat or completion body sent live to the gateway and
as a batch input line gives the same job options (defaults, bounds, text parts, extras),
less what each path sets itself (the served model, the lane; a batch's stream and keys)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from starlette.testclient import TestClient

from plurai.broker_config.settings import Settings
from plurai.gateway import app as gateway_app
from plurai.producer.bulk.inputs import LineError, parse_line
from tests.helpers import gateway, serve_model

MODEL = "m"
DEFAULT_MAX = 77  # the gateway's default max_tokens, given to both paths
LIMIT = 4096

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 9},
    {
        "messages": [
            {
                "role": "system",
                "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
            },
            {"role": "user", "content": "hi", "name": "ann"},
        ],
        "max_completion_tokens": 12,
        "max_tokens": 30,
    },
    {
        "messages": [{"role": "user", "content": "hi"}],
        "top_k": 5,
        "min_p": 0.1,
        "seed": 3,
        "stop": "\n",
        "presence_penalty": 0.5,
        "repetition_penalty": 1.1,
        "priority": -2,
        "metadata": {"k": "v"},
        "n": 1,
        "user": "u",
        "stream": False,
        "response_format": {"type": "json_object"},
    },
]
COMPLETIONS: list[dict[str, Any]] = [
    {"prompt": "once"},
    {"prompt": ["once"], "temperature": 0.3, "max_tokens": 5, "stop": ["a", "b"]},
    {"prompt": [5, 6, 7], "top_p": 0.9, "ignore_eos": True, "stop_token_ids": [3]},
    {"prompt": "x", "regex": "[ab]+", "frequency_penalty": 0.2, "echo": False, "best_of": 1},
]


@pytest.fixture
def api(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, list]]:
    """The gateway, stopped at the point where it would queue a job: what it would queue
    is appended to the list, and the request answered 400."""
    r = redis.Redis.from_url(redis_url)
    serve_model(r, MODEL, max_model_len=8192)
    queued: list[dict[str, Any]] = []

    def capture(settings: Settings, routes: Any, **options: Any) -> Any:
        queued.append(options)
        raise ValueError("captured")

    monkeypatch.setattr(gateway_app, "prepare", capture)
    with gateway(redis_url, gateway_default_max_tokens=DEFAULT_MAX) as c:
        yield c, queued
    r.close()


def live(api: tuple[TestClient, list], url: str, body: dict[str, Any]) -> dict[str, Any]:
    client, queued = api
    resp = client.post(url, json={"model": MODEL, **body})
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "captured", resp.text
    options = dict(queued.pop())
    assert options.pop("model") == MODEL
    options.pop("lane")  # the key's lane policy sets it; a batch runs in the batch lane
    return options


def batch(url: str, body: dict[str, Any], with_model: bool = True) -> dict[str, Any]:
    line = {"custom_id": "c", "method": "POST", "url": url, "body": body}
    if with_model:
        body = line["body"] = {"model": MODEL, **body}
    req = parse_line(
        json.dumps(line),
        1,
        documents=False,
        max_line_bytes=1 << 20,
        max_tokens_limit=LIMIT,
        default_max_tokens=DEFAULT_MAX,
    )
    assert req["model"] == (MODEL if with_model else None)
    return req["options"]


@pytest.mark.parametrize("body", CHATS)
def test_a_chat_body_is_the_same_job_live_and_in_a_batch(api, body):
    options = live(api, "/v1/chat/completions", body)
    assert options == batch("/v1/chat/completions", body)
    assert options == batch("/v1/chat/completions", body, with_model=False)


@pytest.mark.parametrize("body", COMPLETIONS)
def test_a_completion_body_is_the_same_job_live_and_in_a_batch(api, body):
    assert live(api, "/v1/completions", body) == batch("/v1/completions", body)


def test_the_defaults_are_the_same_on_both_paths(api):
    chat = live(api, "/v1/chat/completions", CHATS[0])
    comp = live(api, "/v1/completions", COMPLETIONS[0])
    # OpenAI's defaults: temperature 1, a completion 16 tokens; a chat the gateway's default
    assert chat["temperature"] == comp["temperature"] == 1.0
    assert (chat["max_tokens"], comp["max_tokens"]) == (DEFAULT_MAX, 16)
    assert chat["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "extra, code",
    [
        ({"lane": "interactive"}, "invalid_body"),
        ({"background": True}, "invalid_body"),
        ({"logprobs": True}, "invalid_body"),
        ({"tools": []}, "invalid_body"),
        ({"max_tokens": LIMIT + 1}, "max_tokens_over_limit"),
        ({"max_tokens": 0}, "invalid_body"),
        ({"temperature": "hot"}, None),  # a value the worker judges, as it does live
    ],
)
def test_a_batch_line_refuses_what_it_cannot_honour(extra, code):
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    if code is None:
        assert batch("/v1/chat/completions", body)["temperature"] == "hot"
        return
    with pytest.raises(LineError) as e:
        batch("/v1/chat/completions", body)
    assert e.value.code == code and e.value.custom_id == "c"
    assert next(iter(extra)) in e.value.message


def test_a_batch_completion_line_refuses_logprobs_0_and_takes_false():
    """A completion's logprobs: 0 asks for the chosen token's logprob (which a batch output
    line cannot hold); a chat's logprobs: false asks for none."""
    body = {"prompt": "hi", "logprobs": 0}
    with pytest.raises(LineError, match="logprobs"):
        batch("/v1/completions", body)
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": False}
    assert batch("/v1/chat/completions", chat)["messages"]
