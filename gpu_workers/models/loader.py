"""Build a model from a local Hugging Face model directory (config + safetensors)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig

from gpu_workers.layers.linear import can_pack, pack_linears
from gpu_workers.models.llama import ARCHITECTURES

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def load_config(model_dir: str | Path) -> Any:
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory: config.json is missing")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def weight_files(model_dir: str | Path) -> list[Path]:
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no safetensors weights in {path} (model.safetensors or its index)")


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, st.get_tensor(name)


def fingerprint(model_dir: str | Path) -> str:
    """A content fingerprint of the model: config plus the head and tail bytes of every
    weight file (cheap for big checkpoints, distinct for different weights)."""
    path = Path(model_dir)
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in weight_files(path):
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.hexdigest()[:32]


def cpu_has_bf16() -> bool:
    """Native bf16 dot products (AVX512-BF16 or AMX): bf16 is then ~2x faster than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, cfg: Any, device: torch.device) -> torch.dtype:
    if name == "auto":
        # on CPUs without native bf16, bf16 matmuls are emulated and slower than fp32
        if device.type == "cpu":
            return torch.bfloat16 if cpu_has_bf16() else torch.float32
        d = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.float16
        return DTYPES[d] if isinstance(d, str) else d
    if name not in DTYPES:
        raise ValueError(
            f"dtype {name!r} is not supported; use one of auto, {', '.join(sorted(DTYPES))}"
        )
    return DTYPES[name]


def build_model(
    model_dir: str | Path,
    cfg: Any,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: Any = None,
    stage: Any = None,
) -> torch.nn.Module:
    arch = (getattr(cfg, "architectures", None) or ["?"])[0]
    cls = ARCHITECTURES.get(arch)
    if cls is None:
        raise ValueError(
            f"architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg, max_positions, tp, stage)
    finally:
        torch.set_default_dtype(default)
    model.load_weights(iter_tensors(weight_files(model_dir)))
    if can_pack(device, dtype):
        pack_linears(model)
    return model.eval()
