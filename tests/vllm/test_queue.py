"""A vLLM worker on the queue beside a native one (real redis-server, worker processes):
the bad-input matrix gives the same codes, a cancel frees the request, 100 mixed jobs end
with exactly one result each and the vLLM worker's greedy results equal vLLM's own offline
`LLM.generate`, a SIGKILLed vLLM worker's jobs complete once on the native one, and a fresh
vLLM worker's first job loads the prefix the first one computed from Redis."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from plurai.broker_config import keys
from plurai.gpu_workers.vllm_backend import reaper
from plurai.producer.client import Client
from plurai.results import records, wait
from tests.helpers import wait_gone
from tests.integration.faults import (
    FAST,
    LANES,
    count_final,
    drained,
    end_entries,
    final_records,
    pending,
)
from tests.integration.test_worker_bad_input import CASES, entry
from tests.vllm.conftest import MAX_MODEL_LEN, OPTIONS, NativeWorkers, VllmWorkers

pytest.importorskip("vllm", reason="runs in vLLM's environment: make test-vllm")

LIMIT = 200  # max_tokens limit: long enough to cancel a job mid-generation
ENV = {**FAST, "PLURAI_MAX_TOKENS_LIMIT": str(LIMIT)}
LONG = [5 + (k * 13) % 1900 for k in range(220)]  # a prompt holding one full vLLM block (128)


class Fleet:
    def __init__(self, url: str, model: Path, logs: Path) -> None:
        (logs / "vllm").mkdir()
        (logs / "native").mkdir()
        self.vllm = VllmWorkers(url, model, logs / "vllm")
        self.native = NativeWorkers(url, model, logs / "native")
        self.url, self.r = url, redis.Redis.from_url(url)
        self.client = Client(url)
        self.model = model
        self.env: dict[str, str] = {}
        self.first: records.JobRecord | None = None  # LONG, run by the first vLLM worker


@pytest.fixture(scope="module")
def fleet(module_redis_url: str, small_model: Path, tmp_path_factory) -> Iterator[Fleet]:
    f = Fleet(module_redis_url, small_model, tmp_path_factory.mktemp("logs"))
    # the vLLM workers share KV blocks through the queue's Redis
    env = {**ENV, "PLURAI_KV_REDIS_URL": module_redis_url}
    f.env = env
    # its rank bound to a core, as vLLM's CPU docs deploy it
    bind = {"VLLM_CPU_OMP_THREADS_BIND": str(max(os.sched_getaffinity(0)))}
    f.vllm.start(1, "--worker-id", "vllm", "--vllm", "max_num_seqs=16", env={**env, **bind})
    yield f
    f.vllm.stop()
    f.native.stop()


def test_first_run_of_a_long_prompt(fleet: Fleet) -> None:
    fleet.first = fleet.client.submit(token_ids=LONG, max_tokens=8).result(timeout=60)
    assert fleet.first.worker == "vllm" and fleet.first.cached_tokens == 0


def test_bad_input_matrix_same_codes(fleet: Fleet) -> None:
    """The pipeline's bad-input matrix (tests/integration/test_worker_bad_input.py) on the
    vLLM worker alone; its max_tokens limit is LIMIT here."""
    cases = [c for c in CASES if c[0] != "max_tokens over limit"]
    cases.append(
        (
            "max_tokens over limit",
            entry(max_tokens=str(LIMIT + 1)),
            "max_tokens_over_limit",
            str(LIMIT),
        )
    )
    cases = [
        (name, fields, code, hint.replace("255", str(MAX_MODEL_LEN - 1)))
        for name, fields, code, hint in cases
    ]
    stream = keys.request_stream("standard")
    for _, fields, _, _ in cases:
        fleet.r.xadd(stream, fields)
    good = entry({"prompt": "still serving", "temperature": 0})
    fleet.r.xadd(stream, good)
    recs = wait.wait_many(fleet.r, [c[1]["id"] for c in cases] + [good["id"]], timeout=120)
    got = [
        (c[0], rec.state, rec.error_code, c[3] in (rec.error_message or ""))
        for c, rec in zip(cases, recs[:-1], strict=True)
    ]
    assert got == [(c[0], records.FAILED, c[2], True) for c in cases]
    assert recs[-1].state == records.COMPLETED and recs[-1].output_tokens == 4
    assert {rec.worker for rec in recs} == {"vllm"}


def test_a_job_of_two_choices(fleet: Fleet) -> None:
    """Through the queue on the vLLM worker: a choice per index in the record and on the
    stream; greedy choices equal, seeded ones each the job of its seed."""
    greedy = fleet.client.submit("two the same", max_tokens=6, n=2, ignore_eos=True)
    seeded = fleet.client.submit(
        "two of their own", max_tokens=6, n=2, temperature=1.0, seed=8, ignore_eos=True
    )
    alone = [
        fleet.client.submit(
            "two of their own", max_tokens=6, temperature=1.0, seed=8 + i, ignore_eos=True
        )
        for i in range(2)
    ]
    same, own, *ones = (job.result(timeout=120) for job in (greedy, seeded, *alone))
    assert {rec.worker for rec in (same, own, *ones)} == {"vllm"}
    assert [c.index for c in same.choices] == [0, 1] and same.output_tokens == 12
    assert same.choices[0].token_ids == same.choices[1].token_ids
    assert [c.token_ids for c in own.choices] == [rec.token_ids for rec in ones]
    streamed: dict[int, str] = {}
    for i, text in seeded.stream_choices():
        streamed[i] = streamed.get(i, "") + text
    assert streamed == {c.index: c.text for c in own.choices}


def figures(r: redis.Redis, worker: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(keys.worker(worker)).items()}


def test_cancel_mid_generation_frees_the_request(fleet: Fleet) -> None:
    job = fleet.client.submit(prompt="a long story", max_tokens=LIMIT, ignore_eos=True)
    give_up = time.monotonic() + 60
    while sum(1 for _, f in fleet.r.xrange(keys.output(job.id)) if f[b"type"] == b"delta") < 2:
        assert time.monotonic() < give_up, "no tokens streamed"
        time.sleep(0.005)
    job.cancel()
    rec = wait.wait(fleet.r, job.id, timeout=30)
    assert rec.state == records.CANCELLED and 0 < (rec.output_tokens or 0) < LIMIT
    give_up = time.monotonic() + 20
    while (f := figures(fleet.r, "vllm")).get("running") != "0" or f.get("kv_blocks_used") != "0":
        assert time.monotonic() < give_up, f"the request still holds the engine: {f}"
        time.sleep(0.1)
    after = fleet.client.submit(prompt="after the cancel", max_tokens=5).result(timeout=60)
    assert after.state == records.COMPLETED and after.output_tokens == 5


def mixed(i: int) -> dict:
    """Job i of the mixed load: greedy text, chat and token-id prompts, seeded sampling,
    stop strings, logprobs, every lane, priorities, streaming on and off."""
    common = {"lane": LANES[i % 3], "priority": i % 7 - 3, "stream": i % 4 != 0}
    kind = i % 5
    if kind == 0:
        return {**common, "prompt": f"greedy text number {i} about rivers", "max_tokens": 16}
    if kind == 1:
        return {**common, "messages": [{"role": "user", "content": f"chat {i}"}], "max_tokens": 12}
    if kind == 2:
        return {
            **common,
            "token_ids": [5 + (i * 7 + k) % 1500 for k in range(40 + i)],
            "max_tokens": 10,
        }
    if kind == 3:
        return {
            **common,
            "prompt": f"sampled {i}",
            "max_tokens": 8,
            "temperature": 0.8,
            "top_p": 0.9,
            "seed": i,
        }
    return {
        **common,
        "prompt": f"with logprobs {i}",
        "max_tokens": 6,
        "logprobs": 2,
        "stop": ["zz"],
    }


def reference(model: Path, jobs: list[dict]) -> list[list[int]]:
    """vLLM's own offline greedy tokens for the jobs, from the same token ids."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    from plurai.gpu_workers.prompts import Prompts

    tok = AutoTokenizer.from_pretrained(model)
    prompts = Prompts(tok, len(tok), MAX_MODEL_LEN)
    ids = [prompts.tokenize(j.get("prompt"), j.get("token_ids"), j.get("messages")) for j in jobs]
    llm = LLM(model=str(model), **OPTIONS)
    params = [
        SamplingParams(temperature=0, max_tokens=j["max_tokens"], stop=j.get("stop")) for j in jobs
    ]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
    del llm
    return [list(o.outputs[0].token_ids) for o in outs]


