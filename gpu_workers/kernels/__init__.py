"""Fused CPU kernels: a small C++ extension (cpu.cpp) built with torch's cpp_extension.

It is built at install (`python -m plurai.gpu_workers.kernels`, which `make install` and the
Dockerfile run) with the vector flags of the CPU's widest ISA (AVX2, AVX-512, AVX-512 with
bf16) into a folder of this installation (kernels_dir()), under a name that carries the ISA
and a digest of the source, flags, torch and Python, and loaded at start as a plain
extension module: no lock, nothing to wait for. A start that finds no build for its CPU (a
new ISA, a changed source) builds one, under a lock that dies with its holder and with a
time limit. Where it cannot be built (no compiler), the engine keeps the pure-torch path.

The choice (EngineConfig.kernels, default Settings.kernels, PLURAI_KERNELS):
    auto    the kernels when they build and load, else torch (said once in the log)
    native  the kernels, or an error saying why not
    torch   the pure-torch path
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from plurai.broker_config import locks
from plurai.broker_config.settings import Settings

log = logging.getLogger(__name__)

MODES = ("auto", "native", "torch")
SOURCE = Path(__file__).with_name("cpu.cpp")

# compiler flags per ISA: the loops in cpu.cpp are vectorized at this width by g++
# (every AVX-512 CPU also has FMA and F16C, which -mavx512f does not switch on in g++)
FLAGS = {
    # (every CPU with AVX512-BF16 has AVX512-VNNI too: Cooper Lake, Sapphire Rapids, Zen 4)
    "avx512_bf16": [
        *("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni"),
        *("-mfma", "-mf16c"),
    ],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "baseline": [],
}

LDFLAGS = ["-fopenmp"]

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
    (Settings.kernel_isa, read now: `--with-avx2` sets it for a child) asks for a narrower
    one (an AVX2 build can be tested on an AVX-512 machine)."""
    isa = cpu_isa()
    if isa == "amx":  # AMX tiles are oneDNN's (the matmuls); these kernels use AVX-512
        isa = "avx512_bf16"
    isa = isa if isa in FLAGS else "baseline"
    want = Settings().kernel_isa
    if want:
        if want not in FLAGS:
            raise ValueError(f"PLURAI_KERNEL_ISA={want!r}: expected one of {sorted(FLAGS)}")
        if WIDTH.index(want) > WIDTH.index(isa):  # its instructions would kill the process
            raise ValueError(f"PLURAI_KERNEL_ISA={want!r}: this CPU offers only {isa!r}")
        return want
    return isa


def kernels_dir() -> Path:
    """Where this installation keeps its builds: PLURAI_KERNELS_DIR, else a folder of the
    Python environment it is installed in (each venv, image or checkout its own)."""
    return Path(Settings().kernels_dir or Path(sys.prefix) / "lib" / "plurai-kernels")


def cflags(isa: str) -> list[str]:
    return ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", *FLAGS[isa]]


def module_path(isa: str) -> Path:
    """The build of this source, with these flags, for this torch and Python: a new version
    of any of them is a new file, so a build is never loaded where it does not belong."""
    import torch

    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(
        json.dumps(
            [cflags(isa), LDFLAGS, torch.__version__, sys.implementation.cache_tag, _cxx()]
        ).encode()
    )
    return kernels_dir() / f"plurai_cpu_{isa}-{digest.hexdigest()[:16]}.so"


def _cxx() -> str:
    return os.environ.get("CXX", "c++")


def build() -> ModuleType:
    """Imports the extension built for this CPU, building it first where this installation
    has none; raises with the reason."""
    isa = build_isa()
    if isa in _loaded:
        got = _loaded[isa]
        if isinstance(got, BaseException):
            raise RuntimeError(f"native kernels unavailable: {got}") from got
        return got
    try:
        path = module_path(isa)
        if not path.exists():
            _build(isa, path)
        module = _import(isa, path)
    except Exception as e:  # compiler, lock or loader failure: the message is the reason
        _loaded[isa] = e
        raise RuntimeError(f"native kernels unavailable: {e}") from e
    log.info("native CPU kernels (%s) loaded from %s", isa, path)
    _loaded[isa] = module
    return module


def _build(isa: str, path: Path) -> None:
    """Compiles into `path`, one process at a time per build (a lock that dies with its
    holder), in a child process with a time limit; the file appears whole or not at all."""
    if shutil.which(_cxx()) is None:
        raise RuntimeError("no C++ compiler on PATH (install g++)")
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError("not writable")
    except OSError as e:
        raise RuntimeError(
            f"no build for this CPU ({isa}) in {folder}, and it cannot be written ({e}); "
            "run `python -m plurai.gpu_workers.kernels` as the installing user, or set "
            "PLURAI_KERNELS_DIR to a writable folder"
        ) from e
    timeout = Settings().kernels_build_timeout_s
    with locks.held(path.with_suffix(".lock"), timeout, f"the {isa} kernel build"):
        if path.exists():  # built by the process that held the lock before
            return
        for left in folder.glob(f".build-{isa}-*"):  # by a build that was killed
            shutil.rmtree(left, ignore_errors=True)
        log.info("building the native CPU kernels (%s) into %s (once per install)", isa, folder)
        pid = str(os.getpid())
        child = subprocess.Popen(
            [sys.executable, "-m", "plurai.gpu_workers.kernels", "--compile", isa, str(path), pid],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its compilers are stopped with it on a time-out
        )
        try:
            out, _ = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise RuntimeError(
                f"the {isa} kernel build took over {timeout:.0f} s and was stopped "
                "(PLURAI_KERNELS_BUILD_TIMEOUT_S)"
            ) from None
        if child.returncode != 0 or not path.exists():
            tail = out.decode(errors="replace").strip()[-2000:]
            raise RuntimeError(f"the {isa} kernel build failed: {tail}")


def compile_into(isa: str, path: Path, parent: int) -> None:
    """The child's side of _build: torch's cpp_extension in a fresh folder of its own (its
    lock file there can never be left by another process), then the module moved into
    place in one rename. It dies with the process that asked for it."""
    _die_with(parent)
    from torch.utils import cpp_extension

    work = Path(tempfile.mkdtemp(prefix=f".build-{isa}-", dir=path.parent))
    try:
        name = f"plurai_cpu_{isa}"
        cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=cflags(isa),
            extra_ldflags=LDFLAGS,
            build_directory=str(work),
            verbose=False,
        )
        os.replace(work / f"{name}.so", path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _die_with(parent: int) -> None:
    """SIGTERM when `parent` dies (Linux's parent-death signal), and on SIGTERM this
    process and every process under it (ninja, the compilers) are killed."""
    signal.signal(signal.SIGTERM, lambda *_: _kill_tree())
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: a killed worker's build runs to its end
        return
    if os.getppid() != parent:  # it died before the line above
        _kill_tree()


def _kill_tree() -> None:
    """SIGKILL to this process's descendants, then itself. ninja starts each compiler in a
    process group of its own, so killing this group would leave them running."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    tree, grew = {os.getpid()}, True
    while grew:
        found = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= found
        grew = bool(found)
    for pid in tree - {os.getpid()}:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def _import(isa: str, path: Path) -> ModuleType:
    import torch  # noqa: F401  (the extension links against torch's libraries)

    name = f"plurai_cpu_{isa}"
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError as e:
        raise RuntimeError(f"{path} does not load ({e}); remove it to rebuild") from e
    return module


def load(mode: str | None = None) -> ModuleType | None:
    """The kernels module for `mode` (None: PLURAI_KERNELS, else auto); None means the
    torch path."""
    mode = mode or Settings().kernels
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
