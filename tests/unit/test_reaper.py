"""A worker's engine processes die with the worker, even when it is SIGKILLed (vLLM's engine
core watches nothing): the reaper kills them then, and only then."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plurai.gpu_workers.vllm_backend import reaper
from tests.helpers import gone, wait_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

ROOT = Path(__file__).resolve().parents[2]
# a stand-in worker: an "engine" child (itself with a child, as vLLM's core has its ranks),
# then the reaper, then it waits
WORKER = """
import subprocess, sys, time
from plurai.gpu_workers.vllm_backend import reaper
core = subprocess.Popen([sys.executable, "-c",
    "import subprocess, time; subprocess.Popen(['sleep', '1000']); time.sleep(1000)"])
time.sleep(0.5)
engine = reaper.descendants(__import__("os").getpid())
r = reaper.start(engine)
print(" ".join(map(str, engine)), r.pid, flush=True)
if sys.argv[1] == "close":
    reaper.stop(r)
    print("closed", flush=True)
time.sleep(1000)
"""


def start_worker(mode: str) -> tuple[subprocess.Popen, list[int], int]:
    w = subprocess.Popen(
        [sys.executable, "-c", WORKER, mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert w.stdout is not None
    *engine, r = map(int, w.stdout.readline().split())
    if mode == "close":
        assert w.stdout.readline().strip() == "closed"
    return w, engine, r


def kill_all(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def test_a_sigkilled_workers_engine_processes_are_killed() -> None:
    w, engine, r = start_worker("crash")
    try:
        assert len(engine) == 2
        time.sleep(0.5)  # while the worker lives, nothing happens
        assert not gone(r) and not any(gone(p) for p in engine)
        w.send_signal(signal.SIGKILL)
        w.wait()
        assert wait_gone(engine + [r])
    finally:
        kill_all([w.pid, *engine, r])


def test_a_closed_backend_leaves_no_reaper_to_act() -> None:
    w, engine, r = start_worker("close")
    try:
        assert gone(r)
        w.send_signal(signal.SIGKILL)
        w.wait()
        time.sleep(1.0)
        assert not any(gone(p) for p in engine)  # nothing killed them
    finally:
        kill_all([w.pid, *engine])


def test_descendants_are_children_and_theirs() -> None:
    outer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time; subprocess.Popen(['sleep', '30']); time.sleep(30)",
        ]
    )
    try:
        end = time.monotonic() + 10
        while len(found := reaper.descendants(os.getpid())) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        assert outer.pid in found and len([p for p in found if p != outer.pid]) >= 1
    finally:
        kill_all(reaper.descendants(outer.pid) + [outer.pid])
        outer.wait()
