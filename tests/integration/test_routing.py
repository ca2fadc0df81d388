"""Model routing: each model has its own lanes, and a worker reads only its model's. Two
models served by two workers on one Redis: every job is answered by a worker of its
model. A job for a model no worker serves waits (its lane shows in `plurai status`) and
completes once one starts; with PLURAI_UNSERVED=refuse the SDK refuses it at submit."""

from __future__ import annotations

import time

import pytest

from plurai.broker_config import keys, stats
from plurai.broker_config.connection import connect
from plurai.broker_config.settings import Settings
from plurai.producer import Client
from plurai.producer.errors import UnknownModel
from plurai.results import records

from .conftest import Workers


def test_two_models_and_a_model_that_waits(redis_url, tiny_model, model_factory, tmp_path):
    a = Workers(redis_url, tiny_model, tmp_path / "a")
    b = Workers(redis_url, model_factory("qwen2"), tmp_path / "b")
    for w in (a, b):
        w.log_dir.mkdir()
    try:
        a.start(1, "--served-model", "tiny-a", "--worker-id", "worker-a")
        b.start(1, "--served-model", "tiny-b", "--worker-id", "worker-b")
        client = Client(redis_url)
        reqs = [
            {"prompt": f"job {i}", "max_tokens": 4, "model": ("tiny-a", "tiny-b")[i % 2]}
            for i in range(200)
        ]
        jobs = client.submit_many(reqs)
        recs = client.wait_all(jobs, timeout=180)
        assert [r.state for r in recs] == [records.COMPLETED] * 200
        assert [r.worker for r in recs] == [("worker-a", "worker-b")[i % 2] for i in range(200)]
        # the queue a job went to is in its record; no job met the other model's worker
        r = connect(redis_url, decode=True)
        assert {r.hget(keys.job(j.id), "model") for j in jobs} == {"tiny-a", "tiny-b"}
        assert not r.xlen(keys.DEAD_LETTER)

        # a model nobody serves: the job waits in its own lane, visible in status
        waiting = client.submit("for the third model", max_tokens=4, model="tiny-c")
        time.sleep(1.5)
        assert waiting.status() == "queued"
        snap = stats.snapshot(connect(redis_url), Settings().lanes)
        lane = next(q for q in snap.lanes if (q.model, q.name) == ("tiny-c", "standard"))
        assert (lane.waiting, lane.workers) == (1, 0)
        served = {q.model: q.workers for q in snap.lanes}
        assert served["tiny-a"] == served["tiny-b"] == 1

        refusing = Client(redis_url, settings=Settings(unserved="refuse"))
        with pytest.raises(UnknownModel, match="tiny-d"):
            refusing.submit("refused", max_tokens=4, model="tiny-d")
        assert refusing.submit("served", max_tokens=4, model="tiny-a").result(timeout=60)
        with pytest.raises(ValueError, match="model name"):
            client.submit("bad name", max_tokens=4, model="has:colon")

        a.start(1, "--served-model", "tiny-c", "--worker-id", "worker-c")
        rec = waiting.result(timeout=120)
        assert (rec.state, rec.worker) == (records.COMPLETED, "worker-c")
    finally:
        a.stop()
        b.stop()
