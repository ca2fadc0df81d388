"""Quantized checkpoints written by hand for the loader's tests, in the published layouts
of GPTQ, AWQ and compressed-tensors, from a float factory model: round to nearest, with
act-order and zero points where asked. Each writer also returns a float checkpoint of the
dequantized weights: what the quantized one must compute."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from plurai.gpu_workers.models.quant_formats import AWQ_ORDER
from plurai.gpu_workers.models.quantize import LINEAR


def rtn(
    w: torch.Tensor, bits: int, group: int | None, sym: bool, g_idx: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unsigned codes [n, k], scales [n, groups], unsigned zero points [n, groups]."""
    n, k = w.shape
    g = g_idx if g_idx is not None else torch.arange(k) // (group or k)
    groups = int(g.max()) + 1
    qmax = (1 << bits) - 1
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups, dtype=torch.int64)
    for j in range(groups):
        cols = w[:, g == j].float()
        if sym:
            s = cols.abs().amax(1) / (qmax / 2)
            z = torch.full((n,), 1 << (bits - 1))
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / qmax
            z = (-lo / s.clamp(min=1e-8)).round().clamp(0, qmax).long()
        scales[:, j] = s.clamp(min=1e-8)
        zeros[:, j] = z
    codes = (w.float() / scales[:, g]).round().long() + zeros[:, g]
    return codes.clamp(0, qmax), scales, zeros


def dequant(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g: torch.Tensor):
    return (codes - zeros[:, g]).float() * scales[:, g]


def pack(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes packed along the last dimension into int32s, lowest bits first."""
    per = 32 // bits
    u = u.long().view(*u.shape[:-1], -1, per)
    shifts = torch.arange(per) * bits
    packed = (u << shifts).sum(-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def _write(src: Path, dst: Path, tensors: dict, quant: dict | None) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json") and f.is_file():
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    if quant:
        cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))


def write(
    src: Path,
    dst: Path,
    method: str,
    bits: int = 4,
    group: int | None = 32,
    sym: bool = True,
    act_order: bool = False,
    seed: int = 0,
) -> Path:
    """A quantized copy of src in dst; returns the float copy of its dequantized weights."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    orders: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not LINEAR.match(name):
            out[name] = ref[name] = w
            continue
        prefix = name.removesuffix(".weight")
        n, k = w.shape
        g_idx = None
        if act_order:  # groups of the columns in a shuffled order, as GPTQ's desc_act makes
            # it: the same for the linears that read the same input (q, k, v; gate, up)
            same = re.sub(r"\.(q|k|v)_proj\.", ".qkv.", re.sub(r"\.(gate|up)_proj\.", ".gu.", name))
            if same not in orders:
                orders[same] = torch.randperm(k, generator=gen)
            g_idx = torch.empty(k, dtype=torch.long)
            g_idx[orders[same]] = torch.arange(k) // group
        codes, scales, zeros = rtn(w, bits, group, sym, g_idx)
        g = g_idx if g_idx is not None else torch.arange(k) // (group or k)
        # GPTQ and AWQ keep fp16 scales, compressed-tensors the model's dtype
        scales = scales.to(w.dtype if method == "compressed-tensors" else torch.float16)
        ref[name] = dequant(codes, scales.float(), zeros, g).to(w.dtype)
        if method == "compressed-tensors":
            out[f"{prefix}.weight_packed"] = pack(codes, bits)
            out[f"{prefix}.weight_scale"] = scales
            out[f"{prefix}.weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
            if not sym:  # packed along the output dimension
                out[f"{prefix}.weight_zero_point"] = pack(zeros.t(), bits).t()
            if g_idx is not None:
                out[f"{prefix}.weight_g_idx"] = g_idx.to(torch.int32)
        elif method == "gptq":  # v1: packed along the input dimension, zero points less one
            out[f"{prefix}.qweight"] = pack(codes, bits).t()
            out[f"{prefix}.qzeros"] = pack((zeros - 1).t() & ((1 << bits) - 1), bits)
            out[f"{prefix}.scales"] = scales.t()
            out[f"{prefix}.g_idx"] = g.to(torch.int32)
        elif method == "awq":  # packed along the output dimension, in AWQ's order
            idx = torch.tensor([c * 8 + AWQ_ORDER[i] for c in range(n // 8) for i in range(8)])
            out[f"{prefix}.qweight"] = pack(codes.t()[:, idx], 4)
            out[f"{prefix}.qzeros"] = pack(zeros.t()[:, idx], 4)
            out[f"{prefix}.scales"] = scales.t()
        else:
            raise ValueError(method)
    quant = {
        "compressed-tensors": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": bits,
                        "type": "int",
                        "symmetric": sym,
                        "strategy": "group" if group else "channel",
                        "group_size": group,
                        "actorder": "group" if act_order else None,
                    },
                    "input_activations": None,
                    "output_activations": None,
                }
            },
        },
        "gptq": {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group or -1,
            "desc_act": act_order,
            "sym": sym,
        },
        "awq": {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
        },
    }[method]
    _write(src, dst, out, quant)
    reference = dst.with_name(dst.name + "-dequantized")
    _write(src, reference, ref, None)
    return reference
