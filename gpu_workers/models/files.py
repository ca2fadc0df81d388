"""The files of a model folder, read without torch: which safetensors files hold its
weights, and whether each is whole (what a worker checks before it loads anything)."""

from __future__ import annotations

import json
import struct
from pathlib import Path, PurePosixPath

INDEX = "model.safetensors.index.json"
SAFETENSORS_HEADER_MAX = 100 * 1024 * 1024  # the format's own limit
# the architectures the native engine runs (models/llama.py maps each to its class)
NATIVE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of the model: those its index names, else model.safetensors.
    Every file the index names must lie inside the model folder (no absolute path, no
    `..`, no symlink leading out): anything else raises ValueError."""
    path = Path(model_dir)
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e!r})") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: weight_map must be an object")
        files = {_inside(path, index, n) for n in weight_map.values()}
        return sorted(files)
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no safetensors weights in {path} (model.safetensors or its index)")


def _inside(root: Path, index: Path, name: object) -> Path:
    def refuse(why: str) -> ValueError:
        return ValueError(f"{index}: weight_map names {name!r}, {why}; refusing to load it")

    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        raise refuse("which is not a plain file name")
    if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
        raise refuse("a path outside the model folder")
    f = root / name
    if not f.resolve().is_relative_to(root.resolve()):
        raise refuse("a link that leads outside the model folder")
    return f


def safetensors_problem(f: Path) -> str:
    """Why a safetensors file cannot be whole ('' if it can): its header must parse and its
    tensors' data must end where the file does (a cut download ends early)."""
    try:
        size = f.stat().st_size
        with f.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{size} bytes, too short for a safetensors file"
            (n,) = struct.unpack("<Q", head)
            if n > SAFETENSORS_HEADER_MAX or 8 + n > size:
                return f"its header claims {n} bytes, the file holds {size}: truncated"
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as e:
        return f"its header does not parse ({e})"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and isinstance(offsets[1], int)):
            return f"tensor {name!r} has no data offsets"
        end = max(end, offsets[1])
    if 8 + n + end > size:
        return f"its tensors need {8 + n + end} bytes, the file holds {size}: truncated"
    return ""
