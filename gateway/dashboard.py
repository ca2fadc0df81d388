"""The dashboard: a read-only web page of the queue, the workers, recent jobs, dead
letters and bulk batches, served by the gateway at /dashboard and by `plurai dashboard`
on its own.

    GET /dashboard              the page (static/dashboard.html, .js, .css: no CDN)
    GET /dashboard/data?since=  one reading as JSON, with the history samples after
                                `since` (unix ms) for the charts

The page polls the data endpoint every PLURAI_DASHBOARD_REFRESH_S. Readings are shared:
any number of open pages cost one reading per refresh interval per process. A reading
is `plurai status`'s snapshot (broker_config/stats.py) plus the newest entries of
plurai:recent (the jobs workers began) with their records, of plurai:dead and of the
batches index, each read with a fixed COUNT: its Redis commands do not grow with the
backlog. Samples for the charts (waiting, oldest wait, throughput per model and lane)
are also taken in the background every PLURAI_DASHBOARD_SAMPLE_S, so a page opened
after an alert shows the minutes before it.

Access: as the gateway's API, plus the admin scope (`plurai keys create --admin`) once
keys exist; without keys only a process listening on loopback serves it. Browsers send
the key as the password of HTTP Basic (any user name), which the 401 asks for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from importlib import resources
from typing import Any

import redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from plurai.broker_config import keys, protocol, stats
from plurai.broker_config.connection import connect, redact
from plurai.broker_config.settings import Settings
from plurai.broker_config.text import text
from plurai.gateway.auth import Guard, Unauthorized
from plurai.producer import dead_letters as dead
from plurai.producer.bulk.store import BATCH_ID

log = logging.getLogger("plurai.gateway")

RECENT_JOBS = 50  # rows of the recent jobs table
DEAD_SHOWN = 10
BATCHES_SHOWN = 10
_JOB_FIELDS = (
    "state",
    "worker",
    "priority",
    "created_ms",
    "started_ms",
    "first_token_ms",
    "finished_ms",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "finish_reason",
    "error_code",
)
_INTS = frozenset(f for f in _JOB_FIELDS if f.endswith(("_ms", "_tokens")) or f == "priority")
_BATCH_FIELDS = ("status", "total", "completed", "failed", "created_ms", "tenant")
ASSETS = {  # file -> media type; the page loads nothing else
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
# scripts and styles from these files only: a job id or error text shown is never code
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
SHORT = 200  # characters of any free text shown (error messages)


def _str(v: Any, limit: int = 128) -> str | None:
    """Reply bytes as bounded text; None for nothing."""
    if v is None:
        return None
    return text(v)[:limit]


def _int(v: Any) -> int | None:
    """A reply that should hold an integer; None where it holds anything else."""
    s = _str(v, 24)
    if s is None:
        return None
    try:
        return int(s)
    except ValueError:
        return None


# -- reading Redis ----------------------------------------------------------------------


def recent_jobs(r: redis.Redis, n: int = RECENT_JOBS) -> list[dict[str, Any]]:
    """The jobs workers began last, newest first (a job taken again shows once), with
    what their records say now: two round trips."""
    seen: dict[str, dict[str, Any]] = {}
    for _, fields in r.xrevrange(keys.RECENT, count=2 * n):
        f = {text(k): v for k, v in fields.items()}
        job_id = _str(f.get("id"), 129)  # one over the longest id: a longer one fails
        if job_id is None or not protocol.valid_job_id(job_id) or job_id in seen:
            continue
        seen[job_id] = {"id": job_id, "model": _str(f.get("model")), "lane": _str(f.get("lane"))}
        if len(seen) == n:
            break
    pipe = r.pipeline(transaction=False)
    for job_id in seen:
        pipe.hmget(keys.job(job_id), _JOB_FIELDS)
    out = []
    for row, reply in zip(seen.values(), pipe.execute(raise_on_error=False), strict=True):
        if isinstance(reply, Exception):  # not a hash: written by something else
            row["state"] = "bad_record"
        else:
            for name, v in zip(_JOB_FIELDS, reply, strict=True):
                row[name] = _int(v) if name in _INTS else _str(v)
            row["state"] = row["state"] or "expired"  # its record is gone
            first, since = row["first_token_ms"], row["created_ms"] or row["started_ms"]
            row["ttft_ms"] = first - since if first and since and first >= since else None
        out.append(row)
    return out


def dead_letters(r: redis.Redis, n: int = DEAD_SHOWN) -> dict[str, Any]:
    pipe = r.pipeline(transaction=False)
    pipe.xlen(keys.DEAD_LETTER)
    pipe.xrevrange(keys.DEAD_LETTER, count=n)
    length, entries = pipe.execute()
    recent = []
    for entry_id, fields in entries:
        f = {text(k): v for k, v in fields.items()}
        recent.append(
            {
                "id": text(entry_id),
                "at_ms": int(text(entry_id).split("-")[0]),
                "lane": _str(f.get("lane"), 64),
                "job_id": dead.job_id_of(fields),
                "error": _str(f.get("error"), SHORT),
                "worker": _str(f.get("worker")),
                "requeueable": "entry" in f,  # `plurai dead-letters requeue <id>` can run it
            }
        )
    return {"count": int(length), "recent": recent}


def batches(r: redis.Redis, n: int = BATCHES_SHOWN) -> list[dict[str, Any]]:
    """The newest bulk batches with their progress."""
    ids = [text(b) for b in r.zrevrange(keys.BATCHES, 0, n - 1)]
    ids = [b for b in ids if BATCH_ID.fullmatch(b)]
    pipe = r.pipeline(transaction=False)
    for b in ids:
        pipe.hmget(keys.batch(b), _BATCH_FIELDS)
    out = []
    for b, reply in zip(ids, pipe.execute(raise_on_error=False), strict=True):
        if isinstance(reply, Exception) or reply[0] is None:
            continue  # expired, or not a batch record
        row: dict[str, Any] = {"id": b}
        for name, v in zip(_BATCH_FIELDS, reply, strict=True):
            row[name] = _str(v, 64) if name in ("status", "tenant") else _int(v)
        out.append(row)
    return out


# a reading's per-lane counters of each worker: (unix ms, {worker id: (model, lanes_done)})
Counts = tuple[int, dict[str, tuple[str, dict[str, list[int]]]]]


def sample(snap: stats.Snapshot, before: Counts | None) -> tuple[dict[str, Any], Counts]:
    """One point of the charts, and the counters for the next one: per model and lane
    [model, lane, waiting, pending, oldest wait s, jobs ended/s, their tokens/s] (the
    rates since `before`, over the workers in both readings: one that joins or leaves
    adds no jump; None for the first point); per model [model, live tok/s, running]."""
    t = int(snap.time_s * 1000)
    now = {w.id: (w.served_model, w.lanes_done) for w in snap.workers}
    per_model: dict[str, list[Any]] = {}
    for w in snap.workers:
        m = per_model.setdefault(w.served_model, [w.served_model, 0.0, 0])
        m[1] = round(m[1] + w.tokens_per_s, 1)
        m[2] += w.running
    rates: dict[tuple[str, str], list[float]] | None = None
    if before is not None and t > before[0]:
        rates = {}
        for wid, (model, lanes) in now.items():
            if wid not in before[1]:
                continue  # new: its counts since it started are no rate
            old = before[1][wid][1]
            for lane, (jobs, tokens) in lanes.items():
                was = old.get(lane, [0, 0])  # a lane it had ended no job of yet: 0
                if jobs >= was[0] and tokens >= was[1]:
                    r = rates.setdefault((model, lane), [0.0, 0.0])
                    r[0] += (jobs - was[0]) * 1000 / (t - before[0])
                    r[1] += (tokens - was[1]) * 1000 / (t - before[0])
    rows = []
    for q in snap.lanes:
        rate = (rates or {}).get((q.model, q.name), [0.0, 0.0])
        row = [q.model, q.name, q.waiting, q.pending, round(q.oldest_waiting_age_s or 0.0, 1)]
        rows.append(
            row + ([round(rate[0], 2), round(rate[1], 1)] if rates is not None else [None, None])
        )
    point = {"t": t, "lanes": rows, "models": list(per_model.values())}
    return point, (t, now)


def read(
    r: redis.Redis, settings: Settings, full: bool = True
) -> tuple[stats.Snapshot, dict[str, Any]]:
    """One reading: the snapshot, and (full) recent jobs, dead letters and batches."""
    snap = stats.snapshot(r, settings.lanes, settings.model)
    out: dict[str, Any] = {"snapshot": snap.to_dict()}
    if full:
        out["jobs"] = _or(recent_jobs, r, [])
        out["dead_letters"] = _or(dead_letters, r, {"count": 0, "recent": []})
        out["batches"] = _or(batches, r, [])
    return snap, out


def _or(reader: Any, r: redis.Redis, empty: Any) -> Any:
    """What `reader` reads, or `empty` where its key holds another type (written by
    something else): the rest of the page still shows."""
    try:
        return reader(r)
    except redis.ResponseError as e:
        if "WRONGTYPE" not in str(e):
            raise
        log.warning("dashboard: %s: a key of another type (%s)", reader.__name__, e)
        return empty


# -- serving ----------------------------------------------------------------------------


class Dashboard:
    """The page, its data endpoint and the background sampler of one process. `guard`
    (set in `start`): the API keys of the Redis read."""

    def __init__(self, settings: Settings, url: str) -> None:
        self.settings = settings
        self.url = url
        self.r: redis.Redis | None = None
        self.guard: Guard | None = None
        # samples at least a second apart, the oldest dropped past history_s
        self.history: deque[dict[str, Any]] = deque(maxlen=settings.dashboard_history_s + 1)
        self.last: tuple[float, dict[str, Any]] | None = None  # (monotonic, full reading)
        self.reading: asyncio.Future[dict[str, Any]] | None = None
        self.sampler: asyncio.Task | None = None
        self.failing = False  # Redis unreachable at the last sample (logged once)
        self.counts: Counts | None = None  # the last reading's, for the next point's rates

    def start(self, guard: Guard) -> None:
        """On the server's loop, when it starts."""
        self.guard = guard
        self.r = connect(self.url)  # its own (blocking) client: readings run in a thread
        self.sampler = asyncio.get_running_loop().create_task(self._sample_forever())

    async def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.cancel()
            await asyncio.gather(self.sampler, return_exceptions=True)
        if self.r is not None:
            self.r.close()

    def routes(self) -> list[Route]:
        return [
            Route("/dashboard", self.page, methods=["GET"]),
            Route("/dashboard/data", self.data, methods=["GET"]),
            *(
                Route(f"/dashboard/{name}", self.asset, methods=["GET"])
                for name in ASSETS
                if name != "dashboard.html"
            ),
        ]

    # -- access ---------------------------------------------------------------------------

    async def admitted(self, request: Request) -> Response | None:
        """None when the request may read the dashboard, else the 401 to answer."""
        assert self.guard is not None
        try:
            headers = request.headers
            key = await self.guard.key(headers.get("authorization"), headers.get("host"), True)
        except Unauthorized as e:
            return _unauthorized(str(e))
        if key is not None and not key.admin:
            return _unauthorized(
                f"API key {key.id} has no admin scope; the dashboard needs one made with "
                "`plurai keys create --tenant NAME --admin`"
            )
        return None

    # -- endpoints ------------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        return await self.asset(request, "dashboard.html")

    async def asset(self, request: Request, name: str | None = None) -> Response:
        refused = await self.admitted(request)
        if refused is not None:
            return refused
        name = name or request.url.path.rsplit("/", 1)[1]
        return Response(_asset(name), media_type=ASSETS[name], headers=HEADERS)

    async def data(self, request: Request) -> Response:
        refused = await self.admitted(request)
        if refused is not None:
            return refused
        since = request.query_params.get("since", "0")
        since_ms = int(since) if since.isascii() and since.isdigit() and len(since) < 16 else 0
        try:
            reading = await self.fresh()
        except (redis.RedisError, ValueError) as e:  # unreachable, or holding what no
            # Plurai process writes (the model directory, say)
            return JSONResponse(
                {"error": f"cannot read Redis: {redact(str(e))}"}, 503, headers=HEADERS
            )
        body = {
            **reading,
            "history": [s for s in self.history if s["t"] > since_ms],
            "refresh_s": self.settings.dashboard_refresh_s,
            "history_s": self.settings.dashboard_history_s,
        }
        return JSONResponse(body, headers=HEADERS)

    # -- readings -------------------------------------------------------------------------

    async def fresh(self) -> dict[str, Any]:
        """A full reading at most half a refresh interval old: one in flight is shared."""
        if self.last is not None and time.monotonic() - self.last[0] < (
            self.settings.dashboard_refresh_s / 2
        ):
            return self.last[1]
        if self.reading is None or self.reading.done():
            self.reading = asyncio.ensure_future(self._read(full=True))
        return await asyncio.shield(self.reading)

    async def _read(self, full: bool) -> dict[str, Any]:
        assert self.r is not None
        snap, reading = await asyncio.to_thread(read, self.r, self.settings, full)
        if full:
            self.last = (time.monotonic(), reading)
        if self.history and snap.time_s * 1000 - self.history[-1]["t"] < 1000:
            return reading  # a point a second at most: its rates cover the time since
        point, self.counts = sample(snap, self.counts)
        self.history.append(point)
        while self.history[0]["t"] < point["t"] - 1000 * self.settings.dashboard_history_s:
            self.history.popleft()
        return reading

    async def _sample_forever(self) -> None:
        every = self.settings.dashboard_sample_s
        while True:
            last = self.last[0] if self.last is not None else -every
            if time.monotonic() - last >= every:  # no page read it meanwhile
                try:
                    await self._read(full=False)
                    if self.failing:
                        log.info("dashboard: Redis readable again")
                    self.failing = False
                except Exception as e:  # logged once an outage; it must not end the sampling
                    if not self.failing:
                        log.warning("dashboard: cannot sample Redis (%s)", redact(repr(e)))
                    self.failing = True
            await asyncio.sleep(every)


def _unauthorized(message: str) -> Response:
    return JSONResponse(
        {"error": {"message": message, "type": "authentication_error", "code": "invalid_api_key"}},
        401,
        headers={**HEADERS, "WWW-Authenticate": 'Basic realm="plurai dashboard", charset="UTF-8"'},
    )


_ASSETS: dict[str, bytes] = {}


def _asset(name: str) -> bytes:
    if name not in _ASSETS:
        _ASSETS[name] = resources.files("gateway").joinpath("static", name).read_bytes()
    return _ASSETS[name]
