"""A quantized checkpoint served through the queue: each job's tokens equal the engine's
offline output on the dequantized weights; a broken one stops the worker at start with a
message, before it takes any job."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.engine import Engine
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.producer.client import Client
from plurai.results import records
from tests.quant_checkpoints import write


def test_a_gptq_model_serves_jobs_as_its_dequantized_weights_compute(
    redis_url, workers_class, tiny_model, tmp_path
):
    model = tmp_path / "gptq"
    reference = write(tiny_model, model, "gptq", bits=4, group=32, act_order=True)
    w = workers_class(redis_url, model, tmp_path)
    try:
        w.start(1)
        client = Client(redis_url)
        reqs = [
            {"token_ids": [20 + i, 300 + 7 * i, 41, 1000 - i], "max_tokens": 8, "temperature": 0}
            for i in range(6)
        ]
        jobs = client.submit_many(reqs)
        offline = Engine(
            EngineConfig(model=str(reference), dtype="fp32", kv_cache_bytes=8 << 20, threads=1)
        ).generate([r["token_ids"] for r in reqs], SamplingParams(max_tokens=8, temperature=0))
        recs = client.wait_all(jobs, timeout=120)
    finally:
        w.stop()
    for rec, want in zip(recs, offline, strict=True):
        assert rec.state == records.COMPLETED, (rec.error_code, rec.error_message)
        assert rec.token_ids == want.token_ids


def test_a_checkpoint_missing_scales_stops_the_worker_at_start(
    redis_url, workers_class, tiny_model, tmp_path
):
    model = tmp_path / "broken"
    write(tiny_model, model, "awq", group=32)
    tensors = load_file(str(model / "model.safetensors"))
    del tensors["model.layers.0.mlp.down_proj.scales"]
    save_file(tensors, str(model / "model.safetensors"))
    w = workers_class(redis_url, model, tmp_path)
    with pytest.raises(RuntimeError, match="exited early"):
        w.start(1, timeout=120)
    assert w.procs[0].wait(timeout=30) != 0
    assert "model.layers.0.mlp.down_proj is missing scales" in w.log(0)
    assert "Traceback" not in w.log(0)
