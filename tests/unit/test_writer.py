"""The worker's writer through a Redis failure: kept results are resent rewriting their
streams, and the stream writes kept with them (a job's held tokens, written before its
result when it ends outside a step) are dropped, not mistaken for results."""

from __future__ import annotations

import fakeredis
import pytest
import redis

from plurai.broker_config import keys
from plurai.broker_config.settings import Settings
from plurai.gpu_workers.writer import Writer
from plurai.results import jobs


class Down(fakeredis.FakeRedis):
    """Every round trip fails: pipelines and the packed writes' connections."""

    def __init__(self) -> None:
        super().__init__()

        def refused(*a, **kw):
            raise redis.ConnectionError("down")

        self.connection_pool.get_connection = refused

    def pipeline(self, *a, **kw):
        raise redis.ConnectionError("down")


def test_a_failed_store_keeps_the_result_and_a_lost_write_drops_the_held_tokens() -> None:
    w = Writer(Down(), Settings(), "w1")
    (held,) = w.deltas([jobs.Delta("job-12345678", "abc", [1, 2, 3])])
    entry = (keys.request_stream("standard"), b"1-0")
    final = w.final("job-12345678", "standard", entry, "cancelled", "abort", [], jobs.RESYNC_AUTO)
    with pytest.raises(redis.ConnectionError):
        w.store([held, final])
    assert [c.script for c in w.unsent] == ["DELTAS", "FINALIZE"]
    w.lost_writes()
    assert [c.script for c in w.unsent] == ["FINALIZE"]
    assert w.unsent[0] == jobs.resynced(final)  # it rewrites the whole stream
