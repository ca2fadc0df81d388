"""vLLM's CPU build on this host's ISA, beyond quantized checkpoints (test_quantized.py):
an unquantized model in bf16 without torch.compile runs vLLM's own AMX attention kernel
first, which on an AMX CPU needs the tile state asked for (cpu_support.allow_amx, run by
vLLM in each of its processes as a general plugin)."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest

from plurai.gpu_workers.vllm_backend import cpu_support
from tests.vllm.test_quantized import start

pytest.importorskip("vllm", reason="runs in vLLM's environment: make test-vllm")


def test_the_amx_plugin_is_registered_with_vllm() -> None:
    (plugin,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "plurai_amx"]
    assert plugin.load() is cpu_support.allow_amx


def test_bf16_without_compile_generates_on_every_isa(small_model: Path, tmp_path: Path) -> None:
    """On AMX the engine died of SIGILL at its first step before the
    plugin; on other ISAs vLLM takes another attention kernel."""
    rc, out, both = start(small_model, "bfloat16", tmp_path)
    assert rc == 0 and "GENERATED" in out, both[-3000:]
