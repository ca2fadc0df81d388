"""`python -m plurai.gpu_workers.kernels [--with-avx2]`: builds the CPU kernels now (as `make
install` and the Dockerfile do), into this installation's folder, so that no engine start
waits for the compiler. Exits 0 either way: without a compiler the engine runs the
pure-torch path.

`--with-avx2`: on a CPU wider than AVX2, also build the AVX2 variant (what an AVX2-only
machine compiles), in parallel, so that its test finds it ready.

`--compile ISA PATH PARENT_PID` is the child a build runs (kernels._build), not for people."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from plurai.gpu_workers.kernels import build, build_isa, compile_into, cpu_isa, module_path

if sys.argv[1:2] == ["--compile"]:
    compile_into(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
    raise SystemExit(0)

logging.basicConfig(level=logging.INFO, format="%(message)s")
start = time.perf_counter()
side = None
if "--with-avx2" in sys.argv[1:] and cpu_isa() in ("avx512", "avx512_bf16", "amx"):
    side = subprocess.Popen(
        [sys.executable, "-m", "plurai.gpu_workers.kernels"],
        env={**os.environ, "PLURAI_KERNEL_ISA": "avx2"},
    )
try:
    build()
except RuntimeError as e:
    print(f"{e}; the engine will use the pure-torch path", file=sys.stderr)
else:
    took = time.perf_counter() - start
    print(f"native CPU kernels ready ({build_isa()}, {took:.0f} s): {module_path(build_isa())}")
if side is not None:
    side.wait()
