"""vLLM's engine core is bound to the cores of its ranks (gpu_workers/vllm_backend/cores.py):
real processes, with the affinities vLLM gives them on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from plurai.gpu_workers.vllm_backend.cores import pin_to_ranks

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and two cores",
)

# a process with a second thread, as the engine core has (its sockets' threads)
SLEEPER = """
import threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("up", flush=True)
time.sleep(60)
"""


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def start(procs: list[subprocess.Popen], cores: set[int] | None = None) -> int:
    p = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "up"
    if cores is not None:  # as vLLM binds a rank: every thread
        for t in Path(f"/proc/{p.pid}/task").iterdir():
            os.sched_setaffinity(int(t.name), cores)
    return p.pid


def thread_cores(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()]


def test_the_loose_process_joins_its_ranks_cores(procs: list[subprocess.Popen]) -> None:
    first = min(os.sched_getaffinity(0))
    rank, core = start(procs, {first}), start(procs)
    assert any(c != {first} for c in thread_cores(core))
    assert pin_to_ranks([core, rank]) == {first}
    assert len(thread_cores(core)) == 2 and all(c == {first} for c in thread_cores(core))
    assert all(c == {first} for c in thread_cores(rank))


def test_ranks_on_different_cores_share_theirs(procs: list[subprocess.Popen]) -> None:
    a, b = sorted(os.sched_getaffinity(0))[:2]
    core = start(procs)
    ranks = [start(procs, {a}), start(procs, {b})]
    assert pin_to_ranks([core, *ranks]) == {a, b}
    assert all(c == {a, b} for c in thread_cores(core))


def test_nothing_moves_where_no_rank_is_bound(procs: list[subprocess.Popen]) -> None:
    # GPUs, or VLLM_CPU_OMP_THREADS_BIND=nobind: vLLM binds nothing, neither does the worker
    every = os.sched_getaffinity(0)
    pids = [start(procs), start(procs)]
    assert pin_to_ranks(pids) == set()
    assert all(c == every for p in pids for c in thread_cores(p))


def test_a_process_gone_meanwhile_is_skipped(procs: list[subprocess.Popen]) -> None:
    first = min(os.sched_getaffinity(0))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rank, core = start(procs, {first}), start(procs)
    assert pin_to_ranks([gone.pid, core, rank]) == {first}
    assert all(c == {first} for c in thread_cores(core))


def test_ranks_bound_outside_the_workers_own_cores(procs: list[subprocess.Popen]) -> None:
    # the worker itself bound to one core (taskset), its rank to another by vLLM
    a, b = sorted(os.sched_getaffinity(0))[:2]
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {a})
    try:
        core = start(procs)  # started as the worker is: on its cores
        rank = start(procs, {b})
        assert pin_to_ranks([core, rank]) == {b}
        assert all(c == {b} for c in thread_cores(core))
    finally:
        os.sched_setaffinity(0, saved)
