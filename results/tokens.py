"""The per-job token stream, `plurai:out:<id>`.

Entries, in order: `type=start` (a worker began the job), `type=delta` (`text`: the new
text, `token_ids`: JSON list; `index`: its choice, in the stream of a job of n > 1 choices
only), `type=reset` (the job restarted: drop the text received so far, of every choice),
and one `type=end` (`state`, `finish_reason`) written with the final result.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from plurai.broker_config import keys
from plurai.broker_config.text import text
from plurai.results import records

START = "start"
DELTA = "delta"
RESET = "reset"
END = "end"


@dataclass
class Event:
    type: str
    text: str = ""
    token_ids: list[int] | None = None
    state: str | None = None
    finish_reason: str | None = None
    index: int = 0  # a delta's choice


def parse(fields: dict[Any, Any]) -> Event:
    f = {text(k): text(v) for k, v in fields.items()}
    ids = f.get("token_ids")
    try:
        token_ids = json.loads(ids) if ids else None
    except (ValueError, RecursionError):
        raise records.BadRecord(
            f"a token stream entry's token_ids is not JSON: {ids[:40]!r}"
        ) from None
    index = f.get("index", "0")
    if not (index.isascii() and index.isdigit() and len(index) <= 6):
        raise records.BadRecord(f"a token stream entry's index is not a count: {index[:40]!r}")
    return Event(
        type=f.get("type", ""),
        text=f.get("text", ""),
        token_ids=token_ids,
        state=f.get("state"),
        finish_reason=f.get("finish_reason") or None,
        index=int(index),
    )


class Reader:
    """A position in a job's token stream (I/O-free): `request()` is the XREAD argument,
    `feed(reply)` the events of its reply, up to and including `end`, after which `ended`
    is true."""

    def __init__(self, job_id: str, last_id: str = "0-0") -> None:
        self.key = keys.output(job_id)
        self.last_id: Any = last_id
        self.ended = False

    def request(self) -> dict[str, Any]:
        return {self.key: self.last_id}

    def feed(self, reply: Any) -> Iterator[Event]:
        for _stream, entries in stream_items(reply):
            for entry_id, fields in entries:
                self.last_id = entry_id
                ev = parse(fields)
                self.ended = ev.type == END
                yield ev
                if self.ended:
                    return

    def gone(self, rec: records.JobRecord) -> Iterator[Event]:
        """The events of a final job whose stream has expired (PLURAI_OUTPUT_TTL_S is shorter
        than the record's TTL): a reset, the record's whole text (each choice's), its end.
        Nothing while the job is not final: the stream may be yet to come."""
        if not rec.final:
            return
        self.ended = True
        yield Event(RESET)
        for c in rec.choices:
            yield Event(DELTA, text=c.text, token_ids=c.token_ids, index=c.index)
        yield Event(END, state=rec.state, finish_reason=rec.finish_reason)


def events(
    r: redis.Redis, job_id: str, block_ms: int = 1000, last_id: str = "0-0"
) -> Iterator[Event]:
    """Every event of the job's stream from the start, blocking for new ones, until `end`.

    Waits forever for a job that never starts; callers wanting a bound use Job.result.
    """
    reader = Reader(job_id, last_id)
    while not reader.ended:
        try:
            reply = r.xread(reader.request(), count=256, block=block_ms)
        except (redis.ResponseError, UnicodeDecodeError) as e:
            raise records.damaged(e, job_id, "token stream") from None
        yield from reader.feed(reply)
        if not reply and not r.exists(reader.key):  # a final job's stream may have expired
            yield from reader.gone(records.get(r, job_id))


async def events_async(
    r: redis.asyncio.Redis, job_id: str, block_ms: int = 1000, last_id: str = "0-0"
) -> AsyncIterator[Event]:
    """`events`, awaited."""
    reader = Reader(job_id, last_id)
    while not reader.ended:
        try:
            reply = await r.xread(reader.request(), count=256, block=block_ms)
        except (redis.ResponseError, UnicodeDecodeError) as e:
            raise records.damaged(e, job_id, "token stream") from None
        for ev in reader.feed(reply):
            yield ev
        if not reply and not await r.exists(reader.key):
            for ev in reader.gone(await records.get_async(r, job_id)):
                yield ev


def stream_items(reply: Any) -> list[tuple[Any, list[Any]]]:
    """XREAD / XREADGROUP replies as (stream, entries) pairs, whether RESP2 or RESP3."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return list(reply.items())
    return [(s, e) for s, e in reply]


class TextFollower:
    """Turns events into text deltas, coping with restarts; a text per choice (a delta's
    `index`).

    After a `reset`, the new run's text is compared with what was already handed out: text
    that repeats it is skipped, and only what goes beyond is yielded. If the new run differs
    (sampling without a seed), `JobRestarted` is raised.
    """

    def __init__(self) -> None:
        self.given: dict[int, str] = {}  # text handed to the caller, by choice
        self.run: dict[int, str] = {}  # text of the current run, by choice
        self.restarted = False

    def feed(self, ev: Event) -> str:
        """The new text of the event's choice (ev.index)."""
        if ev.type == RESET:
            self.run, self.restarted = {}, True
            return ""
        if ev.type != DELTA:
            return ""
        i = ev.index
        run = self.run[i] = self.run.get(i, "") + ev.text
        given = self.given.get(i, "")
        if not self.restarted:
            self.given[i] = run
            return ev.text
        if len(run) <= len(given):
            if not given.startswith(run):
                raise JobRestarted("the job restarted and produced different text")
            return ""
        if not run.startswith(given):
            raise JobRestarted("the job restarted and produced different text")
        self.given[i] = run
        return run[len(given) :]


class JobRestarted(RuntimeError):
    pass
