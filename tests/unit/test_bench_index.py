"""`python -m bench`: every bench script is in the index, and the index says true things
of each (it exists, its figures' page names it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from bench.__main__ import INDEX, PARTS

ROOT = Path(__file__).resolve().parents[2]


def files() -> set[str]:
    """Every file under bench/, as the index names them (its path there, without .py)."""
    return {
        str(p.relative_to(ROOT / "bench").with_suffix("")) for p in (ROOT / "bench").rglob("*.py")
    }


def scripts() -> set[str]:
    """bench/**/*.py that run as scripts (an `if __name__ == "__main__"` at the top level)."""
    found = set()
    for path in (ROOT / "bench").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                found.add(str(path.relative_to(ROOT / "bench").with_suffix("")))
    return found - {"__main__"}


def test_every_bench_script_is_indexed_or_a_part() -> None:
    named = [b.file for b in INDEX] + PARTS
    assert len(named) == len(set(named)), "a bench is named twice"
    assert sorted(scripts() - set(named)) == [], "add it to bench/__main__.py's INDEX"
    assert sorted(set(named) - files()) == []


def test_each_benchs_page_names_it_and_it_takes_smoke() -> None:
    for b in INDEX:
        source = (ROOT / "bench" / f"{b.file}.py").read_text()
        assert "--smoke" in source, f"bench/{b.file}.py has no --smoke"
        assert b.command.removeprefix("-m ") in (ROOT / b.docs).read_text(), (b.name, b.docs)


def test_the_index_prints_every_bench() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    for b in INDEX:
        assert b.command in out
        assert f"default run: {b.runtime}" in out and b.runtime[0] in "~0123456789", b.name
    assert ".venv-vllm/bin/python bench/router_latency.py" in out