def test_mixed_fleet_100_jobs(fleet: Fleet) -> None:
    reqs = [mixed(i) for i in range(100)]
    # half while the vLLM worker serves alone, half once the native one shares the queue
    jobs = fleet.client.submit_many(reqs[:50])
    fleet.native.start(1, "--worker-id", "native", env=ENV)
    jobs += fleet.client.submit_many(reqs[50:])
    ids = [j.id for j in jobs]
    recs = final_records(fleet.url, ids)
    assert [rec.state for rec in recs] == [records.COMPLETED] * 100
    assert end_entries(fleet.r, ids) == [1] * 100
    assert pending(fleet.r) == 0
    by = {w: [i for i, rec in enumerate(recs) if rec.worker == w] for w in ("vllm", "native")}
    assert by["vllm"] and by["native"] and len(by["vllm"]) + len(by["native"]) == 100
    for i in by["vllm"]:
        rec = recs[i]
        assert rec.output_tokens == len(rec.token_ids or []) <= reqs[i]["max_tokens"]
        if "logprobs" in reqs[i]:
            assert [e["token_id"] for e in rec.logprobs or []] == rec.token_ids
            assert all(len(e["top"]) == 2 for e in rec.logprobs or [])
    greedy = [i for i in by["vllm"] if "temperature" not in reqs[i]]
    assert len(greedy) >= 10
    want = reference(fleet.model, [reqs[i] for i in greedy])
    assert [recs[i].token_ids for i in greedy] == want


