"""Completion webhooks: a job submitted with `webhook=` is POSTed, signed, to that URL once
it ends (completed, failed or cancelled), by `plurai webhooks`; a receiver that fails is
tried again, one that refuses is not; a URL or address the operator did not allow is never
called; hostile watches in Redis are dropped and the notifier goes on."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from plurai.broker_config import keys, stats
from plurai.broker_config.connection import connect
from plurai.broker_config.settings import Settings
from plurai.producer.client import Client
from plurai.results import records, webhooks
from plurai.results.webhook_http import SIGNATURE, verify
from tests.helpers import driven_worker, plurai, turn_until

SECRET = "s3cret-for-tests"


class Receiver:
    """A webhook receiver on 127.0.0.1: records each POST, answers from `answers` (then 200)."""

    def __init__(self) -> None:
        self.posts: list[tuple[dict[str, str], bytes]] = []
        self.answers: list[int] = []
        me = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                me.posts.append((dict(self.headers.items()), body))
                self.send_response(me.answers.pop(0) if me.answers else 200)
                self.end_headers()

            def log_message(self, *_a: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/plurai?tenant=a"

    def jobs(self) -> list[dict]:
        return [json.loads(body)["job"] for _, body in self.posts]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rx = Receiver()
    yield rx
    rx.server.shutdown()


def _settings(url: str, **fields: object) -> Settings:
    fields = {
        "webhook_hosts": ["127.0.0.1"],
        "webhook_private": True,
        "webhook_secret": SECRET,
        "webhook_retry_s": 0.2,
        "webhook_poll_s": 0.2,
        **fields,
    }
    return Settings(redis_url=url, **fields)


class Running:
    """A Notifier in a thread of this process."""

    def __init__(self, url: str, settings: Settings) -> None:
        self.stop = threading.Event()
        self.notifier = webhooks.Notifier(connect(url), settings)
        self.thread = threading.Thread(target=self.notifier.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def _until(check, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_a_finished_job_is_posted_once_signed(redis_url, tiny_engine, receiver) -> None:
    settings = _settings(redis_url)
    notifier = Running(redis_url, settings)
    w = driven_worker(redis_url, tiny_engine, settings=settings)
    try:
        with Client(redis_url, settings=settings) as client:
            job = client.submit("Hello", max_tokens=4, webhook=receiver.url, metadata={"o": 7})
            plain = client.submit("Hello", max_tokens=4)  # no webhook: nothing is sent
            turn_until(w, lambda: job.record().final and plain.record().final)
            _until(lambda: job.record().raw.get("webhook_state") == "delivered")
            rec = job.record()
        time.sleep(0.5)  # a second POST would come within a poll
        assert len(receiver.posts) == 1
        headers, body = receiver.posts[0]
        assert verify(SECRET, body, headers[SIGNATURE])
        assert not verify(SECRET, body + b" ", headers[SIGNATURE])  # the body is what is signed
        assert not verify("another", body, headers[SIGNATURE])
        assert headers["Plurai-Job-Id"] == job.id and headers["Plurai-Attempt"] == "1"
        sent = json.loads(body)
        assert sent["type"] == "job.ended"
        assert sent["job"]["id"] == job.id and sent["job"]["state"] == "completed"
        assert sent["job"]["text"] == rec.text and sent["job"]["token_ids"] == rec.token_ids
        assert sent["job"]["metadata"] == {"o": 7}
        assert rec.raw["webhook_attempts"] == "1" and rec.raw["webhook_status"] == "200"
        r = connect(redis_url)
        assert r.hlen(keys.WEBHOOKS) == 0 and r.zcard(keys.WEBHOOKS_DUE) == 0
        assert stats.webhook_counts(r)["delivered"] == 1
        snap = stats.snapshot(r, settings.lanes)
        assert snap.totals["webhooks_delivered"] == 1 and snap.totals["webhooks_waiting"] == 0
    finally:
        notifier.close()
        w.cancels.close()


def test_a_failing_receiver_is_tried_again_a_refusing_one_is_not(
    redis_url, tiny_engine, receiver
) -> None:
    settings = _settings(redis_url)
    w = driven_worker(redis_url, tiny_engine, settings=settings)
    notifier = Running(redis_url, settings)
    try:
        with Client(redis_url, settings=settings) as client:
            receiver.answers = [503, 429]
            flaky = client.submit("one", max_tokens=2, webhook=receiver.url)
            turn_until(w, lambda: flaky.record().final)
            _until(lambda: flaky.record().raw.get("webhook_state") == "delivered")
            assert [h["Plurai-Attempt"] for h, _ in receiver.posts] == ["1", "2", "3"]
            assert flaky.record().raw["webhook_attempts"] == "3"
            receiver.answers = [404]
            refused = client.submit("two", max_tokens=2, webhook=receiver.url)
            turn_until(w, lambda: refused.record().final)
            _until(lambda: refused.record().raw.get("webhook_state") == "failed")
            time.sleep(0.6)
            assert len(receiver.posts) == 4  # a 4xx is final
            rec = refused.record()
            assert rec.raw["webhook_status"] == "404" and rec.raw["webhook_error"] == "HTTP 404"
    finally:
        notifier.close()
        w.cancels.close()


def test_a_receiver_down_is_given_up_after_its_attempts(redis_url) -> None:
    settings = _settings(redis_url, webhook_attempts=2, webhook_retry_s=0.1)
    notifier = Running(redis_url, settings)
    try:
        with Client(redis_url, settings=settings) as client:
            job = client.submit("x", webhook="http://127.0.0.1:9/nobody")  # discard port
            assert job.cancel() == "cancelled"
            _until(lambda: job.record().raw.get("webhook_state") == "failed")
            rec = job.record()
            assert rec.raw["webhook_attempts"] == "2" and rec.raw["webhook_status"] == "0"
            assert "ConnectionRefused" in rec.raw["webhook_error"]
    finally:
        notifier.close()


def test_a_cancelled_job_is_told_and_a_missed_end_is_found(redis_url, receiver) -> None:
    """The notifier down when the job ended (its done message lost): the job's look, at
    its time, finds it ended."""
    settings = _settings(redis_url)
    with Client(redis_url, settings=settings) as client:
        job = client.submit("never runs", webhook=receiver.url)
        assert job.cancel() == "cancelled"
    notifier = Running(redis_url, settings)
    try:
        _until(lambda: len(receiver.posts) == 1)
        assert receiver.jobs()[0]["state"] == "cancelled"
    finally:
        notifier.close()


def test_a_private_address_is_never_called(redis_url, receiver) -> None:
    """127.0.0.1 is on the allow-list, but PLURAI_WEBHOOK_PRIVATE is off: refused at
    delivery, and the receiver never hears of it."""
    settings = _settings(redis_url, webhook_private=False)
    notifier = Running(redis_url, settings)
    try:
        with Client(redis_url, settings=settings) as client:
            job = client.submit("x", webhook=receiver.url)
            job.cancel()
            _until(lambda: job.record().raw.get("webhook_state") == "failed")
            rec = job.record()
            assert "not a public address" in rec.raw["webhook_error"]
            assert rec.raw["webhook_attempts"] == "1"  # an address refused is not retried
        time.sleep(0.3)
        assert receiver.posts == []
    finally:
        notifier.close()


@pytest.mark.parametrize(
    ("url", "hosts", "says"),
    [
        ("http://127.0.0.1:1/x", [], "webhooks are off"),
        ("http://169.254.169.254/latest/meta-data", ["127.0.0.1"], "not in PLURAI_WEBHOOK_HOSTS"),
        ("http://user:pw@127.0.0.1/x", ["127.0.0.1"], "credentials"),
        ("file:///etc/passwd", ["*"], "http:// or https://"),
        ("http://127.0.0.1/" + "a" * 3000, ["127.0.0.1"], "at most 2048"),
        (42, ["*"], r"must be an http\(s\) URL"),
    ],
)
def test_a_webhook_not_allowed_is_refused_at_submit(redis_url, url, hosts, says) -> None:
    settings = Settings(redis_url=redis_url, webhook_hosts=hosts)
    with Client(redis_url, settings=settings) as client:
        with pytest.raises(ValueError, match=says):
            client.submit("x", webhook=url)
    r = connect(redis_url)
    assert r.hlen(keys.WEBHOOKS) == 0 and r.xlen(keys.request_stream("standard")) == 0


def test_hostile_watches_are_dropped_and_the_notifier_goes_on(redis_url, receiver) -> None:
    r = connect(redis_url)
    settings = _settings(redis_url)
    r.hset(keys.WEBHOOKS, mapping={"bogus-json": "{not json", "j-bad": '{"url": 5}'})
    r.zadd(keys.WEBHOOKS_DUE, {"bogus-json": 0, "j-bad": 0, "only-in-due": 0, "x" * 300: 0})
    # a raw client's watch of a job whose URL is off the allow-list: refused at delivery
    with Client(redis_url, settings=settings) as client:
        job = client.submit("x")
        job.cancel()
        watch = {"url": "http://10.0.0.1/x", "since_ms": records.now_ms(), "attempts": 0}
        r.hset(keys.WEBHOOKS, job.id, json.dumps(watch))
        r.zadd(keys.WEBHOOKS_DUE, {job.id: 0})
        good = client.submit("y", webhook=receiver.url)
        good.cancel()
    notifier = Running(redis_url, settings)
    try:
        _until(lambda: len(receiver.posts) == 1 and r.zcard(keys.WEBHOOKS_DUE) == 0)
        assert r.hlen(keys.WEBHOOKS) == 0
        assert "not in PLURAI_WEBHOOK_HOSTS" in job.record().raw["webhook_error"]
        assert receiver.jobs()[0]["id"] == good.id
        assert stats.webhook_counts(r) == {"waiting": 0, "delivered": 1, "failed": 1, "dropped": 4}
    finally:
        notifier.close()


def test_the_notifier_needs_a_secret_and_the_cli_says_so(redis_url) -> None:
    with pytest.raises(ValueError, match="PLURAI_WEBHOOK_SECRET"):
        webhooks.Notifier(connect(redis_url), Settings(redis_url=redis_url))
    out = plurai(redis_url, "webhooks")
    assert out.returncode == 2 and "PLURAI_WEBHOOK_SECRET" in out.stderr
