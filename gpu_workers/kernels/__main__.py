"""`python -m gpu_workers.kernels [--with-avx2]`: builds the CPU kernels now (as `make
install` does), so the first engine start does not wait for the compiler. Exits 0 either
way: without a compiler the engine runs the pure-torch path.

`--with-avx2`: on a CPU wider than AVX2, also build the AVX2 variant (what an AVX2-only
machine compiles), in parallel, so that its test finds it ready."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from gpu_workers.kernels import build, build_isa, cpu_isa

start = time.perf_counter()
side = None
if "--with-avx2" in sys.argv[1:] and cpu_isa() in ("avx512", "avx512_bf16", "amx"):
    side = subprocess.Popen(
        [sys.executable, "-m", "gpu_workers.kernels"],
        env={**os.environ, "PLURAI_KERNEL_ISA": "avx2"},
    )
try:
    build()
except RuntimeError as e:
    print(f"{e}; the engine will use the pure-torch path", file=sys.stderr)
else:
    print(f"native CPU kernels ready ({build_isa()}, {time.perf_counter() - start:.0f} s)")
if side is not None:
    side.wait()
