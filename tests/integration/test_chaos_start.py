"""Chaos in the start: workers SIGKILLed at random instants of their start (while the
native kernels build, while the model loads, while they join the queue) never stop a later
worker from starting, and the jobs queued meanwhile complete exactly once.

The kernels folder starts empty, so the first workers must build the kernels: the kills
land in that build too, and in the lock around it."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from plurai.broker_config.locks import held
from plurai.producer.client import Client
from plurai.results import records

from .conftest import ROOT
from .faults import FAST, LANES, drained
from .test_chaos import stream_problems

pytestmark = pytest.mark.slow

JOBS = 24
MAX_TOKENS = 8
RANDOM_KILLS = 4


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_workers_killed_in_their_start_never_stop_the_next(
    redis_url, tiny_model, tmp_path, workers_class
):
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: no kernel build to kill")
    kernels = tmp_path / "kernels"  # empty: the first starts build the kernels
    env = {**FAST, "PLURAI_KERNELS_DIR": str(kernels), "PLURAI_KERNELS": "native"}
    w = workers_class(redis_url, tiny_model, tmp_path)
    rng = random.Random(7)
    r = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    ids = [
        j.id
        for j in client.submit_many(
            [
                {
                    "prompt": f"start chaos {i}: the quiet city",
                    "max_tokens": MAX_TOKENS,
                    "ignore_eos": True,
                    "stream": True,
                    "lane": LANES[i % 3],
                }
                for i in range(JOBS)
            ]
        )
    ]

    def launch() -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"killed-{len(killed)}.log", "wb")  # noqa: SIM115
        return subprocess.Popen(
            [sys.executable, "-m", "plurai.cli", "worker", "--model", str(tiny_model)]
            + ["--url", redis_url, *w.args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PLURAI_HEARTBEAT_INTERVAL_S": "1", **env},
        )

    killed: list[subprocess.Popen[bytes]] = []
    try:
        # 1. killed while it compiles the kernels (holding the build lock)
        p = launch()
        killed.append(p)
        wait_for(
            lambda: any(kernels.glob(".build-*")), 120, "the first worker never began the build"
        )
        time.sleep(rng.uniform(0.5, 3.0))
        p.send_signal(signal.SIGKILL)
        p.wait()
        # its lock died with it: taken at once, without waiting out anything
        locks = list(kernels.glob("*.lock"))
        assert locks, "the build took no lock"
        with held(locks[0], timeout_s=5, what="the test"):
            pass
        # 2. killed at random instants of their start: importing, checking the model,
        # connecting, building the kernels again, loading the model
        for _ in range(RANDOM_KILLS):
            p = launch()
            killed.append(p)
            time.sleep(rng.uniform(0.2, 8.0))
            p.send_signal(signal.SIGKILL)
            p.wait()
        time.sleep(3.5)  # the killed workers' starting heartbeats expire (3 beats)
        # 3. two workers start side by side: one builds, the other waits on the lock
        w.start(2, env=env, timeout=600)
        wait_for(
            lambda: all(rec.final for rec in records.get_many(r, ids)),
            180,
            "the jobs did not complete after the workers started",
        )
        recs = records.get_many(r, ids)
        bad = [(x.id, x.state, x.error_code) for x in recs if x.state != records.COMPLETED]
        assert not bad, bad
        short = [(x.id, x.output_tokens) for x in recs if x.output_tokens != MAX_TOKENS]
        assert not short, short
        problems = [p for rec in recs for p in stream_problems(r, rec)]
        assert not problems, "\n".join(problems[:20])
        assert drained(r)
        assert len(list(kernels.glob("plurai_cpu_*.so"))) == 1
        assert not list(kernels.glob(".build-*")), "a killed build's folder was left"
    finally:
        for p in killed:
            if p.poll() is None:
                p.kill()
        w.stop()
        client.close()


def test_a_build_lock_dies_with_its_holder(tmp_path: Path):
    lock = tmp_path / "x.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from plurai.broker_config.locks import held\n"
            f"with held(Path({str(lock)!r}), 5, 'test'):\n"
            "    print('held', flush=True)\n"
            "    time.sleep(60)\n",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with pytest.raises(TimeoutError, match=f"held by pid {holder.pid}"):
            with held(lock, timeout_s=0.3, what="the test"):
                pass
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        with held(lock, timeout_s=5, what="the test"):
            assert lock.read_text().strip() == str(os.getpid())
    finally:
        holder.kill()
