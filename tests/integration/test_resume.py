"""Jobs that move: a job cut off on one worker resumes on another from its progress, to the
same tokens, text and logprobs as an uninterrupted run, and its token stream, read from the
start, has no reset and spells the record's text. Workers run in-process on the tiny model
(fp32); a cut is a drain (the worker hands its jobs back with their progress) or a crash
(the worker is dropped unannounced: its progress is what its last write left, and another
worker reclaims its entry). Damaged progress starts the job over with a reset. The first
worker does not speculate, the second does (several tokens a step)."""

from __future__ import annotations

import json
import random
import time

import pytest
import redis

from plurai.broker_config import keys
from plurai.broker_config.connection import connect
from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.engine import Engine
from plurai.gpu_workers.worker import Worker
from plurai.producer.client import Client
from plurai.results import progress, records
from tests.helpers import driven_worker, oracle, turn_until

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
CASES = {
    "greedy": dict(max_tokens=40, ignore_eos=True),
    "seeded": dict(max_tokens=40, ignore_eos=True, temperature=1.0, top_p=0.9, seed=7),
    "penalties": dict(
        max_tokens=40,
        ignore_eos=True,
        temperature=0.8,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
    ),
    "logprobs": dict(max_tokens=24, ignore_eos=True, logprobs=3),
    "schema": dict(
        max_tokens=48,
        temperature=1.0,
        seed=11,
        response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}},
    ),
    "no-stream": dict(max_tokens=40, ignore_eos=True, temperature=1.0, seed=5, stream=False),
}


@pytest.fixture(scope="module")
def engines(tiny_model):
    # the second speculates: a job cut on the first goes on there several tokens a step
    spec = dict(speculative="ngram", ngram_min=1)
    made = [
        Engine(
            EngineConfig(
                model=str(tiny_model),
                kv_cache_bytes=8 << 20,
                threads=1,
                dtype="fp32",
                **(spec if i == 1 else {}),
            )
        )
        for i in range(2)
    ]
    yield made
    for e in made:
        e.close()


def worker(url: str, engine: Engine, name: str, **settings) -> Worker:
    return driven_worker(
        url, engine, name, reclaim_idle_ms=300, reclaim_interval_s=0.1, heartbeat_interval_s=60,
        **settings,
    )  # fmt: skip


def finish(w: Worker, job_id: str, r: redis.Redis, timeout: float = 60.0) -> records.JobRecord:
    give_up = time.monotonic() + timeout
    while not (rec := records.get(r, job_id)).final:
        assert time.monotonic() < give_up, "the job did not finish"
        w.iterate()
    w.writer.settle()
    return rec


def run_until(w: Worker, job_id: str, tokens: int) -> None:
    """Turn the worker until the job has made `tokens` tokens here."""
    turn_until(w, lambda: job_id in w.running and w.running[job_id].num_tokens >= tokens)


def stream_types(r: redis.Redis, job_id: str) -> list[bytes]:
    return [f[b"type"] for _, f in r.xrange(keys.output(job_id))]


def stream_text(r: redis.Redis, job_id: str, index: int | None = None) -> tuple[str, list[int]]:
    """The text and ids of the deltas after the last reset: what a reader ends up with; of
    choice `index` only, where given (a job of n > 1 choices)."""
    entries = [f for _, f in r.xrange(keys.output(job_id))]
    types = [f[b"type"] for f in entries]
    cut = max((i for i, t in enumerate(types) if t == b"reset"), default=-1)
    deltas = [f for f in entries[cut + 1 :] if f[b"type"] == b"delta"]
    if index is not None:
        deltas = [f for f in deltas if f[b"index"] == str(index).encode()]
    return "".join(f[b"text"].decode() for f in deltas), [
        t for f in deltas for t in json.loads(f[b"token_ids"])
    ]


def resumed(w: Worker) -> int:
    return sum(int(w.metrics.jobs_resumed.labels(lane)._value.get()) for lane in w.lanes)


