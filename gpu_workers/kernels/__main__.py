"""`python -m gpu_workers.kernels`: builds the CPU kernels now (as `make install` does),
so the first engine start does not wait for the compiler. Exits 0 either way: without
a compiler the engine runs the pure-torch path."""

from __future__ import annotations

import sys
import time

from gpu_workers.kernels import build, build_isa

start = time.perf_counter()
try:
    build()
except RuntimeError as e:
    print(f"{e}; the engine will use the pure-torch path", file=sys.stderr)
else:
    print(f"native CPU kernels ready ({build_isa()}, {time.perf_counter() - start:.0f} s)")
