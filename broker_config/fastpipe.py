"""A lean pipeline for submit_many and the worker's per-step writes.

redis-py's command packer costs more per argument than the rest of a submit together, so
these callers encode RESP with hiredis' C packer, write a whole chunk to one connection,
then read the replies. Same bytes on the wire as any client would send.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import hiredis
import redis

# Commands per write in `run`: Redis runs the first ones while the rest are packed.
SLICE = 256


def pack(args: list[Any]) -> bytes:
    """One command in RESP (str, bytes, int or float arguments)."""
    return hiredis.pack_command(tuple(args))


def run(r: redis.Redis, commands: Iterable[bytes | list[Any]]) -> list[Any]:
    """Send commands (packed, or lists of arguments packed here) on one connection a slice
    at a time, taking them from `commands` as they are written, without waiting; then
    return one reply per command, an error reply as its ResponseError, in place."""
    sent = 0

    def writes() -> Iterator[bytes]:
        nonlocal sent
        part: list[bytes] = []
        for c in commands:
            part.append(c if isinstance(c, bytes) else pack(c))
            if len(part) == SLICE:
                sent += len(part)
                yield b"".join(part)
                part = []
        if part:
            sent += len(part)
            yield b"".join(part)

    pool = r.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command(writes(), check_health=True)
        replies: list[Any] = []
        for _ in range(sent):
            try:
                replies.append(conn.read_response())
            except redis.ResponseError as e:
                replies.append(e)
        return replies
    except BaseException:
        conn.disconnect()  # replies may be left unread on it
        raise
    finally:
        pool.release(conn)
