"""The gateway under floods of connections and slow clients, with a bounded local load
generator (loopback only, fixed counts, stops by itself) against a real gateway process
and redis-server, and a stand-in worker that answers at once (fake_stack.py), so that
what is measured is the gateway.

- 2,000 idle connections (half of them stopped mid-headers) and 50 SSE clients reading one
  byte a second, two of them on answers larger than the kernel's socket buffers: 200
  ordinary requests complete within twice their time without the flood, and the gateway's
  resident memory stays bounded;
- each guard, on a gateway with short limits: an idle connection closed, headers sent
  slowly (408), a head too large (431), a body sent slowly (408, nothing queued), a
  kept-alive connection closed when idle, the connection cap (503), the per-key cap on open
  streams (429), and a stream whose client stopped reading ended;
- the shared token-stream reader leaves a stream whose client is behind in Redis."""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import redis
import redis.asyncio

from plurai.broker_config import keys
from plurai.broker_config.embedded import EmbeddedRedis
from plurai.broker_config.settings import Settings
from plurai.gateway import apikeys
from plurai.gateway.streams import MAX_QUEUED, MAX_QUEUED_CHARS, Streams
from plurai.results import tokens

from .fake_stack import BIG_MAX_TOKENS, HUGE_MAX_TOKENS, FakeWorker, GatewayProcess

IDLE = 2000
SLOW = 50
HUGE = 2  # of the slow readers, on answers larger than the kernel buffers
NORMAL = 200
CONCURRENCY = 4
ATTEMPTS = 3  # the 2x bound on a busy 2-core machine: the best of up to 3 measurements
RSS_GROWTH_MIB = 96  # idle connections ~7 KiB each, a slow reader's stream a read batch

SHORT = {
    "PLURAI_GATEWAY_HEADER_TIMEOUT_S": "1.5",
    "PLURAI_GATEWAY_BODY_TIMEOUT_S": "1.5",
    "PLURAI_GATEWAY_KEEPALIVE_S": "1",
    "PLURAI_GATEWAY_STREAM_STALL_S": "2",
    "PLURAI_GATEWAY_MAX_CONNECTIONS": "40",
    "PLURAI_GATEWAY_MAX_STREAMS_PER_KEY": "2",
    "PLURAI_GATEWAY_MAX_HEADER_BYTES": "4096",
}


