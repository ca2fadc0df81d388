"""Hostile input against one real worker process and a real redis-server (every test here
shares the one worker it starts, which must outlive all of them; the fixed cases are in
fuzz_cases.py, the random ones' strategies in fuzz_strategies.py).

Entries are written raw (XADD of flat fields, as any client in any language can): random and
broken flat fields, JSON and msgpack bodies that are broken, deeply nested, huge, non-finite,
with lone surrogates, msgpack bin / ext / timestamp values, non-string map keys, oversized
strings and lists, special-token text; cancel messages of any bytes on the cancel channel;
job ids whose record or token stream already exists with the wrong Redis type.

What a user relies on, checked after every batch:

* the worker process is still alive;
* every entry with a usable id (8-128 of [A-Za-z0-9_-]) has exactly one final record
  (completed, failed or cancelled, with one `end` entry in its token stream) whose
  error_code, if any, is a documented code and never `internal`; when no record can be
  written (its key holds another Redis type) the entry is in the dead-letter stream;
* an entry without a usable id is in the dead-letter stream;
* a well-formed job completes (or is cancelled when a cancel for it was sent), and a
  clearly malformed one fails;
* nothing stays pending in any lane;
* a good job sent afterwards gives exactly the text of the same prompt run offline on the
  same engine settings.

`test_catalog` runs a fixed list of nasty entries one at a time (so a crash names its
input, and every case is reported, not just the first); `test_fuzz_batches` draws random
batches with hypothesis.

One file, though long: its tests must share the one worker process they attack.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, Phase, given, settings

from plurai.broker_config import keys
from plurai.results.records import JobRecord

from .conftest import ENGINE_ARGS
from .faults import LANES, drained, pending
from .fuzz_cases import (
    ANY,
    BAD_IDS,
    CANCELS,
    CATALOG,
    COMPLETED,
    DOCUMENTED,
    FAILED,
    GOOD_MAX_TOKENS,
    GOOD_PROMPT,
    HEAVY,
    ID,
    LIMIT,
    MAX_MODEL_LEN,
    SETTLE_S,
    TERMINAL,
    USABLE_ID,
    WORKER_ARGS,
    WORKER_ENV,
    WRONG_TYPES,
    Case,
    F,
    J,
    P,
)  # fmt: skip
from .fuzz_strategies import MODEL_NAME, Batch, batch_st

pytestmark = pytest.mark.slow

# -- the worker under test ---------------------------------------------------------------


class Served:
    """One worker process; restarted (after clearing what it held) when a case killed it."""

    def __init__(self, url: str, model: Path, log_dir: Path, workers_class: type) -> None:
        self.url = url
        self.model = model
        self.r = redis.Redis.from_url(url)
        self.w = workers_class(url, model, log_dir)
        self.proc: Any = None
        self.index = -1
        self._dead_from = "0-0"
        # (lane, entry id) -> its dead letters; entry ids repeat across streams
        self.dead: dict[tuple[bytes, bytes], list[dict[bytes, bytes]]] = {}

    def start(self) -> None:
        self.index = len(self.w.procs)
        (self.proc,) = self.w.start(1, *WORKER_ARGS, env=WORKER_ENV)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 2500) -> str:
        return self.w.log(self.index)[-n:]

    def death(self) -> str:
        return f"worker exited with code {self.proc.poll()}; its log ends:\n{self.log_tail()}"

    def ready(self) -> None:
        """A live worker and empty lanes: after a crash, drop what the dead one held (its
        failure is already reported) so the next case starts clean."""
        if self.alive():
            return
        for lane in LANES:
            stream = keys.request_stream(lane)
            try:
                held = self.r.xpending_range(stream, keys.GROUP, "-", "+", 100_000)
            except redis.ResponseError:
                continue
            for p in held:
                self.r.xack(stream, keys.GROUP, p["message_id"])
                self.r.xdel(stream, p["message_id"])
            self.r.delete(stream)  # unread entries of the crashed case, too
        self.start()

    def read_dead(self) -> None:
        """Index the dead-letter stream's new entries by the entry id they carry."""
        while True:
            reply = self.r.xread({keys.DEAD_LETTER: self._dead_from}, count=1000)
            if not reply:
                return
            for entry_id, f in reply[0][1]:
                self._dead_from = entry_id.decode()
                key = (f.get(b"lane", b""), f.get(b"entry_id", b""))
                self.dead.setdefault(key, []).append(f)


