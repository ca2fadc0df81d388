"""A lean pipeline for submit_many and the worker's per-step writes.

redis-py's command packer costs more per argument than the rest of a submit together, so
these callers encode RESP with hiredis' C packer, write a whole chunk to one connection,
then read the replies. Same bytes on the wire as any client would send.
"""

from __future__ import annotations

from typing import Any

import hiredis
import redis


def pack(args: list[Any]) -> bytes:
    """One command in RESP (str, bytes, int or float arguments)."""
    return hiredis.pack_command(tuple(args))


def run(r: redis.Redis, commands: list[bytes]) -> list[Any]:
    """Send packed commands in one write and return one reply per command; an error reply
    is returned as its ResponseError, in place."""
    pool = r.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command([b"".join(commands)], check_health=True)
        replies: list[Any] = []
        for _ in commands:
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
