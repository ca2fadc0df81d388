"""200 jobs, mixed lanes, priorities and lengths, through 2 worker processes: each job
gets exactly one result, equal to the engine's offline output for the same request."""

from __future__ import annotations

import random

import redis

from plurai.broker_config import keys
from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.engine import Engine
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.producer.client import Client
from plurai.results import records

from .faults import drained

WORDS = "the a river stone light north quiet letter garden winter paper machine city old".split()


def make_requests(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        req: dict = {
            "max_tokens": rng.randint(1, 12),
            "lane": rng.choice(["interactive", "standard", "batch"]),
            "priority": rng.randint(0, 3),
            "temperature": 0.0,
            "metadata": {"i": i},
        }
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        if i % 10 == 3:
            req["token_ids"] = [rng.randrange(3, 2000) for _ in range(rng.randint(1, 30))]
        elif i % 10 == 7:
            req["messages"] = [{"role": "user", "content": text}]
        else:
            req["prompt"] = text
        reqs.append(req)
    return reqs


def offline(model: str, reqs: list[dict]) -> list[tuple[list[int], str]]:
    engine = Engine(EngineConfig(model=model, kv_cache_bytes=32 << 20, threads=1, dtype="fp32"))
    prompts = []
    for req in reqs:
        if "messages" in req:
            prompts.append(engine.tokenize(messages=req["messages"]))
        else:
            prompts.append(req.get("prompt") or req["token_ids"])
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0) for r in reqs]
    return [(c.token_ids, c.text) for c in engine.generate(prompts, params)]


def test_200_jobs_two_workers_match_offline(redis_url, workers, tiny_model):
    reqs = make_requests(200)
    workers.start(2)
    client = Client(redis_url)
    jobs = client.submit_many(reqs)
    assert len({j.id for j in jobs}) == 200
    expected = offline(str(tiny_model), reqs)  # computed while the workers serve
    recs = client.wait_all(jobs, timeout=300)

    for req, rec, (ids, text) in zip(reqs, recs, expected, strict=True):
        assert rec.state == records.COMPLETED, (rec.error_code, rec.error_message)
        assert rec.token_ids == ids
        assert rec.text == text
        assert rec.output_tokens == len(ids)
        assert rec.metadata == req["metadata"]
        assert rec.lane == req["lane"]
    served_by = {rec.worker for rec in recs}
    assert len(served_by) == 2  # both workers took jobs

    r = redis.Redis.from_url(redis_url)
    assert drained(r)  # every entry acked, after its result
    # one terminal entry per job stream, and the streamed text equals the stored text
    for job, rec in zip(jobs[:20], recs[:20], strict=True):
        entries = r.xrange(keys.output(job.id))
        types = [f[b"type"] for _, f in entries]
        assert types.count(b"end") == 1 and types[-1] == b"end"
        streamed = "".join(f[b"text"].decode() for _, f in entries if f[b"type"] == b"delta")
        assert streamed == rec.text
    assert workers.stop() == [0, 0]
