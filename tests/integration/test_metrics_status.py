"""Operations against a live worker process: its /metrics endpoint moves by exactly what the
jobs did, `plurai status --json` shows the lanes, workers and KV figures the test set up,
and the JSON logs carry each job's id.

The worker runs one sequence at a time (max_num_seqs=1), so while a long job runs the
lower lanes are not read (the top-lane reserve) and the test knows exactly what waits."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import redis
from prometheus_client.parser import text_string_to_metric_families

from plurai.broker_config import keys
from plurai.producer.client import Client
from plurai.results import records

from .conftest import ROOT

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


QUEUE_GAUGES = ("plurai_queue_depth", "plurai_queue_pending", "plurai_queue_oldest_age_seconds")


def value(m: Samples, name: str, **labels: str) -> float:
    if name in QUEUE_GAUGES:  # per model and lane
        labels = {"model": "default", **labels}
    return m.get((name, frozenset(labels.items())), 0.0)


def until(what: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout}s: {what.__doc__ or what}")
        time.sleep(0.2)


def status_json(url: str) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, "-m", "plurai.cli", "status", "--json", "--url", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_metrics_status_and_logs_follow_the_jobs(redis_url, workers):
    workers.start(
        1,
        *("--metrics-port", "0", "--log-format", "json", "--log-level", "debug"),
        *("--engine", "max_num_seqs=1"),
    )
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    (worker_id,) = r.smembers(keys.WORKERS)
    port = int(r.hget(keys.worker(worker_id), "metrics_port") or 0)
    assert port > 0
    before = scrape(port)
    assert value(before, "plurai_workers") == 1 and value(before, "plurai_redis_up") == 1

    client = Client(redis_url)
    long = client.submit(token_ids=[7] * 20, max_tokens=4000, ignore_eos=True)
    until(lambda: long.status() == records.RUNNING)
    prefix = list(range(10, 50))  # 40 tokens: two full 16-token blocks shared by all three
    good = [
        client.submit(token_ids=[*prefix, 60 + i], max_tokens=4, ignore_eos=True) for i in range(3)
    ]
    bad = client.submit(token_ids=[1, 10**7], max_tokens=4)  # outside the vocabulary

    # While the long job runs: 4 entries wait in `standard`, 1 is pending (the long job).
    def busy() -> Samples | None:
        m = scrape(port)
        ok = (
            value(m, "plurai_queue_depth", lane="standard") == 4
            and value(m, "plurai_queue_pending", lane="standard") == 1
            and value(m, "plurai_running_sequences") == 1
            and value(m, "plurai_kv_blocks_used") > 0
        )
        return m if ok else None

    m = until(busy)
    assert value(m, "plurai_queue_oldest_age_seconds", lane="standard") > 0
    assert value(m, "plurai_queue_depth", lane="interactive") == 0

    def status_busy() -> dict[str, Any] | None:
        s = status_json(redis_url)
        return s if s["workers"] and s["workers"][0]["running"] == 1 else None

    s = until(status_busy)
    lanes = {lane["name"]: lane for lane in s["lanes"]}
    assert (lanes["standard"]["waiting"], lanes["standard"]["pending"]) == (4, 1)
    assert lanes["standard"]["oldest_waiting_age_s"] > 0
    assert (lanes["interactive"]["waiting"], lanes["batch"]["waiting"]) == (0, 0)
    (w,) = s["workers"]
    assert w["id"] == worker_id and w["state"] == "serving" and w["metrics_port"] == port
    assert w["kv_blocks_total"] == value(m, "plurai_kv_blocks_capacity") > 0
    assert 0 < w["kv_blocks_used"] <= w["kv_blocks_total"]
    assert s["totals"]["waiting"] == 4 and s["totals"]["workers"] == 1

    assert long.cancel() == "cancelling"
    jobs = [long, *good, bad]
    recs = {rec.id: rec for rec in client.wait_all(jobs, timeout=60)}
    assert recs[long.id].state == records.CANCELLED
    assert [recs[j.id].state for j in good] == [records.COMPLETED] * 3
    assert recs[bad.id].error_code == "token_out_of_vocab"
    ran = [recs[j.id] for j in [long, *good]]

    def settled() -> Samples | None:
        m = scrape(port)
        done = value(m, "plurai_jobs_finished_total", lane="standard", state="completed")
        return m if done == 3 and value(m, "plurai_running_sequences") == 0 else None

    after = until(settled)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("plurai_jobs_started_total", lane="standard") == 4
    assert delta("plurai_jobs_finished_total", lane="standard", state="cancelled") == 1
    assert delta("plurai_jobs_finished_total", lane="standard", state="failed") == 1
    assert delta("plurai_errors_total", code="token_out_of_vocab") == 1
    assert delta("plurai_generation_tokens_total") == sum(len(x.token_ids or []) for x in ran)
    assert sum(len(x.token_ids or []) for x in ran[1:]) == 12
    assert delta("plurai_prompt_tokens_total") == sum(x.prompt_tokens or 0 for x in ran)
    cached = sum(x.cached_tokens or 0 for x in ran)
    assert cached == 64  # the second and third jobs each reuse the two shared blocks
    assert delta("plurai_cached_prompt_tokens_total") == cached
    assert delta("plurai_prefix_cache_hit_blocks_total", tier="device") * 16 == cached
    assert delta("plurai_prefix_cache_lookup_blocks_total") >= 6
    for name in ("time_to_first_token", "time_per_output_token", "queue_wait"):
        assert delta(f"plurai_{name}_seconds_count", lane="standard") == 4, name
    assert delta("plurai_e2e_request_latency_seconds_count", lane="standard") == 5
    e2e = delta("plurai_e2e_request_latency_seconds_sum", lane="standard")
    assert e2e >= delta("plurai_time_to_first_token_seconds_sum", lane="standard") > 0
    assert delta("plurai_heartbeats_total") > 0
    assert delta("plurai_engine_steps_total") >= 3 * 4
    for lane in ("interactive", "standard", "batch"):
        assert value(after, "plurai_queue_depth", lane=lane) == 0
        assert value(after, "plurai_queue_pending", lane=lane) == 0
    assert value(after, "plurai_kv_blocks_used") == 0

    def status_done() -> dict[str, Any] | None:
        s = status_json(redis_url)
        return s if s["workers"][0]["jobs_done"] == 5 else None

    s = until(status_done)
    assert s["totals"]["waiting"] == 0 and s["totals"]["pending"] == 0
    assert s["workers"][0]["generation_tokens"] == delta("plurai_generation_tokens_total")
    assert s["workers"][0]["prefix_hit_rate"] > 0

    # JSON lines: each job's end is logged with its id and state.
    workers.stop()
    lines = [json.loads(x) for x in workers.log(0).splitlines() if x.startswith("{")]
    ends = {x["job_id"]: x for x in lines if x["message"] == "job finished"}
    assert {j: ends[j]["state"] for j in recs} == {j: rec.state for j, rec in recs.items()}
    assert ends[bad.id]["code"] == "token_out_of_vocab"
    assert all({"ts", "level", "logger", "message"} <= set(x) for x in lines)
    client.close()
