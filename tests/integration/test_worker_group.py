"""Worker groups: a tensor-parallel group serves the queue like any worker, and a group
that loses a rank exits non-zero while another worker finishes its jobs."""

from __future__ import annotations

import os
import signal
import time

import redis

from plurai.gpu_workers.engine.engine import Engine, EngineConfig
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.producer.client import Client
from plurai.results import records

from .faults import FAST, count_final, end_entries, final_records, pending


def test_tp2_group_serves_the_queue(redis_url, workers, tiny_model):
    workers.start(1, "--tp", "2")
    client = Client(redis_url)
    prompts = [f"Group question {i}: " + "plai stou " * (i % 7) for i in range(12)]
    jobs = client.submit_many(
        [{"prompt": p, "max_tokens": 10, "ignore_eos": True} for p in prompts]
    )
    recs = [job.result(timeout=120) for job in jobs]
    offline = Engine(EngineConfig(model=str(tiny_model), dtype="fp32", kv_cache_bytes=32 << 20))
    expected = offline.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [r.state for r in recs] == [records.COMPLETED] * 12
    assert [r.token_ids for r in recs] == [c.token_ids for c in expected]


def test_a_group_that_loses_a_rank_exits_and_its_jobs_finish_elsewhere(redis_url, workers):
    (group,) = workers.start(1, "--tp", "2", "--worker-id", "group", env=FAST)
    client = Client(redis_url)
    # lengths from 6 to 123 tokens: early jobs finish while the rest still run
    jobs = client.submit_many(
        [
            {"prompt": f"job {i} for the group", "max_tokens": 6 + 3 * i, "ignore_eos": True}
            for i in range(40)
        ]
    )
    ids = [j.id for j in jobs]
    r = redis.Redis.from_url(redis_url)
    give_up = time.monotonic() + 120
    while not (count_final(r, ids) >= 2 and pending(r, "group") > 0):
        assert time.monotonic() < give_up, "the group never ran jobs"
        time.sleep(0.02)
    with open(f"/proc/{group.pid}/task/{group.pid}/children") as f:
        (rank1,) = (int(pid) for pid in f.read().split())  # the group's other rank
    os.kill(rank1, signal.SIGKILL)
    assert group.wait(timeout=60) != 0  # the whole group stops, with an error
    workers.start(1, "--worker-id", "rescuer", env=FAST)
    recs = final_records(redis_url, ids)
    assert [rec.state for rec in recs] == [records.COMPLETED] * 40
    assert end_entries(r, ids) == [1] * 40
    assert "rescuer" in {rec.worker for rec in recs}