@pytest.fixture(scope="module")
def served(module_redis_url, tiny_model, tmp_path_factory, workers_class) -> Iterator[Served]:
    s = Served(module_redis_url, tiny_model, tmp_path_factory.mktemp("fuzzlogs"), workers_class)
    s.start()
    yield s
    s.w.stop()


@pytest.fixture(scope="module")
def expected_good(tiny_model) -> tuple[str, list[int]]:
    """The good job's output, run offline on the worker's engine settings (fp32, greedy)."""
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig
    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    kv = int(ENGINE_ARGS[ENGINE_ARGS.index("--engine") + 1].split("=")[1])
    engine = Engine(
        EngineConfig(
            model=str(tiny_model),
            dtype="fp32",
            threads=1,
            kv_cache_bytes=kv,
            max_model_len=MAX_MODEL_LEN,
        )
    )
    try:
        (out,) = engine.generate(
            [GOOD_PROMPT],
            SamplingParams(max_tokens=GOOD_MAX_TOKENS, temperature=0, ignore_eos=True),
        )
    finally:
        engine.close()
    assert len(out.token_ids) == GOOD_MAX_TOKENS
    return out.text, list(out.token_ids)


# -- running a batch and checking it ------------------------------------------------------


@dataclass
class Written:
    case: Case
    lane: str
    entry_id: bytes
    job_id: str | None  # the usable id, else None
    fields: dict[bytes, bytes] = field(repr=False)

    @property
    def dead_key(self) -> tuple[bytes, bytes]:
        return (self.lane.encode(), self.entry_id)

    def name(self) -> str:
        shown = {k: (v[:60] + b"..." if len(v) > 60 else v) for k, v in self.fields.items()}
        return f"[{self.case.label}] entry {self.entry_id.decode()} on {self.lane}: {shown}"[:600]


def materialize(case: Case) -> tuple[dict[bytes, bytes], str | None]:
    f = dict(case.fields)
    job_id = None
    if f.get(b"id") is ID:
        job_id = "fz-" + secrets.token_urlsafe(12)
        f[b"id"] = job_id.encode()
    raw = f.get(b"id")
    if job_id is None and raw is not None and USABLE_ID.fullmatch(raw):
        job_id = raw.decode()
    if not f:
        f = {b"x": b"y"}
    return f, job_id


def pre_create(r: redis.Redis, job_id: str, where: str, rtype: str) -> None:
    key = keys.job(job_id) if where == "job" else keys.output(job_id)
    if rtype == "string":
        r.set(key, "not a hash")
    elif rtype == "list":
        r.rpush(key, "not", "a", "hash")
    else:
        r.hset(key, mapping={"not": "a stream"})
    r.expire(key, 3600)


def write(served: Served, cases: list[Case], lanes: list[str]) -> list[Written]:
    out = []
    for case, lane in zip(cases, lanes, strict=True):
        f, job_id = materialize(case)
        if case.wrong_type is not None:
            assert job_id is not None
            pre_create(served.r, job_id, *case.wrong_type)
        entry_id = served.r.xadd(keys.request_stream(lane), f)
        out.append(Written(case, lane, entry_id, job_id, f))
    return out


def key_types(r: redis.Redis, job_ids: list[str]) -> list[tuple[str, str]]:
    pipe = r.pipeline(transaction=False)
    for j in job_ids:
        pipe.type(keys.job(j))
        pipe.type(keys.output(j))
    t = [x.decode() for x in pipe.execute()]
    return list(zip(t[::2], t[1::2], strict=True))


def answered(served: Served, w: Written, types: tuple[str, str] | None) -> bool:
    if w.dead_key in served.dead:
        return True
    if w.job_id is None or types is None or types[0] != "hash":
        return False
    return bool(served.r.hexists(keys.job(w.job_id), "final"))


