"""What vLLM's CPU build serves on this host, known before its engine takes a request.

vLLM 0.32's CPU kernels for quantized checkpoints depend on the dtype and on the CPU, and
where none fits, the engine starts and then dies at its first step (a worker would take a
job, die, and hand it on to die again):
- weight-only int4/int8 (compressed-tensors pack-quantized, GPTQ, AWQ) runs on its
  CPUWNA16 kernel, which has no fp32 path, and which its build for CPUs without AVX-512
  (`_C_AVX2`) lacks altogether (`no attribute 'cpu_gemm_wna16'` at the first step);
- w8a8 (compressed-tensors int-quantized, symmetric int8 activations) runs on oneDNN in fp32
  and bf16, except on a CPU with AMX tiles, where vLLM takes another int8 kernel that
  takes bf16 or fp16 activations only; on a CPU without AVX-512 its logits are several
  nats off the checkpoint's model in fp32 and bf16 (tests/vllm/test_quantized.py).
So on a CPU without AVX-512 the backend refuses every such checkpoint (the native backend
serves them).
So the backend picks bf16 where the user gave no dtype and the resolved one cannot run,
and refuses at start, with one line saying what to change, where the user asked for it.

And on a CPU with AMX, Linux gives a process the AMX tile state only once it asks for it
(arch_prctl ARCH_REQ_XCOMP_PERM): torch asks when its own oneDNN kernels first use AMX;
vLLM's bf16 attention kernel does not, so an engine whose first AMX instruction is that
kernel's (bf16 without torch.compile: `enforce_eager`) dies of SIGILL at its first step.
`allow_amx`, a vLLM general plugin (pyproject.toml), asks in each of vLLM's processes.
"""

from __future__ import annotations

from typing import Any

import torch


class Unsupported(ValueError):
    """A checkpoint this vLLM build cannot run here in the asked dtype (the worker exits
    with the code of an unsupported model)."""


def amx() -> bool:
    """Whether this CPU has AMX tiles, as vLLM decides its int8 kernel."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def isa() -> str:
    """Which of vLLM's CPU builds runs here, as it decides: "amx", "avx512" or "avx2"."""
    if amx():
        return "amx"
    probe = getattr(torch.cpu, "_is_avx512_supported", None)
    return "avx512" if probe and probe() else "avx2"


def allow_amx() -> None:
    """Ask for the AMX tile state where the CPU has AMX (vLLM runs this in each of its
    processes, as the general plugin `plurai_amx`)."""
    if amx():
        torch.cpu._init_amx()


def quantization(hf_config: Any) -> dict[str, Any]:
    quant = getattr(hf_config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else {}
    return quant


def refusal(quant: dict[str, Any], dtype: torch.dtype, isa: str) -> str:
    """Why vLLM's CPU build cannot run a checkpoint of this quantization config in `dtype`
    on a CPU of this `isa` (see isa()); '' when nothing is known wrong."""
    method = str(quant.get("quant_method", "")).lower()
    groups = [g for g in (quant.get("config_groups") or {}).values() if isinstance(g, dict)]
    acts = [g.get("input_activations") for g in groups]
    weight_only = method in ("gptq", "awq") or (
        method == "compressed-tensors" and bool(groups) and not any(acts)
    )
    int8_symmetric = [
        a
        for a in acts
        if isinstance(a, dict) and a.get("num_bits") == 8 and a.get("symmetric", True)
    ]
    w8a8 = method == "compressed-tensors" and bool(int8_symmetric)
    if isa == "avx2" and (weight_only or w8a8):
        what = "weight-only quantized" if weight_only else "w8a8"
        return (
            f"vLLM's CPU build has no correct kernel for {what} checkpoints ({method}) on a "
            "CPU without AVX-512: serve it with the native backend (--backend native)"
        )
    if dtype != torch.float32:
        return ""
    if weight_only:
        return (
            f"vLLM's CPU build runs weight-only quantized checkpoints ({method}) in bf16 only: "
            "start the worker with --vllm dtype=bfloat16"
        )
    if isa == "amx" and w8a8:
        return (
            "vLLM's CPU build runs w8a8 checkpoints on a CPU with AMX in bf16 or fp16 only "
            "(its AMX int8 kernel takes no fp32 activations): start the worker with "
            "--vllm dtype=bfloat16"
        )
    return ""


def config_refusal(config: Any, on_isa: str | None = None) -> str:
    """refusal() for a vLLM engine config, on this CPU or one of `on_isa`: '' off the CPU."""
    if config.device_config.device_type != "cpu":
        return ""
    model = config.model_config
    return refusal(quantization(model.hf_config), model.dtype, on_isa or isa())
