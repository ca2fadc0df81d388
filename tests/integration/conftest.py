"""Fixtures for integration tests: a real redis-server on a free port and worker processes (`python -m plurai.cli worker`)."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from plurai.broker_config import stats
from plurai.broker_config.connection import connect

from .zygote import Child, Zygote

ROOT = Path(__file__).resolve().parents[2]

# Small KV cache and one thread per process: several engines share a 2-core machine.
# fp32 so results are comparable token for token with an offline run of the same engine.
ENGINE_ARGS = [
    "--engine",
    "kv_cache_bytes=33554432",
    "--engine",
    "threads=1",
    "--engine",
    "dtype=fp32",
]


def serving_pids(r) -> set[int]:
    """The pids of this host's workers whose heartbeat says serving (a killed worker's
    beat lingers for three intervals, so a count would not tell the new ones apart)."""
    live, _ = stats.workers(r, stats.redis_now_ms(r))
    return {w.pid for w in live if w.state == "serving"}


_zygote: Zygote | None = None


def zygote() -> Zygote | None:
    """The session's zygote (tests/integration/zygote.py), started at its first use;
    PLURAI_TEST_ZYGOTE=0 starts every worker as a process of its own instead."""
    global _zygote
    if _zygote is None and os.environ.get("PLURAI_TEST_ZYGOTE", "1") != "0":
        _zygote = Zygote(Path(tempfile.mkdtemp(prefix="plurai-zygote-")))
        atexit.register(_zygote.stop)
    return _zygote


class Workers:
    """Worker processes serving one Redis; stopped with SIGTERM at teardown."""

    command = [sys.executable, "-m", "plurai.cli"]  # then `worker` and its arguments
    args = ENGINE_ARGS  # the backend's arguments, before each start's own

    def __init__(self, url: str, model: Path, log_dir: Path) -> None:
        self.url, self.model, self.log_dir = url, model, log_dir
        self.procs: list[subprocess.Popen[bytes] | Child] = []

    def start(
        self, n: int = 1, *extra: str, env: dict[str, str] | None = None, timeout: float = 180.0
    ) -> list[subprocess.Popen[bytes] | Child]:
        r = connect(self.url)
        new: list[subprocess.Popen[bytes] | Child] = []
        for _ in range(n):
            path = self.log_dir / f"worker-{len(self.procs)}.log"
            argv = [*self.command, "worker", "--model", str(self.model), "--url", self.url]
            argv += [*self.args, *extra]
            full_env = {**os.environ, "PLURAI_HEARTBEAT_INTERVAL_S": "1", **(env or {})}
            z = zygote() if argv[:2] == [sys.executable, "-m"] else None
            if z is not None:
                proc: subprocess.Popen[bytes] | Child = z.start(argv, ROOT, full_env, path)
            else:
                with open(path, "wb") as log:
                    proc = subprocess.Popen(
                        argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=full_env
                    )
            self.procs.append(proc)
            new.append(proc)
        deadline = time.monotonic() + timeout
        while not {p.pid for p in new} <= serving_pids(r):  # each serves once it is ready
            if any(p.poll() is not None for p in new):
                raise RuntimeError(f"a worker exited early; see {self.log_dir}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready after {timeout}s; see {self.log_dir}")
            time.sleep(0.1)
        return new

    def log(self, i: int = 0) -> str:
        return (self.log_dir / f"worker-{i}.log").read_text(errors="replace")

    def stop(self) -> list[int]:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=60))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        self.procs = []
        return codes


@pytest.fixture
def workers(redis_url: str, tiny_model: Path, tmp_path: Path) -> Iterator[Workers]:
    w = Workers(redis_url, tiny_model, tmp_path)
    yield w
    w.stop()


@pytest.fixture(scope="session")
def workers_class() -> type[Workers]:
    """For module-scoped worker fixtures in test files."""
    return Workers
