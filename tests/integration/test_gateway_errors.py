"""The HTTP gateway's answers to bad input: a real gateway process, a real redis-server
and real workers (tests/integration/test_gateway.py's module fixture). Bad input gets the
documented status and Plurai's code; malformed and huge bodies are refused; no client
input, however hostile, gets a 500.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plurai.producer import openai_body

from .test_gateway import (
    MAX_MODEL_LEN,
    Stack,
    _schema,
    stack_fixture,  # noqa: F401 - the `stack` fixture, one for this module
)

BAD = [
    ({"temperature": "hot"}, 400, "invalid_params"),
    ({"top_p": 0}, 400, "invalid_params"),
    ({"max_tokens": 0}, 400, "invalid_params"),
    ({"max_tokens": -3}, 400, "invalid_params"),
    ({"max_tokens": "ten"}, 400, "bad_field"),
    ({"priority": "high"}, 400, "bad_field"),
    ({"prompt": None}, 400, "invalid_prompt"),
    ({"max_tokens": 10**6}, 400, "max_tokens_over_limit"),
    ({"temprature": 0.5}, 400, "bad_field"),
    ({"prompt": ""}, 400, "invalid_prompt"),
    ({"prompt": 42}, 400, "invalid_prompt"),
    ({"prompt": [5] * (MAX_MODEL_LEN + 10)}, 400, "prompt_too_long"),
    ({"prompt": [5, 99999]}, 400, "token_out_of_vocab"),
    ({"prompt": "caf\ud800"}, 400, "invalid_utf8"),
    ({"model": "gpt-17"}, 404, "model_not_found"),
    ({"n": 0}, 400, "invalid_params"),
    ({"n": 1.5}, 400, "bad_field"),
    ({"n": "2"}, 400, "bad_field"),
    ({"n": 17}, 400, "n_over_limit"),  # over PLURAI_MAX_N (16)
    ({"tools": []}, 400, "bad_field"),
    ({"stream": "yes"}, 400, "bad_field"),
    # structured output: refused with the reason, before the job takes KV blocks
    ({"response_format": {"type": "xml"}}, 400, "invalid_params"),
    ({"response_format": _schema({"type": "object", "not": {}})}, 400, "invalid_params"),
    ({"response_format": _schema({"type": "objekt"})}, 400, "invalid_params"),
    ({"regex": "(unclosed"}, 400, "invalid_params"),
    ({"choice": []}, 400, "invalid_params"),
    ({"regex": "a", "choice": ["a"]}, 400, "invalid_params"),
    ({"choice": ["x" * 70_000]}, 413, "too_large"),
]


@pytest.mark.parametrize(("fields", "status", "code"), BAD, ids=[str(b[0])[:40] for b in BAD])
def test_bad_input_gets_its_status_and_code(stack: Stack, fields, status, code) -> None:
    body = {"model": stack.model, "prompt": "hello", "max_tokens": 4, **fields}
    for stream in (False, True):
        r = httpx.post(
            stack.gateway.base + "/v1/completions",
            content=json.dumps({**body, "stream": fields.get("stream", stream)}),
            timeout=60,
        )
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == code and err["message"]


def test_malformed_and_huge_bodies(stack: Stack) -> None:
    url = stack.gateway.base + "/v1/chat/completions"
    r = httpx.post(url, content=b"{model: x", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_body"
    r = httpx.post(url, content=b"[1, 2]", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_body"
    for messages in (
        [{"role": "user"}],
        [],
        "hi",
        [{"role": "user", "content": [{"type": "image_url"}]}],
    ):
        body = {"model": stack.model, "messages": messages, "max_tokens": 2}
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_prompt", r.text
    r = httpx.post(url, content=b"x" * (100 << 20), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    # the gateway still serves
    ok = stack.api.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert ok.usage.completion_tokens == 3


FIELDS = sorted(set(openai_body.CHAT) | set(openai_body.COMPLETION) | {"tools", "x"})
VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=6),
    chat=st.booleans(),
    stream=st.booleans(),
)
def test_client_input_never_gets_a_500(stack: Stack, body: dict, chat: bool, stream: bool) -> None:
    """Hostile bodies (every known field with values of any JSON type): never a 500, always
    OpenAI's error shape when refused."""
    body = {"model": stack.model, "max_tokens": 2, **body}
    if stream:
        body["stream"] = True
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(stack.gateway.base + path, content=json.dumps(body), timeout=60)
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["code"] and err["message"]
