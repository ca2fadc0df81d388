"""Import layering of the project's packages, read from the source with `ast` (every
`import` and `from ... import`, including those inside functions and `if` blocks):

- no import cycle between the project's modules;
- imports run one way, downward: broker_config at the bottom, then kv_store and results
  (side by side: neither imports the other), then gpu_workers, then producer, then
  gateway (the HTTP API, a client of the queue through producer), with cli/ (the `plurai`
  command, which also starts workers and gateways) on top. producer is the client SDK,
  what a client installs: it imports nothing of gpu_workers. ALLOWED spells it out: a
  package may import its own modules and those of the packages listed for it, nothing else.
  plurai/ (the installed top-level name) holds only the client's names, from producer.

A failure names each offending import as file:line.

And the size of files: one over LONG lines (a test file over LONG_TEST) says in its module
docstring why one concern needs more ("One file, though long: ..."), else it is split.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# package -> the other packages its modules may import
ALLOWED: dict[str, set[str]] = {
    "broker_config": set(),
    "kv_store": {"broker_config"},
    "results": {"broker_config"},
    "gpu_workers": {"broker_config", "kv_store", "results"},
    "producer": {"broker_config", "kv_store", "results"},  # never gpu_workers
    "gateway": {"broker_config", "results", "producer"},  # a client of the queue, as producer
    "cli": {"broker_config", "kv_store", "results", "gpu_workers", "producer", "gateway"},
    "plurai": {"producer"},  # `from plurai import Client`
}
LONG, LONG_TEST = 450, 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for package in ALLOWED:
        base = ROOT / package
        if not (base / "__init__.py").is_file():
            continue
        for path in sorted(base.rglob("*.py")):
            if "__pycache__" not in path.parts:
                mods[module_name(path)] = path
    return mods


MODULES = project_modules()


def resolve(name: str) -> str | None:
    """The project module that importing `name` runs last: `name` itself, else the
    longest project module it starts with; None when it is not the project's. Installed,
    the packages live under `plurai.` (pyproject's package-dir)."""
    name = name.removeprefix("plurai.")
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported project module, line) for each import in the file."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (target := resolve(alias.name)) is not None:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package upward
                base = module.split(".")
                drop = node.level - 1 if is_package else node.level
                base = base[: len(base) - drop] if drop else base
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                # `from pkg import mod` imports the submodule pkg.mod when there is one
                target = resolve(f"{prefix}.{alias.name}")
                if target is None or target != f"{prefix}.{alias.name}":
                    target = resolve(prefix)
                if target is not None:
                    yield target, node.lineno


def graph() -> dict[str, dict[str, list[str]]]:
    """module -> {imported module -> ["file:line", ...]}"""
    edges: dict[str, dict[str, list[str]]] = {m: {} for m in MODULES}
    for module, path in MODULES.items():
        where = path.relative_to(ROOT).as_posix()
        for target, line in imports(module, path):
            if target == module:
                continue
            found = edges[module].setdefault(target, [])
            if f"{where}:{line}" not in found:
                found.append(f"{where}:{line}")
    return edges


def cycles(edges: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_modules_found():
    assert {m.partition(".")[0] for m in MODULES} >= {
        "broker_config",
        "kv_store",
        "results",
        "gpu_workers",
        "producer",
        "gateway",
        "cli",
    }
    assert "gpu_workers.engine.engine" in MODULES and "cli.main" in MODULES


def test_no_import_cycle():
    edges = graph()
    problems = []
    for component in cycles(edges):
        inside = set(component)
        lines = [
            f"  {src} -> {dst}  ({', '.join(where)})"
            for src in component
            for dst, where in sorted(edges[src].items())
            if dst in inside
        ]
        problems.append("import cycle among " + ", ".join(component) + ":\n" + "\n".join(lines))
    assert not problems, "\n".join(problems)


def test_imports_run_downward():
    problems = []
    for src, targets in sorted(graph().items()):
        src_pkg = src.partition(".")[0]
        for dst, where in sorted(targets.items()):
            dst_pkg = dst.partition(".")[0]
            if dst_pkg != src_pkg and dst_pkg not in ALLOWED[src_pkg]:
                problems += [
                    f"{w}: {src} imports {dst} ({src_pkg} may import only "
                    f"{', '.join(sorted(ALLOWED[src_pkg])) or 'itself'})"
                    for w in where
                ]
    assert not problems, "imports against the layering:\n" + "\n".join(sorted(problems))


def test_a_long_file_says_why() -> None:
    files = [p for p in MODULES.values()] + sorted((ROOT / "bench").rglob("*.py"))
    tests = sorted((ROOT / "tests").rglob("*.py"))
    problems = []
    for path, limit in [(p, LONG) for p in files] + [(p, LONG_TEST) for p in tests]:
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > limit and "One file, though long:" not in doc:
            problems.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not problems, (
        f"files over {LONG} lines ({LONG_TEST} for tests) without a reason in their docstring"
        ' ("One file, though long: ..."); split them by concern:\n' + "\n".join(problems)
    )