def settle(served: Served, written: list[Written], timeout: float = SETTLE_S) -> list[str]:
    """Wait until every entry is answered (or the worker died, or timeout); the violations."""
    give_up = time.monotonic() + timeout
    left = list(written)  # not yet answered
    while left and time.monotonic() < give_up and served.alive():
        served.read_dead()
        ids = [w.job_id for w in left if w.job_id is not None]
        types = dict(zip(ids, key_types(served.r, ids), strict=True))
        left = [w for w in left if not answered(served, w, types.get(w.job_id or ""))]
        if left:
            time.sleep(0.1)
    served.read_dead()
    violations: list[str] = []
    if not served.alive():
        violations.append(served.death())
    unanswered = {id(w) for w in left}
    for w in written:
        violations += check_one(served, w, timed_out=id(w) in unanswered and served.alive())
    if served.alive() and not left and not drained(served.r):
        held = pending(served.r)
        violations.append(f"{held} entries still pending after every entry was answered")
    return violations


def check_one(served: Served, w: Written, timed_out: bool) -> list[str]:
    r, case = served.r, w.case
    dead = served.dead.get(w.dead_key, [])
    if w.job_id is None:
        if not dead:
            why = "not answered in time" if timed_out else "the worker died first"
            return [f"{w.name()}: no usable id, but not in {keys.DEAD_LETTER} ({why})"]
        return []
    types = key_types(r, [w.job_id])[0]
    if case.wrong_type is not None and case.wrong_type[0] == "job":
        # The record is not a hash, so no result can be written: the entry goes to the
        # dead-letter stream, with the job id (docs/protocol.md, bad_record).
        if not dead:
            why = "not answered in time" if timed_out else "the worker died first"
            return [
                f"{w.name()}: its job key is a {case.wrong_type[1]}; the entry got no result "
                f"and is not in the dead-letter stream ({why})"
            ]
        if not any(w.job_id.encode() in b" ".join(d.values()) for d in dead):
            return [f"{w.name()}: its dead letter does not name the job id: {dead[0]!r}"[:500]]
        return []
    if types[0] != "hash":
        return [f"{w.name()}: no job record ({'timed out' if timed_out else 'worker died'})"]
    rec = JobRecord.from_hash(w.job_id, r.hgetall(keys.job(w.job_id)))
    if not rec.final:
        return [
            f"{w.name()}: no final result (state {rec.state!r})"
            + (" after the batch timed out" if timed_out else "; the worker died first")
        ]
    problems = []
    if rec.state not in TERMINAL:
        problems.append(f"final state {rec.state!r} is not terminal")
    code = rec.error_code
    if rec.state == "failed" and not code:
        problems.append("failed without an error_code")
    if code is not None and code not in DOCUMENTED:
        problems.append(f"error_code {code!r} is not documented: {rec.error_message!r}"[:400])
    if case.expect == COMPLETED and not (
        rec.state == "completed" or (case.cancelled_ok and rec.state == "cancelled")
    ):
        problems.append(
            f"a well-formed job ended {rec.state} ({code}: {rec.error_message!r})"[:400]
        )
    if case.expect == FAILED and rec.state != "failed":
        problems.append(f"a malformed entry was not refused: it ended {rec.state}")
    if isinstance(case.expect, frozenset) and (rec.state != "failed" or code not in case.expect):
        problems.append(
            f"expected failed with {' or '.join(sorted(case.expect))}, got {rec.state} "
            f"{code}: {rec.error_message!r}"[:400]
        )
    if case.record_check is not None and rec.state == "completed":
        extra = case.record_check(rec)
        if extra:
            problems.append(extra)
    if types[1] == "stream":
        ends = [f for _, f in r.xrange(keys.output(w.job_id)) if f.get(b"type") == b"end"]
        if len(ends) != 1:
            problems.append(f"{len(ends)} end entries in its token stream")
    elif case.wrong_type is None:
        problems.append(f"its token stream is a {types[1]!r}, not a stream")
    return [f"{w.name()}: {p}" for p in problems]


def check_good(served: Served, expected: tuple[str, list[int]]) -> list[str]:
    """A good job after the batch: served, and token-exact against the offline engine."""
    if not served.alive():
        return []  # already reported
    case = J(
        "good job after the batch",
        {"prompt": GOOD_PROMPT, "temperature": 0, "ignore_eos": True},
        COMPLETED,
        max_tokens=str(GOOD_MAX_TOKENS).encode(),
    )
    (w,) = write(served, [case], ["interactive"])
    violations = settle(served, [w], timeout=60)
    if violations:
        return violations
    assert w.job_id is not None
    rec = JobRecord.from_hash(w.job_id, served.r.hgetall(keys.job(w.job_id)))
    text, token_ids = expected
    if (rec.text, rec.token_ids) != (text, token_ids):
        return [
            f"the good job after the batch gave {rec.text!r} {rec.token_ids}; the same prompt "
            f"offline gives {text!r} {token_ids}"
        ]
    return []


