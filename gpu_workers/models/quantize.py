"""Round-to-nearest quantization of a float Llama-family checkpoint into the
compressed-tensors format, without calibration data: what tests, the demo and the benches
use to make their own quantized models (`plurai quantize SRC DST --scheme ...`).

Every Linear inside the decoder layers (q/k/v/o_proj, gate/up/down_proj) is quantized,
symmetric, with scale = absmax / ((qmax - qmin) / 2) per output channel or per group of
input columns, as compressed-tensors' own `calculate_qparams` computes it (a zero scale
becomes the dtype's eps), and codes = round(clamp(w / scale, qmin, qmax)). Embeddings,
norms, biases and lm_head stay as they are (`"ignore": ["lm_head"]`; tied embeddings stay
tied). What DST gets:

- config.json with a `quantization_config` (quant_method "compressed-tensors", status
  "compressed", one config group targeting "Linear");
- w4a16: format "pack-quantized", 4-bit weights per group of `group_size` input columns
  (default 128): `<linear>.weight_packed` int32 [out, in/8] (eight codes a word, each stored
  plus 8, the first in the lowest bits), `.weight_scale` [out, in/group_size] and
  `.weight_shape` int64 [2];
- w8a16: the same with 8-bit codes per output channel: four a word, each plus 128,
  `.weight_scale` [out, 1];
- w8a8: format "int-quantized", 8-bit weights per output channel, activations quantized per
  token at run time: `<linear>.weight` int8 [out, in] and `.weight_scale` [out, 1];
- every other file a loader reads (tokenizer, generation config, chat template) copied.

Scales and unquantized tensors keep the checkpoint's float dtype. Tensors are read one at a
time and written one output file per input file (with the index when the source has one),
so memory holds one shard, never the model. DST is written beside itself and renamed into
place when whole.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from plurai.gpu_workers.models import quant_formats
from plurai.gpu_workers.models.files import INDEX, NATIVE, safetensors_problem, weight_files

SCHEMES = ("w8a16", "w8a8", "w4a16")
DEFAULT_GROUP_SIZE = 128
# the Linears that are quantized: every projection inside a decoder layer
LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")
# tensors only a quantized checkpoint holds (compressed-tensors', GPTQ's, AWQ's)
QUANTIZED = (
    ".weight_packed",
    ".weight_scale",
    ".weight_zero_point",
    ".qweight",
    ".qzeros",
    ".scales",
)
# files of a model folder that are not copied: weights (written anew, or another format of
# the float ones) and what describes the float model only
SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".lock")
SKIP_NAMES = ("config.json", INDEX, "plurai_factory.json")


@dataclass(frozen=True)
class Scheme:
    bits: int
    group_size: int | None  # None: one scale per output channel
    act_quant: bool  # int8 activations, per token, at run time

    @property
    def fmt(self) -> str:
        return "int-quantized" if self.act_quant else "pack-quantized"


def scheme_of(name: str, group_size: int | None = None) -> Scheme:
    """The scheme a name means; ValueError for an unknown one or a group size it does not
    take."""
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; choose from {', '.join(SCHEMES)}")
    if name != "w4a16":
        if group_size is not None:
            raise ValueError(f"{name} quantizes per output channel: it takes no group size")
        return Scheme(8, None, act_quant=name == "w8a8")
    size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"group size must be a positive integer, got {group_size!r}")
    return Scheme(4, size, act_quant=False)


def quantization_config(s: Scheme) -> dict[str, Any]:
    """config.json's `quantization_config` for a scheme."""
    weights = {
        "num_bits": s.bits,
        "type": "int",
        "symmetric": True,
        "group_size": s.group_size,
        "strategy": "channel" if s.group_size is None else "group",
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    activations = None
    if s.act_quant:
        activations = {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "group_size": None,
            "strategy": "token",
            "dynamic": True,
            "actorder": None,
            "block_structure": None,
            "observer": None,
            "observer_kwargs": {},
        }
    return {
        "quant_method": "compressed-tensors",
        "format": s.fmt,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quantization_status": "compressed",
    }


def quantize_weight(
    w: torch.Tensor, bits: int, group_size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest: (int8 codes [out, in], scales [out, groups] in w's dtype),
    computed in w's dtype as compressed-tensors computes them. A group of zeros gets the
    dtype's eps as its scale (and zero codes), never 0."""
    rows, cols = w.shape
    size = group_size or cols
    if cols % size:
        raise ValueError(f"group size {size} does not divide {cols} input columns")
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    x = w.reshape(rows, cols // size, size)
    absmax = x.abs().amax(dim=-1, keepdim=True)
    scale = absmax / (torch.tensor(float(qmax - qmin), dtype=w.dtype) / 2)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype), scale)
    codes = torch.clamp(x / scale, qmin, qmax).round().to(torch.int8)
    return codes.reshape(rows, cols), scale.squeeze(-1)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 codes [rows, cols] -> int32 [rows, ceil(cols * bits / 32)]: 32/bits codes a word,
    each stored unsigned (plus 2**(bits-1)), the first in the lowest bits (compressed-tensors'
    pack_to_int32 for 4 and 8 bits)."""
    per = 32 // bits
    rows, cols = codes.shape
    u = codes.to(torch.int64) + (1 << (bits - 1))
    u = torch.nn.functional.pad(u, (0, -cols % per)).reshape(rows, -1, per)
    words = (u << (torch.arange(per, dtype=torch.int64) * bits)).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """pack's inverse: int8 codes [rows, cols] (the loader's unpacking, shifted back)."""
    return (quant_formats.unpack(packed, bits, 1)[:, :cols] - (1 << (bits - 1))).to(torch.int8)


def quantize(src: str | Path, dst: str | Path, scheme: str, group_size: int | None = None) -> None:
    """Write SRC's model, its decoder Linears quantized by `scheme` (one of SCHEMES), to DST
    (a new or empty folder). ValueError (FileNotFoundError for a missing SRC or weights)
    names what is wrong before anything is written."""
    s = scheme_of(scheme, group_size)
    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} is not a model folder: no config.json")
    config = _config(src)
    files = weight_files(src)
    _check_tensors(files, s)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst} exists and is not an empty folder; refusing to write over it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    # beside DST, with the permissions the umask gives (mkdtemp's would be 0700)
    tmp = dst.parent / f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        weight_map: dict[str, str] = {}
        total = 0
        for f in files:
            tensors = _quantize_file(f, s)
            save_file(tensors, str(tmp / f.name), metadata={"format": "pt"})
            weight_map.update((name, f.name) for name in tensors)
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
        if (src / INDEX).is_file():
            index = {
                "metadata": {"total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        config["quantization_config"] = quantization_config(s)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for f in sorted(src.iterdir()):
            if f.is_file() and not _skipped(f.name):
                shutil.copyfile(f, tmp / f.name)
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _config(src: Path) -> dict[str, Any]:
    try:
        config = json.loads((src / "config.json").read_text())
    except ValueError as e:
        raise ValueError(f"{src / 'config.json'}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{src / 'config.json'}: not a JSON object")
    if config.get("quantization_config"):
        method = (config["quantization_config"] or {}).get("quant_method", "?")
        raise ValueError(f"{src} is already quantized ({method}); quantize a float checkpoint")
    archs = config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in NATIVE:
        raise ValueError(
            f"{src}: architecture {', '.join(map(str, archs)) or 'unknown'} is not supported; "
            f"supported: {', '.join(NATIVE)}"
        )
    return config


def _check_tensors(files: list[Path], s: Scheme) -> None:
    """Refuse, before writing, a checkpoint with no Linear to quantize, one already holding
    quantized tensors, Linear weights that are not float matrices, or a group size that does
    not divide every Linear's input columns."""
    inputs: dict[str, int] = {}
    for f in files:
        if problem := safetensors_problem(f):
            raise ValueError(f"{f}: {problem}")
        with safe_open(str(f), framework="pt") as st:
            names = list(st.keys())
            for name in names:
                if name.endswith(QUANTIZED):
                    raise ValueError(
                        f"{f}: {name} is already quantized; quantize a float checkpoint"
                    )
            for name in filter(LINEAR.match, names):
                sl = st.get_slice(name)
                shape, dtype = sl.get_shape(), sl.get_dtype()
                if len(shape) != 2 or dtype not in ("F32", "BF16", "F16"):
                    raise ValueError(f"{f}: {name} is {dtype} {shape}, want a float matrix")
                inputs[name] = shape[1]
    if not inputs:
        raise ValueError(f"{files[0].parent}: no decoder Linear weights found to quantize")
    size = s.group_size
    for name, k in inputs.items():
        if size and k % size:
            raise ValueError(
                f"group size {size} does not divide the {k} input columns of {name}: choose "
                f"a divisor of {math.gcd(*inputs.values())}, which every Linear's input size is "
                f"a multiple of"
            )


def _quantize_file(f: Path, s: Scheme) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(f), framework="pt") as st:
        for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
            t = st.get_tensor(name)
            if not LINEAR.match(name):
                out[name] = t
                continue
            if not torch.isfinite(t).all():
                raise ValueError(f"{f}: {name} holds a NaN or an infinity")
            prefix = name.removesuffix(".weight")
            codes, scale = quantize_weight(t, s.bits, s.group_size)
            out[f"{prefix}.weight_scale"] = scale.contiguous()
            if s.act_quant:
                out[f"{prefix}.weight"] = codes
            else:
                out[f"{prefix}.weight_packed"] = pack(codes, s.bits)
                out[f"{prefix}.weight_shape"] = torch.tensor(t.shape, dtype=torch.int64)
    return out


def _skipped(name: str) -> bool:
    return name.startswith(".") or name in SKIP_NAMES or name.endswith(SKIP_SUFFIXES)
