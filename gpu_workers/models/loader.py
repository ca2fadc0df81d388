"""Build a model from a local Hugging Face model directory (config + safetensors)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig

from plurai.broker_config.settings import Settings
from plurai.gpu_workers.layers.linear import can_pack, pack_linears
from plurai.gpu_workers.layers.quant_linear import finish_quantized, start_quantized
from plurai.gpu_workers.models.files import INDEX, weight_files
from plurai.gpu_workers.models.llama import ARCHITECTURES
from plurai.gpu_workers.models.quant_formats import decode, scheme

log = logging.getLogger(__name__)

# Besides the weights, the fingerprint covers these files of the model folder if present.
FINGERPRINTED = (
    "config.json",
    INDEX,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
CACHE_NAME = ".plurai-fingerprint.json"
CACHE_VERSION = 1

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


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, st.get_tensor(name)


def fingerprint(model_dir: str | Path) -> str:
    """A content fingerprint of the model: the SHA-256 of every weight file, whole, and of
    its config, index and tokenizer files. The digests are cached (fingerprint_cache) and
    reused while each file keeps its size and mtime_ns, so a restart does not reread the
    weights."""
    path = Path(model_dir)
    files = sorted({*fingerprinted_files(path), *weight_files(path)})
    caches = _read_caches(path)
    entries: dict[str, dict[str, Any]] = {}
    hashed = False
    for f in files:
        name = f.relative_to(path).as_posix()
        st = f.stat()
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        entry = next((c[name] for c in caches if _stamp(c.get(name)) == stamp), None)
        if entry is None:
            hashed = True
            entry = {**stamp, "sha256": _file_digest(f)}
        entries[name] = entry
    if hashed:
        # a file that changed while it was hashed is left out, to be hashed again next time
        _write_cache(path, {n: e for n, e in entries.items() if _stamp(e) == _now(path / n)})
    h = hashlib.sha256()
    for name, entry in entries.items():
        h.update(f"{name}\0{entry['size']}\0{entry['sha256']}\n".encode())
    return h.hexdigest()[:32]


def _stamp(entry: dict[str, Any] | None) -> dict[str, int] | None:
    return None if entry is None else {"size": entry["size"], "mtime_ns": entry["mtime_ns"]}


def _now(f: Path) -> dict[str, int] | None:
    try:
        st = f.stat()
    except OSError:
        return None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def fingerprinted_files(model_dir: Path) -> list[Path]:
    """The files besides the weights that the fingerprint covers: config.json, and the
    index, generation config and tokenizer files that exist."""
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a model directory: config.json is missing")
    return [model_dir / n for n in FINGERPRINTED if (model_dir / n).is_file()]


def _file_digest(f: Path) -> str:
    with f.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def fingerprint_cache(model_dir: Path) -> list[Path]:
    """Where the digests are cached, in order of preference: beside the model, else (a
    read-only model folder) under Settings.data_dir (PLURAI_DATA_DIR), named after the
    folder's path."""
    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:32]
    data = Path(Settings().data_dir)
    return [model_dir / CACHE_NAME, data / "fingerprints" / f"{key}.json"]


def _read_caches(model_dir: Path) -> list[dict[str, dict[str, Any]]]:
    """The digests of every readable, well-formed cache (a bad one is ignored)."""
    found = []
    for where in fingerprint_cache(model_dir):
        try:
            doc = json.loads(where.read_text())
        except (OSError, ValueError):
            continue
        if (
            isinstance(doc, dict)
            and doc.get("version") == CACHE_VERSION
            and isinstance(doc.get("files"), dict)
            and all(_good_entry(n, e) for n, e in doc["files"].items())
        ):
            found.append(doc["files"])
    return found


def _good_entry(name: object, e: object) -> bool:
    return (
        isinstance(name, str)
        and isinstance(e, dict)
        and set(e) == {"size", "mtime_ns", "sha256"}
        and all(type(e[k]) is int and e[k] >= 0 for k in ("size", "mtime_ns"))
        and isinstance(e["sha256"], str)
        and re.fullmatch(r"[0-9a-f]{64}", e["sha256"]) is not None
    )


def _write_cache(model_dir: Path, files: dict[str, dict[str, Any]]) -> None:
    """Write the cache atomically (a temporary file renamed over it) where it can be."""
    doc = {"version": CACHE_VERSION, "model_dir": str(model_dir.resolve()), "files": files}
    text = json.dumps(doc, indent=1)
    for where in fingerprint_cache(model_dir):
        tmp = None
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                "w", dir=where.parent, prefix=where.name, suffix=".tmp", delete=False
            ) as out:
                tmp = Path(out.name)
                out.write(text)
            os.replace(tmp, where)
            return
        except OSError as e:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            log.debug("cannot cache the model fingerprint in %s (%s)", where, e)


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
    ops: Any = None,
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
            model = cls(cfg, max_positions, tp, stage, ops)
    finally:
        torch.set_default_dtype(default)
    tensors = iter_tensors(weight_files(model_dir))
    quant = scheme(cfg)
    start_quantized(model, dtype, device)
    model.load_weights(decode(tensors, quant) if quant else tensors)
    finish_quantized(model, dtype, device)
    if can_pack(device, dtype):
        pack_linears(model)
    return model.eval()
