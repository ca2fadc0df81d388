"""Helpers the tests share: prompts and engine drains, an in-process worker a test drives
turn by turn, Redis state written by hand (a worker's heartbeat, a served model) and a
gateway to call. Fixtures live in the conftest files."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from plurai.broker_config import keys
from plurai.broker_config.connection import connect
from plurai.broker_config.routes import registry_value
from plurai.broker_config.settings import Settings
from plurai.gpu_workers.backend import Backend
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.gpu_workers.worker import Worker


def gone(pid: int) -> bool:
    """The process is not running: no such process, or a zombie nobody has reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def prompt(n: int, seed: int) -> list[int]:
    """n random token ids above the tiny models' special tokens, the same for a seed."""
    rng = random.Random(seed)
    return [rng.randrange(16, 2048) for _ in range(n)]


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def drain(engine) -> dict[str, list]:
    """Step until done: every request's outputs, in order."""
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def driven_worker(
    url: str, engine: Backend, name: str = "w1", settings: Settings | None = None, **fields: Any
) -> Worker:
    """A started worker in this process, which the test turns (`turn_until`, or its steps one
    by one) rather than runs; its settings are `settings`, else the defaults with `fields`.
    The jobs a previous test left in the engine are aborted first."""
    for job_id in list(getattr(engine, "seqs", ())):
        engine.abort(job_id)
    if settings is None:
        settings = Settings(redis_url=url, **fields)
    elif fields:
        raise TypeError("pass settings or fields, not both")
    w = Worker(engine, connect(url), settings, worker_id=name)
    w.start()
    return w


def plurai(url: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """`plurai <argv> --url <url>` run as a user runs it (a process of its own), to its end."""
    return subprocess.run(
        [sys.executable, "-m", "plurai.cli", *argv, "--url", url],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=60,
    )


def turn_until(
    workers: Worker | list[Worker], done: Callable[[], bool], timeout: float = 60.0
) -> None:
    """Turn the workers until `done()`, then take their last replies and send the acks
    these made due (Writer.settle)."""
    workers = workers if isinstance(workers, list) else [workers]
    give_up = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < give_up, "timed out"
        for w in workers:
            w.iterate()
    for w in workers:
        w.writer.settle()


def beat(r: redis.Redis, worker: str, **fields: object) -> None:
    """A serving worker's heartbeat as the worker writes it: its hash (state `serving`,
    stamped now; `fields` add to or replace those) and its name in the worker set."""
    mapping = {"state": "serving", "beat_ms": int(time.time() * 1000), **fields}
    r.hset(keys.worker(worker), mapping=mapping)  # type: ignore[arg-type]
    r.sadd(keys.WORKERS, worker)


def serve_model(
    r: redis.Redis, model: str = "m", beat_ms: int | None = None, max_model_len: int = 256
) -> None:
    """A model's entry in the model directory (plurai:models) as a serving worker's heartbeat
    writes it, beating now unless `beat_ms` says when."""
    beat = int(time.time() * 1000) if beat_ms is None else beat_ms
    r.hset(keys.MODELS, model, registry_value(1, beat, max_model_len=max_model_len))


def gateway(redis_url: str, **settings: object):
    """The gateway's app on `redis_url` in Starlette's test client (use it in a with block);
    a bug's 500 is answered, not raised. Requests name localhost, as a client of an open
    (keyless, loopback) gateway must."""
    from starlette.testclient import TestClient

    from plurai.broker_config.settings import Settings
    from plurai.gateway.serve import create_app

    app = create_app(Settings(redis_url=redis_url, **settings), redis_url)  # type: ignore[arg-type]
    return TestClient(app, base_url="http://localhost", raise_server_exceptions=False)


def oracle(monkeypatch, outputs: list[list[int]], vocab: int, wrong_every: int = 5) -> None:
    """Make the speculator propose from known outputs instead of prompt lookup: after a
    sequence's output so far (a prefix of one of `outputs`), the tokens that output goes on
    with, every `wrong_every`-th of them changed, so that steps accept some proposals and
    refuse others, at known places."""
    from plurai.gpu_workers.engine.speculator import Speculator

    def lookup(self, st, ids: list[int], k: int) -> list[int]:
        for out in outputs:
            for done in range(min(len(out), len(ids)), 0, -1):
                if ids[len(ids) - done :] == out[:done]:
                    nxt = out[done : done + k]
                    return [
                        (t + 1) % vocab if (done + j) % wrong_every == wrong_every - 1 else t
                        for j, t in enumerate(nxt)
                    ]
        return []

    monkeypatch.setattr(Speculator, "lookup", lookup)
    # and propose in every step: whether proposing pays is measured (Speculator._choose),
    # and on a random model with random timings it may not
    monkeypatch.setattr(Speculator, "_choose", lambda self, size: self.block.clear())