@pytest.fixture(autouse=True, scope="module")
def file_limit() -> None:
    """2,000 sockets need more than the usual soft limit of 1,024 files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = IDLE + SLOW + 512
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"the open-file hard limit ({hard}) is below {want}")
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


@dataclass
class Stack:
    url: str
    gateway: GatewayProcess
    worker: FakeWorker
    secrets: list[str] = field(default_factory=list)


def _stack(tmp_path_factory, env: dict[str, str], n_keys: int = 0) -> Iterator[Stack]:
    d = tmp_path_factory.mktemp("flood")
    server = EmbeddedRedis(d / "redis")
    url = server.start()
    worker = FakeWorker(url).start()
    secrets = []
    for i in range(n_keys):
        secret, _ = apikeys.create_key(redis.Redis.from_url(url), f"tenant{i}")
        secrets.append(secret)
    gw = GatewayProcess(url, d / "gateway.log", env)
    try:
        yield Stack(url, gw, worker, secrets)
    finally:
        gw.stop()
        worker.stop()
        server.stop()


@pytest.fixture(scope="module")
def flood(tmp_path_factory) -> Iterator[Stack]:
    # production settings, but idle connections outlive the measurement
    yield from _stack(tmp_path_factory, {"PLURAI_GATEWAY_HEADER_TIMEOUT_S": "120"})


@pytest.fixture(scope="module")
def short(tmp_path_factory) -> Iterator[Stack]:
    yield from _stack(tmp_path_factory, SHORT, n_keys=2)


def _request(body: dict, secret: str | None = None, length: int | None = None) -> bytes:
    data = json.dumps(body).encode()
    head = [
        "POST /v1/completions HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {len(data) if length is None else length}",
    ]
    if secret:
        head.append(f"Authorization: Bearer {secret}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


def _completion(max_tokens: int = 8, stream: bool = False) -> dict:
    return {"model": "flood", "prompt": "hi", "max_tokens": max_tokens, "stream": stream}


# -- the load generator -------------------------------------------------------------------


class Flood:
    """IDLE idle connections and SLOW slow SSE readers, until `close`."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[asyncio.StreamWriter] = []
        self.slow: list[socket.socket] = []
        self.readers: list[asyncio.Task] = []
        self.read = [0] * SLOW

    async def open(self) -> None:
        for at in range(0, IDLE, 200):
            pairs = await asyncio.gather(
                *(asyncio.open_connection("127.0.0.1", self.port) for _ in range(200))
            )
            for i, (_, w) in enumerate(pairs):
                if i % 2:  # stopped mid-headers
                    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
                self.idle.append(w)
            assert at + 200 == len(self.idle)
        loop = asyncio.get_running_loop()
        for i in range(SLOW):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.setblocking(False)
            await loop.sock_connect(s, ("127.0.0.1", self.port))
            big = HUGE_MAX_TOKENS if i < HUGE else BIG_MAX_TOKENS
            await loop.sock_sendall(s, _request(_completion(big, stream=True)))
            self.slow.append(s)
            self.readers.append(asyncio.ensure_future(self._trickle(i, s)))

    async def _trickle(self, i: int, s: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            got = await loop.sock_recv(s, 1)
            if not got:
                return
            self.read[i] += 1
            await asyncio.sleep(1)

    def close(self) -> None:
        for t in self.readers:
            t.cancel()
        for w in self.idle:
            w.transport.abort()
        for s in self.slow:
            s.close()


async def _normal(base: str) -> list[float]:
    """NORMAL ordinary completions, CONCURRENCY at a time: each one's seconds."""
    todo = iter(range(NORMAL))
    times: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:

        async def one() -> None:
            for _ in todo:
                t = time.perf_counter()
                r = await client.post("/v1/completions", json=_completion())
                times.append(time.perf_counter() - t)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == " tok" * 8

        await asyncio.gather(*(one() for _ in range(CONCURRENCY)))
    return times


async def _attempt(s: Stack) -> tuple[float, float, float, float]:
    """Medians without and with the flood, the gateway's RSS before and at most during it."""
    base = s.gateway.base
    unloaded = statistics.median(await _normal(base))
    rss_before = s.gateway.rss_mib()
    answered = s.worker.answered
    flood = Flood(s.gateway.port)
    try:
        await flood.open()
        give_up = time.monotonic() + 30
        while s.worker.answered < answered + SLOW:  # every slow reader's answer is written
            assert time.monotonic() < give_up, "the stand-in worker fell behind"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1)  # the gateway sends what the slow readers' sockets take
        loaded = statistics.median(await _normal(base))
        rss_peak = s.gateway.rss_mib()
        assert all(n > 0 for n in flood.read), "a slow reader got nothing"
        assert all(not t.done() for t in flood.readers), "a slow reader was cut off"
        # the two huge answers are still being sent: the gateway holds only their heads
        assert s.gateway.gauge("plurai_gateway_open_streams") >= HUGE
    finally:
        flood.close()
    return unloaded, loaded, rss_before, rss_peak


def test_flood_does_not_delay_others_and_memory_stays_bounded(flood: Stack) -> None:
    async def go() -> list[tuple[float, float, float, float]]:
        await _normal(flood.gateway.base)  # warm-up
        runs = []
        for _ in range(ATTEMPTS):
            runs.append(await _attempt(flood))
            unloaded, loaded, _, _ = runs[-1]
            if loaded <= 2 * unloaded:
                break
            await asyncio.sleep(2)  # the cut streams end; then measure again
        return runs

    runs = asyncio.run(go())
    shown = [
        f"unloaded {u * 1000:.1f} ms, loaded {lo * 1000:.1f} ms, RSS {a:.0f} -> {b:.0f} MiB"
        for u, lo, a, b in runs
    ]
    unloaded, loaded, _, _ = runs[-1]
    assert loaded <= 2 * unloaded, shown
    for _, _, before, peak in runs:
        assert peak - before < RSS_GROWTH_MIB, shown
    # the flood's streams end when their clients go, and the gateway serves on
    give_up = time.monotonic() + 20
    while flood.gateway.gauge("plurai_gateway_open_streams") > 0:
        assert time.monotonic() < give_up, "streams stayed open after their clients left"
        time.sleep(0.2)
    assert httpx.post(flood.gateway.base + "/v1/completions", json=_completion()).status_code == 200


