"""A webhook's URL checks, address checks, signature and body (results/webhook_http.py,
results/webhooks.py), without a network."""

from __future__ import annotations

import json

import pytest

from plurai.results import records, webhook_http, webhooks
from plurai.results.webhook_http import Refused, check_url, sign, verify


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("https://hooks.example.com/a?b=c", ["hooks.example.com"]),
        ("https://HOOKS.Example.com./a", ["hooks.example.com"]),  # case, a trailing dot
        ("https://a.b.example.com/", ["*.example.com"]),
        ("http://[2001:db8::1]:8080/x", ["2001:db8::1"]),
        ("https://anything.test/", ["*"]),
    ],
)
def test_allowed_urls_pass(url: str, allowed: list[str]) -> None:
    assert check_url(url, allowed) == url


@pytest.mark.parametrize(
    ("url", "allowed", "says"),
    [
        ("https://example.com/", ["*.example.com"], "not in PLURAI_WEBHOOK_HOSTS"),  # apex
        ("https://evilexample.com/", ["*.example.com"], "not in PLURAI_WEBHOOK_HOSTS"),
        ("https://example.com.evil.test/", ["example.com"], "not in PLURAI_WEBHOOK_HOSTS"),
        ("https://example.com/", [], "webhooks are off"),
        ("https://u@example.com/", ["*"], "credentials"),
        ("gopher://example.com/", ["*"], "http:// or https://"),
        ("https://example.com:99999/", ["*"], "not a URL"),
        ("https:///path", ["*"], "no host"),
        ("https://example.com/\r\nX-Injected: 1", ["*"], "control characters"),
        ("", ["*"], "http"),
        (None, ["*"], "http"),
    ],
)
def test_refused_urls_say_why(url: object, allowed: list[str], says: str) -> None:
    with pytest.raises(Refused, match=says):
        check_url(url, allowed)


def test_private_addresses_are_refused_unless_allowed() -> None:
    for host in ("127.0.0.1", "10.1.2.3", "169.254.169.254", "::1", "::ffff:127.0.0.1"):
        with pytest.raises(Refused, match="not a public address"):
            webhook_http.address(host, 80, private=False)
        assert webhook_http.address(host, 80, private=True)
    assert webhook_http.address("8.8.8.8", 443, private=False) == "8.8.8.8"


def test_a_post_to_a_refused_address_sends_nothing_and_is_final() -> None:
    answer = webhook_http.post(
        "http://127.0.0.1:9/x", b"{}", {}, allowed=["127.0.0.1"], private=False, timeout=1
    )
    assert not answer.ok and not answer.retry and "not a public address" in answer.error


def test_the_signature_checks_body_secret_and_age() -> None:
    body = b'{"type":"job.ended"}'
    header = sign(b"k", 1_000_000, body)
    assert verify("k", body, header, now=1_000_100)
    assert not verify("k", body, header, now=1_000_400)  # older than the tolerance: a replay
    assert not verify("k", body + b"x", header, now=1_000_000)
    assert not verify("other", body, header, now=1_000_000)
    assert not verify("k", body, None) and not verify("k", body, "t=x,v1=00")
    assert not verify("k", body, header.replace("v1=", "v0="), now=1_000_000)


def test_a_large_result_is_sent_without_its_text() -> None:
    raw = {"state": "completed", "final": "1", "text": "x" * 5000, "token_ids": "[1, 2]"}
    rec = records.JobRecord.from_hash("j1", raw)
    small = json.loads(webhooks.body(rec, 1 << 20))["job"]
    assert small["text"] == "x" * 5000 and small["token_ids"] == [1, 2] and "truncated" not in small
    cut = json.loads(webhooks.body(rec, 1024))["job"]
    assert cut["truncated"] is True and "text" not in cut and cut["state"] == "completed"
    raw["metadata"] = json.dumps({"k": "m" * 4000})
    rec = records.JobRecord.from_hash("j1", raw)
    least = json.loads(webhooks.body(rec, 1024))["job"]  # still valid JSON
    assert least == {"id": "j1", "state": "completed", "truncated": True}


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b'{"url": 5, "since_ms": 1, "attempts": 0}',
        b'{"url": "http://a/", "since_ms": true, "attempts": 0}',
        b'{"url": "http://a/", "since_ms": 1, "attempts": -1}',
        json.dumps({"url": "h" * 3000, "since_ms": 1, "attempts": 0}).encode(),
        b"[]",
    ],
)
def test_watches_not_written_by_plurai_are_not_read(raw: bytes) -> None:
    assert webhooks.Watch.parse(raw) is None
