"""A model of a size users run (Qwen2.5-0.5B's shapes, from the factory) serves a job
through the queue, its tokens those of transformers on the same folder."""

from __future__ import annotations

import subprocess
import sys

import pytest

from plurai.producer.client import Client
from plurai.results import records

from ..conftest import reference_greedy
from .conftest import ROOT, Workers


@pytest.mark.model
def test_a_half_billion_parameter_model_serves_a_job_as_transformers_runs_it(redis_url, tmp_path):
    model = tmp_path / "qwen-0.5b"
    made = subprocess.run(
        [sys.executable, "-m", "plurai.cli", "make-model", str(model), "--size", "0.5b"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert made.returncode == 0, made.stderr
    assert "qwen2 model (0.5b)" in made.stdout
    workers = Workers(redis_url, model, tmp_path)
    # fp32, as the reference runs; a KV budget a 0.5B model's blocks fit in
    workers.args = ["--engine", "kv_cache_bytes=67108864", "--engine", "threads=1"]
    workers.args += ["--engine", "dtype=fp32"]
    workers.start(1)
    try:
        prompt = [151, 2024, 77, 4000, 9, 812, 33, 5000]
        job = Client(redis_url).submit(token_ids=prompt, max_tokens=4, ignore_eos=True)
        rec = Client(redis_url).wait_all([job], timeout=300)[0]
        assert rec.state == records.COMPLETED, (rec.error_code, rec.error_message)
        assert rec.token_ids == reference_greedy(model, [prompt], 4)[0]
    finally:
        assert workers.stop() == [0]
