"""A worker's vLLM engine processes die with it, however it dies.

vLLM runs its engine core in a process of its own (and that one its rank processes), and
nothing in it watches the process that started it: a worker killed with SIGKILL (the OOM
killer, a failed node agent, `kill -9`) leaves the engine core running, holding its
memory and, on a GPU, the device memory a restarted worker needs. So once the engine is up
the worker starts a reaper: a small process told by the kernel when the worker dies
(PR_SET_PDEATHSIG), which then SIGKILLs the engine's processes. A worker that closes its
backend stops the reaper first. Linux only (elsewhere nothing is started).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

# Run as `python -c`: the worker's pid, then the pids to kill. Woken by SIGUSR2, the
# parent-death signal; a signal from elsewhere is not taken for the worker's death.
_SCRIPT = """
import ctypes, os, signal, sys
parent, pids = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGUSR2, lambda *_: None)
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGUSR2)  # PR_SET_PDEATHSIG
while os.getppid() == parent:
    signal.pause()
for p in pids:
    try:
        os.kill(p, signal.SIGKILL)
    except OSError:
        pass
"""


def descendants(pid: int) -> list[int]:
    """The pids of `pid`'s children, theirs, and so on (from /proc; [] where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # the command name, in parentheses, may hold spaces: the fields after it are fixed
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return sorted(out)


def start(pids: list[int]) -> subprocess.Popen | None:
    """A reaper that SIGKILLs `pids` when this process dies; None where it cannot run: not
    Linux, nothing to watch, or not the main thread (the kernel's signal follows the
    thread that started the reaper, not the process: it would fire when that thread ends)."""
    if (
        not pids
        or not sys.platform.startswith("linux")
        or threading.current_thread() is not threading.main_thread()
    ):
        return None
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, str(os.getpid()), *map(str, pids)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a terminal's Ctrl-C goes to the worker, not to it
        close_fds=True,
    )


def stop(reaper: subprocess.Popen | None) -> None:
    """Stop a reaper without it killing anything (the engine is being shut down)."""
    if reaper is not None and reaper.poll() is None:
        reaper.send_signal(signal.SIGKILL)
        reaper.wait()
