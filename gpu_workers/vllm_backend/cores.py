"""vLLM's engine core on the cores of its ranks.

On CPU, vLLM binds each rank process (the model's forward passes) to its cores
(VLLM_CPU_OMP_THREADS_BIND) but leaves the engine core process, which schedules the steps,
free to run on any core. While a rank computes a step the engine core waits for it by
spinning (sched_yield in a loop, vLLM's shared-memory queue). Off its rank's cores that
spin lands on another engine's core, where the kernel shares the core between the two
engines' process groups: measured on 2 cores with two engines, the engine cores used 30 s
of CPU in a 150 s run and each rank waited hundreds of ms a step for its own core. On its
rank's cores the yield lets that rank run, and the other cores stay free for the worker,
Redis and the other engines.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("plurai.worker")


def pin_to_ranks(pids: list[int]) -> set[int]:
    """Bind every thread of the processes in `pids` that may run where this process may
    (the engine core, left as it was started) to the cores that the others (the ranks,
    which vLLM bound elsewhere) are bound to; the cores chosen, or none where no process of
    `pids` is bound (GPUs, `nobind`) or the system does not say (not Linux)."""
    if not hasattr(os, "sched_getaffinity"):
        return set()
    every = os.sched_getaffinity(0)
    bound: set[int] = set()
    loose: list[int] = []
    for pid in pids:
        try:
            cores = os.sched_getaffinity(pid)
        except OSError:
            continue  # gone meanwhile
        if cores != every:
            bound |= cores
        else:
            loose.append(pid)
    if not bound:
        return set()
    moved = 0
    for pid in loose:
        try:
            threads = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in threads:  # a process's affinity is per thread; new ones inherit it
            try:
                os.sched_setaffinity(tid, bound)
                moved += 1
            except OSError:
                pass  # ended meanwhile, or not allowed here
    if moved:
        log.info("vLLM's engine core bound to the cores of its ranks: %s", sorted(bound))
    elif loose:
        log.warning("vLLM's engine core could not be bound to its ranks' cores %s", sorted(bound))
    return bound