# -- each guard ---------------------------------------------------------------------------


def _connect(s: Stack, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", s.gateway.port))
    sock.settimeout(10)
    return sock


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def _error(raw: bytes) -> tuple[int, dict, dict[str, str]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), json.loads(body)["error"], headers


def test_an_idle_connection_is_closed(short: Stack) -> None:
    sock = _connect(short)
    t = time.monotonic()
    assert _until_closed(sock) == b""  # nothing was asked: nothing is answered
    assert 1.0 < time.monotonic() - t < 8


def test_headers_sent_slowly_get_408(short: Stack) -> None:
    sock = _connect(short)
    t = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
    sock.setblocking(False)
    raw = b""
    for byte in b"Host: 127.0.0.1\r\nX-Slow: " + b"a" * 100:  # a byte every 0.2 s
        try:
            sock.send(bytes([byte]))
            raw += sock.recv(65536)
        except (BlockingIOError, BrokenPipeError, ConnectionResetError):
            pass
        if raw:
            break
        time.sleep(0.2)
    sock.setblocking(True)
    raw += _until_closed(sock)
    status, err, _ = _error(raw)
    assert (status, err["code"]) == (408, "request_timeout")
    assert "PLURAI_GATEWAY_HEADER_TIMEOUT_S" in err["message"]
    assert time.monotonic() - t < 8


def test_a_head_too_large_gets_431(short: Stack) -> None:
    sock = _connect(short)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 8000)
    status, err, _ = _error(_until_closed(sock))
    assert (status, err["code"]) == (431, "headers_too_large")


def test_a_body_sent_slowly_gets_408_and_queues_nothing(short: Stack) -> None:
    r = redis.Redis.from_url(short.url)
    queued = sum(r.xlen(keys.request_stream(lane, "flood")) for lane in Settings().lanes)
    answered = short.worker.answered
    sock = _connect(short)
    request = _request(_completion(), short.secrets[0])
    sock.sendall(request[:-5])  # the body but its last 5 bytes
    status, err, _ = _error(_until_closed(sock))
    assert (status, err["code"]) == (408, "request_timeout")
    assert "PLURAI_GATEWAY_BODY_TIMEOUT_S" in err["message"]
    time.sleep(0.5)
    assert short.worker.answered == answered
    assert sum(r.xlen(keys.request_stream(lane, "flood")) for lane in Settings().lanes) == queued


def test_a_kept_alive_connection_closes_when_idle(short: Stack) -> None:
    sock = _connect(short)
    sock.sendall(_request(_completion(), short.secrets[0]))
    got = sock.recv(65536)
    assert got.startswith(b"HTTP/1.1 200")
    t = time.monotonic()
    _until_closed(sock)
    assert time.monotonic() - t < 6


def test_by_default_a_kept_alive_connection_outlives_the_clients_pools() -> None:
    """Clients drop a pooled connection idle for 5 s (httpx, Go's net/http), load balancers
    after 60 s: a gateway that closed first would race their next request, which fails
    mid-send on the closing connection."""
    assert Settings().gateway_keepalive_s > max(httpx.Limits().keepalive_expiry or 0, 60)


