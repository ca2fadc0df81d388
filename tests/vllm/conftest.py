"""Fixtures for the vLLM backend's tests, which run in vLLM's own environment
(`make test-vllm`: .venv-vllm). Without vLLM installed they are not collected."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

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


@pytest.fixture(scope="session")
def small_model(model_factory) -> Path:
    """head_dim 64: the smallest vLLM's CPU attention takes."""
    return model_factory("llama", size="small")
