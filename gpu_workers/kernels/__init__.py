"""Fused CPU kernels: a small C++ extension (cpu.cpp) built with torch's cpp_extension.

It is compiled once per machine kind at first use (or by `python -m gpu_workers.kernels`,
which `make install` runs) with the vector flags of the CPU's widest ISA (AVX2, AVX-512,
AVX-512 with bf16), and cached under torch's extension folder (TORCH_EXTENSIONS_DIR)
under a name that carries the ISA, so machines that share a home folder never load a
build made for another CPU. Where it cannot be built (no compiler), the engine keeps the
pure-torch path.

The choice (EngineConfig.kernels, default from PLURAI_KERNELS):
    auto    the kernels when they build and load, else torch (said once in the log)
    native  the kernels, or an error saying why not
    torch   the pure-torch path
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

MODES = ("auto", "native", "torch")
SOURCE = Path(__file__).with_name("cpu.cpp")

# compiler flags per ISA: the loops in cpu.cpp are vectorized at this width by g++
# (every AVX-512 CPU also has FMA and F16C, which -mavx512f does not switch on in g++)
FLAGS = {
    "avx512_bf16": [
        *("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"),
        *("-mfma", "-mf16c"),
    ],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "baseline": [],
}

WIDTH = ["baseline", "avx2", "avx512", "avx512_bf16"]  # each runs where the next one does

_loaded: dict[str, ModuleType | BaseException] = {}


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def cpu_isa() -> str:
    """The widest vector ISA this CPU offers: amx, avx512_bf16, avx512, avx2, neon, or
    baseline."""
    flags = cpu_flags()
    for flag, name in (
        ("amx_tile", "amx"),
        ("avx512_bf16", "avx512_bf16"),
        ("avx512f", "avx512"),
        ("avx2", "avx2"),
        ("asimd", "neon"),
    ):
        if flag in flags:
            return name
    return "baseline"


def build_isa() -> str:
    """The flag set the kernels are built with here: the CPU's, unless PLURAI_KERNEL_ISA
    asks for a narrower one (an AVX2 build can be tested on an AVX-512 machine)."""
    isa = cpu_isa()
    if isa == "amx":  # AMX tiles are oneDNN's (the matmuls); these kernels use AVX-512
        isa = "avx512_bf16"
    isa = isa if isa in FLAGS else "baseline"
    want = os.environ.get("PLURAI_KERNEL_ISA")
    if want:
        if want not in FLAGS:
            raise ValueError(f"PLURAI_KERNEL_ISA={want!r}: expected one of {sorted(FLAGS)}")
        if WIDTH.index(want) > WIDTH.index(isa):  # its instructions would kill the process
            raise ValueError(f"PLURAI_KERNEL_ISA={want!r}: this CPU offers only {isa!r}")
        return want
    return isa


def build() -> ModuleType:
    """Compiles (or finds cached) and imports the extension; raises with the reason."""
    isa = build_isa()
    if isa in _loaded:
        got = _loaded[isa]
        if isinstance(got, BaseException):
            raise RuntimeError(f"native kernels unavailable: {got}") from got
        return got
    try:
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            raise RuntimeError("no C++ compiler on PATH (install g++)")
        from torch.utils import cpp_extension

        module = cpp_extension.load(
            name=f"plurai_cpu_{isa}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", *FLAGS[isa]],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # compiler or loader failure: the message is the reason
        _loaded[isa] = e
        raise RuntimeError(f"native kernels unavailable: {e}") from e
    _loaded[isa] = module
    return module


def load(mode: str | None = None) -> ModuleType | None:
    """The kernels module for `mode` (None: PLURAI_KERNELS, else auto); None means the
    torch path."""
    mode = mode or os.environ.get("PLURAI_KERNELS") or "auto"
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {MODES}, got {mode!r}")
    if mode == "torch":
        return None
    if mode == "native":
        return build()
    try:
        return build()
    except RuntimeError as e:
        if "logged" not in _loaded:
            _loaded["logged"] = e
            log.warning("%s; using the pure-torch path", e)
        return None