def test_connections_over_the_cap_get_503(short: Stack) -> None:
    held = [_connect(short) for _ in range(40)]
    try:
        time.sleep(0.2)
        sock = _connect(short)
        sock.sendall(_request(_completion(), short.secrets[0]))
        status, err, headers = _error(_until_closed(sock))
        assert (status, err["code"]) == (503, "too_many_connections")
        assert headers["retry-after"] == "1"
        assert "PLURAI_GATEWAY_MAX_CONNECTIONS" in err["message"]
    finally:
        for h in held:
            h.close()
    time.sleep(0.2)
    r = httpx.post(
        short.gateway.base + "/v1/completions",
        json=_completion(),
        headers={"Authorization": f"Bearer {short.secrets[0]}"},
    )
    assert r.status_code == 200


def test_open_streams_are_capped_per_key_and_a_stalled_stream_ends(short: Stack) -> None:
    a, b = short.secrets
    stalled = []
    for _ in range(2):  # key a's two streams, whose client reads nothing
        sock = _connect(short, rcvbuf=4096)
        sock.sendall(_request(_completion(HUGE_MAX_TOKENS, stream=True), a))
        stalled.append(sock)
    give_up = time.monotonic() + 10
    while short.gateway.gauge("plurai_gateway_open_streams") < 2:
        assert time.monotonic() < give_up
        time.sleep(0.1)
    auth_a = {"Authorization": f"Bearer {a}"}
    api = httpx.Client(base_url=short.gateway.base, timeout=30)
    third = api.post("/v1/completions", json=_completion(stream=True), headers=auth_a)
    assert third.status_code == 429
    assert third.json()["error"]["code"] == "too_many_streams"
    assert third.headers["retry-after"] == "1"
    # a's other requests, and b's streams, go on
    assert api.post("/v1/completions", json=_completion(), headers=auth_a).status_code == 200
    other = api.post(
        "/v1/completions", json=_completion(stream=True), headers={"Authorization": f"Bearer {b}"}
    )
    assert other.status_code == 200 and other.text.endswith("data: [DONE]\n\n")
    # the stalled streams are ended after PLURAI_GATEWAY_STREAM_STALL_S: their slots free
    give_up = time.monotonic() + 15
    while short.gateway.gauge("plurai_gateway_open_streams") > 0:
        assert time.monotonic() < give_up, "a stalled stream was never ended"
        time.sleep(0.2)
    for sock in stalled:
        assert b"data: [DONE]" not in _until_closed(sock)  # cut, not finished
    again = api.post("/v1/completions", json=_completion(stream=True), headers=auth_a)
    assert again.status_code == 200 and again.text.endswith("data: [DONE]\n\n")
    assert "took nothing for 2 s" in short.gateway.log.read_text()


# -- the shared reader --------------------------------------------------------------------


def test_the_reader_leaves_a_stream_whose_client_is_behind_in_redis(redis_url: str) -> None:
    """A client that takes nothing holds at most MAX_QUEUED batches or MAX_QUEUED_CHARS of
    text in the gateway; once it takes, reading resumes and it gets every event in order,
    while a second stream, read meanwhile, is never held up."""
    r = redis.Redis.from_url(redis_url)
    n, text = 5000, "y" * 100
    for name in ("slow-job-1", "fast-job-1"):
        pipe = r.pipeline(transaction=False)
        for i in range(n):
            pipe.xadd(keys.output(name), {"type": "delta", "text": f"{i:05d}{text}"})
        pipe.xadd(keys.output(name), {"type": "end", "state": "completed"})
        pipe.execute()

    async def go() -> None:
        ar = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)  # as the gateway's
        streams = Streams(ar)
        slow = streams.batches("slow-job-1")
        first = await anext(slow)  # following it; then its client takes nothing
        fast = [ev async for batch in streams.batches("fast-job-1") for ev in batch]
        assert len(fast) == n + 1 and fast[-1].type == tokens.END
        f = streams.followed[keys.output("slow-job-1")]
        assert f.paused
        assert f.queue.qsize() <= MAX_QUEUED
        assert f.chars < MAX_QUEUED_CHARS + 256 * len(text) + 256 * 5
        events = list(first)
        async for batch in slow:
            events += batch
        assert [e.text[:5] for e in events[:-1]] == [f"{i:05d}" for i in range(n)]
        assert events[-1].type == tokens.END
        await streams.close()
        await ar.aclose()

    asyncio.run(go())
