"""Helpers the tests share: prompts and engine drains, and Redis state written by hand
(a worker's heartbeat). Fixtures live in the conftest files."""

from __future__ import annotations

import random
import time

import redis

from broker_config import keys
from gpu_workers.engine.sampling_params import SamplingParams


def prompt(n: int, seed: int) -> list[int]:
    """n random token ids above the tiny models' special tokens, the same for a seed."""
    rng = random.Random(seed)
    return [rng.randrange(16, 2048) for _ in range(n)]


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def drain(engine) -> dict[str, list]:
    """Step until done: every request's outputs, in order."""
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def beat(r: redis.Redis, worker: str, **fields: object) -> None:
    """A serving worker's heartbeat as the worker writes it: its hash (state `serving`,
    stamped now; `fields` add to or replace those) and its name in the worker set."""
    mapping = {"state": "serving", "beat_ms": int(time.time() * 1000), **fields}
    r.hset(keys.worker(worker), mapping=mapping)  # type: ignore[arg-type]
    r.sadd(keys.WORKERS, worker)
