"""Two vLLM-backend workers start side by side on one host with the default memory
settings: each sizes its KV cache at PLURAI_VLLM_KV_SHARE of the host's memory, not at
vLLM's CPU default (nearly all of it, with which the second worker refuses to start), and
both serve the queue."""

from __future__ import annotations

import json
import time

import pytest
import redis

from plurai.broker_config import keys
from plurai.broker_config.settings import Settings
from plurai.gpu_workers.engine.config import host_memory_bytes
from plurai.gpu_workers.vllm_backend.backend import CPU_KV_ENV
from plurai.producer.client import Client
from tests.vllm.conftest import VllmWorkers

pytest.importorskip("vllm", reason="runs in vLLM's environment: make test-vllm")


def test_two_vllm_workers_start_side_by_side(redis_url, small_model, tmp_path, monkeypatch):
    monkeypatch.delenv(CPU_KV_ENV, raising=False)  # the defaults, not the fixtures' 1 GiB
    workers = VllmWorkers(redis_url, small_model, tmp_path)
    try:
        workers.start(2, env={"PLURAI_METRICS_PORT": "0"}, timeout=300)
        r = redis.Redis.from_url(redis_url)
        beats = serving(r)
        give_up = time.monotonic() + 300
        while len(beats) < 2:  # their `starting` heartbeats come first
            assert time.monotonic() < give_up, "the two workers are not both serving"
            assert all(p.poll() is None for p in workers.procs), "a worker exited"
            time.sleep(0.5)
            beats = serving(r)

        # each took its share: the blocks vLLM made of it, at vLLM's CPU block size
        config = json.loads((small_model / "config.json").read_text())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
        budget = host_memory_bytes() * Settings().vllm_kv_share
        for beat in beats:
            tokens = int(beat[b"kv_blocks_total"]) * 128
            assert 0.8 * budget <= tokens * per_token <= budget

        client = Client(redis_url)
        jobs = [client.submit(f"Story {i}:", max_tokens=8, temperature=0) for i in range(4)]
        assert [j.result(timeout=120).state for j in jobs] == ["completed"] * 4
    finally:
        assert workers.stop() == [0, 0]


def serving(r: redis.Redis) -> list[dict[bytes, bytes]]:
    beats = [r.hgetall(keys.worker(w.decode())) for w in r.smembers(keys.WORKERS)]
    return [b for b in beats if b.get(b"state") == b"serving"]