def report(violations: list[str]) -> str:
    return f"{len(violations)} violation(s):\n" + "\n".join(f"- {v}" for v in violations)


# -- the fixed catalog ----------------------------------------------------------------------


def catalog_runs() -> list[tuple[str, Callable[[Served], list[Written]]]]:
    """Each run: writes some entries (and publishes cancels); all then checked."""
    runs: list[tuple[str, Callable[[Served], list[Written]]]] = []
    for i, case in enumerate(CATALOG + HEAVY):
        runs.append((case.label, lambda s, c=case, i=i: write(s, [c], [LANES[i % 3]])))
    for bad in BAD_IDS:
        case = J(f"id {bad[:20] if bad else bad!r}", P)
        case.fields = {k: v for k, v in case.fields.items() if k != b"id"}
        if bad is not None:
            case.fields[b"id"] = bad
        runs.append((case.label, lambda s, c=case: write(s, [c], ["batch"])))
    for where, rtype in WRONG_TYPES:
        expect = F("bad_record") if where == "output" else ANY
        case = replace(J(f"{where} key is a {rtype}", P, expect), wrong_type=(where, rtype))
        runs.append((case.label, lambda s, c=case: write(s, [c], ["standard"])))
    for msg in CANCELS:

        def cancel_then_good(s: Served, msg: bytes = msg) -> list[Written]:
            s.r.publish(keys.CANCEL_CHANNEL, msg)
            return write(
                s, [J(f"a job after cancel message {msg[:12]!r}", P, COMPLETED)], ["standard"]
            )

        runs.append((f"cancel message {msg[:12]!r}", cancel_then_good))

    def cancel_running(s: Served) -> list[Written]:
        long = replace(
            J(
                "a cancelled running job",
                {"prompt": "x", "ignore_eos": True},
                COMPLETED,
                max_tokens=str(LIMIT).encode(),
            ),
            cancelled_ok=True,
        )
        (w,) = write(s, [long], ["interactive"])
        assert w.job_id is not None
        give_up = time.monotonic() + 30
        while s.r.hget(keys.job(w.job_id), "state") != b"running" and time.monotonic() < give_up:
            time.sleep(0.01)
        s.r.publish(keys.CANCEL_CHANNEL, w.job_id.encode())
        s.r.publish(keys.CANCEL_CHANNEL, w.job_id.encode())  # twice
        return [w]

    runs.append(("cancel of a running job", cancel_running))
    return runs


def test_catalog(served: Served, expected_good) -> None:
    violations: list[str] = []
    for label, run in catalog_runs():
        served.ready()
        try:
            written = run(served)
        except redis.RedisError as e:
            violations.append(f"[{label}] could not be written: {e}")
            continue
        violations += settle(served, written)
        if not served.alive():
            violations.append(f"(the worker died on [{label}]; restarted for the next case)")
    served.ready()
    violations += check_good(served, expected_good)
    assert not violations, report(violations)


@settings(
    max_examples=30,
    print_blob=True,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: every run costs real seconds
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
@given(batch=batch_st(MODEL_NAME))
def test_fuzz_batches(served: Served, expected_good, batch: Batch) -> None:
    assert served.model.name == MODEL_NAME
    cases, lanes, cancels = batch.cases, batch.lanes, batch.cancels
    served.ready()
    marked = set()
    for c in cancels:
        if isinstance(c, int):
            marked.add(c)
    cases = [replace(c, cancelled_ok=i in marked) for i, c in enumerate(cases)]
    written = write(served, cases, lanes)
    for c in cancels:
        if isinstance(c, int):
            job_id = written[c].job_id
            msg = job_id.encode() if job_id else written[c].entry_id
        else:
            msg = c
        served.r.publish(keys.CANCEL_CHANNEL, msg)
    violations = settle(served, written)
    violations += check_good(served, expected_good)
    assert not violations, report(violations)
