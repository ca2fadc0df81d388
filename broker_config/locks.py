"""A file lock that dies with its holder: `fcntl.flock` on an open file, so a process
killed while holding it (SIGKILL, OOM) frees it at once. The lock file's existence means
nothing; it is never removed, so two processes never lock different files of one name.

    with held(path, timeout_s=600, what="the kernel build"):
        ...  # one process at a time, machine-wide
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("plurai.locks")


class LockTimeout(TimeoutError):
    pass


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return "?"
    return text if text.isdigit() else "?"


@contextmanager
def held(path: Path, timeout_s: float, what: str, poll_s: float = 0.1) -> Iterator[None]:
    """Hold the lock on `path` (made if missing) while the block runs. Waits at most
    timeout_s, logging who holds it every 10 s; raises LockTimeout saying what was waited
    for."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        next_note = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            now = time.monotonic()
            if now >= deadline:
                raise LockTimeout(
                    f"{what}: waited {timeout_s:.0f} s for the lock {path}, held by pid "
                    f"{_holder(fd)}; if that process is stuck, end it"
                )
            if now >= next_note:
                log.info("waiting for %s: lock %s is held by pid %s", what, path, _holder(fd))
                next_note = now + 10
            time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for the waiters' log
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
