"""Cancellation and deadlines against a worker run in-process on the tiny model: a running
job is aborted at the next loop turn (one engine step at most) and its KV blocks freed; a
job still queued past its deadline ends as expired. Both show in the job record."""

from __future__ import annotations

import time

from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.engine import Engine
from plurai.producer.client import Client
from plurai.results import records
from tests.helpers import driven_worker


def test_cancel_running_and_expire_queued(redis_url, tiny_model):
    engine = Engine(
        EngineConfig(model=str(tiny_model), kv_cache_bytes=8 << 20, threads=1, dtype="fp32")
    )
    free = engine.blocks.num_free
    worker = driven_worker(redis_url, engine, "w1")
    client = Client(redis_url)
    try:
        expired = client.submit("too late", max_tokens=4, deadline=time.time() - 1)
        long = client.submit("keep going", max_tokens=2000, ignore_eos=True, lane="interactive")
        while long.id not in worker.running:
            worker.iterate()
        worker.iterate()
        assert engine.blocks.num_free < free and long.status() == records.RUNNING
        assert long.cancel() == "cancelling"
        time.sleep(0.5)  # the cancel message reaches the worker's subscription
        steps = engine.num_steps
        worker.iterate()
        assert engine.num_steps - steps <= 1
        rec = long.record()
        assert rec.state == records.CANCELLED and rec.finish_reason == "abort"
        assert 0 < rec.output_tokens < 2000
        assert not engine.has_unfinished() and engine.blocks.num_free == free  # blocks freed

        while not expired.record().final:
            worker.iterate()
        rec = expired.record()
        assert rec.state == records.FAILED and rec.error_code == "deadline_exceeded"
        assert rec.output_tokens == 0
    finally:
        worker.cancels.close()
        client.close()
        engine.close()