def test_the_engine_core_runs_on_the_cores_of_its_rank(fleet: Fleet) -> None:
    """vLLM binds its rank to cores and leaves the engine core free; the worker binds the
    engine core to the rank's cores (cores.py), so that its spin while the rank computes
    takes no other engine's core."""
    (worker,) = fleet.vllm.procs
    procs = {p: Path(f"/proc/{p}/comm").read_text().strip() for p in reaper.descendants(worker.pid)}
    (rank,) = [p for p, name in procs.items() if name.startswith("VLLM::Worker")]
    (core,) = [p for p, name in procs.items() if name.startswith("VLLM::EngineCor")]
    cores = os.sched_getaffinity(rank)
    assert cores == {max(os.sched_getaffinity(0))}
    threads = [int(t.name) for t in Path(f"/proc/{core}/task").iterdir()]
    assert len(threads) > 1 and {frozenset(os.sched_getaffinity(t)) for t in threads} == {
        frozenset(cores)
    }


def test_sigkill_vllm_worker_jobs_complete_on_native(fleet: Fleet) -> None:
    (victim,) = fleet.vllm.procs
    jobs = fleet.client.submit_many(
        [
            {"prompt": f"crash job {i}", "max_tokens": 30, "ignore_eos": True, "lane": LANES[i % 3]}
            for i in range(100)
        ]
    )
    ids = [j.id for j in jobs]
    give_up = time.monotonic() + 120
    while not (count_final(fleet.r, ids) >= 5 and pending(fleet.r, "vllm") > 0):
        assert time.monotonic() < give_up, "the vLLM worker never ran jobs"
        time.sleep(0.01)
    engine = reaper.descendants(victim.pid)  # vLLM's engine core, and what it started
    assert engine
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    stranded = {
        fleet.r.xrange(keys.request_stream(lane), p["message_id"], p["message_id"])[0][1][
            b"id"
        ].decode()
        for lane in LANES
        for p in fleet.r.xpending_range(
            keys.request_stream(lane), keys.GROUP, "-", "+", 200, "vllm"
        )
    }
    # an entry is acked just after its result is stored: the kill may fall between the two
    unfinished = {rec.id for rec in records.get_many(fleet.r, list(stranded)) if not rec.final}
    assert unfinished
    recs = final_records(fleet.url, ids)
    assert [rec.state for rec in recs] == [records.COMPLETED] * 100
    assert all(rec.output_tokens == 30 for rec in recs)
    assert end_entries(fleet.r, ids) == [1] * 100
    assert drained(fleet.r)
    assert {rec.worker for rec in recs if rec.id in unfinished} == {"native"}
    # the engine's processes died with the worker (reaper.py): none left holding memory
    assert wait_gone(engine)


def test_fresh_vllm_worker_loads_the_prefix_from_redis(fleet: Fleet) -> None:
    """After the first vLLM worker is gone, a fresh one (empty local cache) takes LONG's
    block from Redis: cached_tokens > 0 and the same tokens as the first worker's."""
    fleet.native.stop()
    fleet.vllm.start(1, "--worker-id", "vllm-b", env=fleet.env)
    rec = fleet.client.submit(token_ids=LONG, max_tokens=8).result(timeout=60)
    assert fleet.first is not None
    assert rec.worker == "vllm-b" and (rec.cached_tokens or 0) >= 128
    assert rec.token_ids == fleet.first.token_ids
    give_up = time.monotonic() + 10  # the next heartbeat carries the hit
    while float(figures(fleet.r, "vllm-b").get("prefix_hit_rate", 0)) <= 0:
        assert time.monotonic() < give_up, str(figures(fleet.r, "vllm-b"))
        time.sleep(0.1)
    # the worker's Prometheus endpoint shows vLLM's figures under the native names; they are
    # copied from the backend once a second, so the job's end shows within a second or two
    port = figures(fleet.r, "vllm-b")["metrics_port"]

    def scrape() -> dict[str, str]:
        url = f"http://127.0.0.1:{port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        lines = [line for line in text.splitlines() if line and not line.startswith("#")]
        return dict(line.rsplit(" ", 1) for line in lines)

    metrics = scrape()
    while metrics["plurai_running_sequences"] != "0.0":
        assert time.monotonic() < give_up + 5, metrics["plurai_running_sequences"]
        time.sleep(0.2)
        metrics = scrape()
    assert float(metrics['plurai_prefix_cache_hit_blocks_total{tier="redis"}']) >= 1
    assert float(metrics["plurai_kv_blocks_capacity"]) > 0
    assert "plurai_kv_blocks_cached" not in metrics  # vLLM does not report it