def same_logprobs(a: list[dict] | None, b: list[dict] | None) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        x["token_id"] == y["token_id"]
        and abs(x["logprob"] - y["logprob"]) < 1e-4
        and [t for t, _ in x.get("top", [])] == [t for t, _ in y.get("top", [])]
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("how", ["drain", "crash"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_cut_job_resumes_to_the_uninterrupted_output(redis_url, engines, case, how, monkeypatch):
    r = connect(redis_url)
    client = Client(redis_url)
    body = CASES[case]
    prompt = f"resume the {case} job"
    one = worker(redis_url, engines[0], "w1", stream_flush_tokens=1 if how == "crash" else 16)
    ref = records.get(r, client.submit(prompt, **body).id)
    ref = finish(one, ref.id, r)
    assert ref.state == records.COMPLETED and ref.output_tokens >= 8, ref
    # the speculating worker proposes from the uninterrupted output, some tokens changed
    oracle(monkeypatch, [ref.token_ids], engines[1].vocab_size)
    cut = random.Random(f"{case}/{how}").randrange(1, ref.output_tokens - 1)

    job = client.submit(prompt, **body)
    run_until(one, job.id, cut)
    if how == "drain":
        one.request_stop(0)
        one._shut(crashed=False)  # the hand-back: progress written, entry re-added
    else:  # dropped: its entry stays pending until reclaimed
        one.cancels.close()
    two = worker(redis_url, engines[1], "w2")
    if how == "crash":
        time.sleep(0.4)  # past the reclaim idle time
    rec = finish(two, job.id, r)

    assert rec.state == records.COMPLETED, rec
    assert rec.token_ids == ref.token_ids and rec.text == ref.text
    assert rec.finish_reason == ref.finish_reason
    assert same_logprobs(rec.logprobs, ref.logprobs)
    assert resumed(two) == 1
    if case not in ("penalties", "schema"):  # those decode one token a step
        assert rec.spec_proposed and rec.spec_accepted, rec
    # the second run generated only what the first had not written out
    resumed_tokens = two.metrics.resumed_tokens._value.get()
    assert cut <= resumed_tokens <= rec.output_tokens
    # the second run's times count from its own first token, not from the epoch
    tpot = [s.value for m in two.metrics.tpot.collect() for s in m.samples]
    sums = [
        s.value for m in two.metrics.tpot.collect() for s in m.samples if s.name.endswith("_sum")
    ]
    assert sums and all(v < 60 for v in sums), tpot
    if resumed_tokens < rec.output_tokens:
        assert rec.first_token_ms is not None and rec.started_ms is not None
        assert rec.first_token_ms >= rec.started_ms - 50
    if body.get("stream", True):
        assert b"reset" not in stream_types(r, job.id)
        assert stream_text(r, job.id) == (rec.text, rec.token_ids)
    assert r.exists(keys.progress(job.id)) == 0  # gone with the result
    client.close()


@pytest.mark.parametrize("how", ["drain", "crash"])
def test_a_cut_job_of_two_choices_resumes_each(redis_url, engines, how, monkeypatch):
    r = connect(redis_url)
    client = Client(redis_url)
    body = dict(max_tokens=30, ignore_eos=True, temperature=1.0, seed=9, n=2)
    prompt = "resume both choices"
    one = worker(redis_url, engines[0], "w1", stream_flush_tokens=1 if how == "crash" else 16)
    free = finish(one, client.submit(prompt, **body).id, r)
    a, b = (c.token_ids for c in free.choices)
    # a stop token that ends choice 1 early and never appears in choice 0: the cut comes
    # after choice 1 has ended
    k = next(k for k in range(3, 10) if b[k] not in a and b[k] not in b[:k])
    body["stop_token_ids"] = [b[k]]
    ref = finish(one, client.submit(prompt, **body).id, r)
    assert [c.finish_reason for c in ref.choices] == ["length", "stop"]
    assert len(ref.choices[1].token_ids) == k + 1
    oracle(monkeypatch, [c.token_ids for c in ref.choices], engines[1].vocab_size)

    job = client.submit(prompt, **body)
    run_until(one, job.id, 2 * (k + 1) + 6)
    assert one.running[job.id].choices[1].finish_reason == "stop"
    if how == "drain":
        one.request_stop(0)
        one._shut(crashed=False)
    else:
        one.cancels.close()
    two = worker(redis_url, engines[1], "w2")
    if how == "crash":
        time.sleep(0.4)
    rec = finish(two, job.id, r)

    assert rec.state == records.COMPLETED and resumed(two) == 1
    assert rec.choices == ref.choices
    assert (rec.text, rec.token_ids, rec.finish_reason) == (ref.text, ref.token_ids, "length")
    assert rec.output_tokens == ref.output_tokens == 30 + k + 1
    assert b"reset" not in stream_types(r, job.id)
    for c in rec.choices:
        assert stream_text(r, job.id, c.index) == (c.text, c.token_ids)
    assert r.exists(keys.progress(job.id)) == 0
    client.close()


@pytest.mark.parametrize(
    "damage",
    [
        "garbage",
        "other-model",
        "out-of-vocab",
        "too-many",
        "not-ints",
        "headless",
        "oversized",
        "not-a-string",
    ],
)
def test_damaged_progress_starts_the_job_over(redis_url, engines, damage):
    r = connect(redis_url)
    client = Client(redis_url)
    body = dict(max_tokens=24, ignore_eos=True)
    one = worker(redis_url, engines[0], "w1", stream_flush_tokens=1)
    ref = finish(one, client.submit("start me over", **body).id, r)
    job = client.submit("start me over", **body)
    run_until(one, job.id, 6)
    one.cancels.close()  # dropped mid-run

    head = progress.header(engines[0].model_fingerprint)
    forged = {
        "garbage": head + b"\xc1\xc1not msgpack",
        "other-model": progress.header("0" * 64) + progress.chunk([5, 6, 7], None),
        "out-of-vocab": head + progress.chunk([5, engines[0].vocab_size + 3], None),
        "too-many": head + progress.chunk([5] * 25, None),
        "not-ints": head + progress.chunk(["a", 1.5], None),
        "headless": progress.chunk([5, 6], None),
        "oversized": head + progress.chunk([5] * 6, None) + b"\x00" * (1 << 20),
        "not-a-string": b"",
    }[damage]
    if damage == "not-a-string":
        r.delete(keys.progress(job.id))
        r.hset(keys.progress(job.id), "token_ids", "[5, 6]")
    else:
        r.set(keys.progress(job.id), forged)
    two = worker(redis_url, engines[1], "w2")
    time.sleep(0.4)
    rec = finish(two, job.id, r)
    assert rec.state == records.COMPLETED
    assert rec.token_ids == ref.token_ids and rec.text == ref.text  # one run's, not a mix
    assert resumed(two) == 0
    assert stream_types(r, job.id).count(b"reset") >= 1
    assert stream_text(r, job.id) == (rec.text, rec.token_ids)
    client.close()
