"""Fixtures for the vLLM backend's tests, which run in vLLM's own environment
(`make test-vllm`: .venv-vllm). Without vLLM installed they are not collected."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import ENGINE_ARGS, Workers

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]

MAX_MODEL_LEN = 256
# One vLLM engine starts in ~20 s here; a small KV cache keeps several beside each other.
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
OPTIONS = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "enforce_eager": True}
VLLM_ARGS = ["--backend", "vllm"] + [
    a for k, v in OPTIONS.items() for a in ("--vllm", f"{k}={str(v).lower()}")
]
NATIVE_ARGS = [*ENGINE_ARGS, "--engine", f"max_model_len={MAX_MODEL_LEN}"]

os.environ.update(ENV)  # for engines made in the test process too


class VllmWorkers(Workers):
    args = VLLM_ARGS


class NativeWorkers(Workers):
    args = NATIVE_ARGS


MAX_SEQS = 8  # the in-process backend's sequences


@pytest.fixture(scope="session")
def backend(small_model: Path) -> Iterator[Any]:
    """One VllmBackend for test_backend.py and test_structured.py (an engine start costs
    ~10 s here), its engine core in this process so that a step sees every request added
    before it (the workers of test_queue.py run the core in its own process)."""
    from plurai.gpu_workers.vllm_backend.backend import VllmBackend

    options = {**OPTIONS, "max_num_seqs": MAX_SEQS}
    b = VllmBackend(str(small_model), options=options, engine_process=False)
    yield b
    b.close()


@pytest.fixture(scope="session")
def small_model(model_factory) -> Path:
    """head_dim 64: the smallest vLLM's CPU attention takes."""
    return model_factory("llama", size="small")
