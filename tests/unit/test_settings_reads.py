"""Every setting goes through broker_config/settings.py: no other module of the product
reads a PLURAI_* variable from the environment itself (a value in the PLURAI_CONFIG file
or given to Settings(...) would never reach it). docs/settings.md, every setting's
reference, is checked in test_settings_doc.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("broker_config", "gpu_workers", "kv_store", "results", "producer", "gateway", "cli")
SETTINGS = Path("broker_config/settings.py")


def _plurai(node: ast.AST | None) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("PLURAI_")
    )


def constants(tree: ast.Module) -> set[str]:
    """The module-level names bound to a PLURAI_* string."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _plurai(node.value):
            found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and _plurai(node.value):
            if isinstance(node.target, ast.Name):
                found.add(node.target.id)
    return found


def _is_environ(node: ast.AST) -> bool:
    """os.environ, or environ imported from os."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _is_getenv(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr == "getenv" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "getenv"


def reads(source: str, elsewhere: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, code) of each read of a PLURAI_* variable from the environment in `source`:
    os.environ[key], os.environ.get(key), os.getenv(key), key in os.environ, with `key` a
    PLURAI_ string (an f-string starting with one too), a module-level constant bound to
    one, or `module.NAME` where NAME is such a constant of any product module
    (`elsewhere`). Writes (os.environ[key] = ..., for a child process) are not reads."""
    tree = ast.parse(source)
    mine = constants(tree)

    def key(node: ast.AST | None) -> bool:
        if _plurai(node):
            return True
        if isinstance(node, ast.JoinedStr) and node.values:
            return _plurai(node.values[0])
        if isinstance(node, ast.Name):
            return node.id in mine
        return isinstance(node, ast.Attribute) and node.attr in mine | elsewhere

    found = []
    for node in ast.walk(tree):
        hit = False
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            hit = _is_environ(node.value) and key(node.slice)
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            getter = isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value)
            hit = (getter or _is_getenv(f)) and key(node.args[0])
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for op, (a, b) in zip(node.ops, zip(sides, sides[1:], strict=False), strict=True):
                if isinstance(op, ast.In | ast.NotIn) and _is_environ(b) and key(a):
                    hit = True
        if hit:
            found.append((node.lineno, ast.get_source_segment(source, node) or ""))
    return sorted(found)


def product_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_module_but_settings_reads_a_plurai_variable() -> None:
    files = {p: p.read_text() for p in product_files()}
    elsewhere = frozenset(n for src in files.values() for n in constants(ast.parse(src)))
    bad = [
        f"{p.relative_to(ROOT)}:{line}: {code}"
        for p, src in files.items()
        if p.relative_to(ROOT) != SETTINGS
        for line, code in reads(src, elsewhere)
    ]
    assert not bad, "read PLURAI_* through broker_config.settings.Settings:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source",
    [
        'import os\nx = os.environ["PLURAI_A"]',
        'import os\nx = os.environ.get("PLURAI_A", "")',
        'import os\nx = os.getenv("PLURAI_A")',
        'import os\nx = "PLURAI_A" in os.environ',
        'import os\nx = "PLURAI_A" not in os.environ',
        'import os\nA = "PLURAI_A"\n\ndef f():\n    return os.environ.get(A)',
        'import os\nA: str = "PLURAI_A"\nx = os.environ[A]',
        "import os\nx = os.environ.get(connector.URL_ENV)",
        'import os\nx = os.environ.get(f"PLURAI_{name}")',
        'from os import environ, getenv\nx = environ.get("PLURAI_A") or getenv("PLURAI_B")',
    ],
)
def test_the_check_finds_each_kind_of_read(source: str) -> None:
    assert reads(source, frozenset({"URL_ENV"}))


@pytest.mark.parametrize(
    "source",
    [
        'import os\nos.environ["PLURAI_A"] = "1"',  # a write, for a child process
        'import os\nenv = {**os.environ, "PLURAI_A": "1"}',
        'import os\nx = os.environ.get("CXX")',
        'import os\nB = "OTHER"\nx = os.environ.get(B)',
    ],
)
def test_the_check_passes_writes_and_other_variables(source: str) -> None:
    assert not reads(source)
