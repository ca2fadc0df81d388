"""One figure per fact: a measured figure the README or docs/guide.md quotes is one that
docs/benchmarks.md holds (where each has its command, machine and date), so that a figure
mended there cannot live on, stale, on the front pages."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRONT = [ROOT / "README.md", ROOT / "docs" / "guide.md"]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"

# a measured figure: a decimal, a number with thousands separators, a percentage, a ratio
# (1.5x), or a count of seconds, milliseconds or minutes, alone or as a range (2.22-3.37);
# not a version (`≥ 3.10`), not part of a name (Qwen2.5, AVX-512, 2-core)
NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
SPAN = re.compile(rf"(?<![\w.≥=-])(?<!≥ )({NUMBER})(?:-({NUMBER}))?(?![\d.,]|-\w)")
UNIT = re.compile(r"%|x\b| ?ms\b| ?s\b| minutes\b")


def prose(markdown: str) -> str:
    """The text a reader reads as figures: no fenced blocks, code spans or link targets."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    text = re.sub(r"`[^`]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def figures(markdown: str) -> set[str]:
    text, found = prose(markdown), set()
    for m in SPAN.finditer(text):
        numbers = [g for g in m.groups() if g]
        if UNIT.match(text, m.end()) or any("," in n or "." in n for n in numbers):
            found.update(numbers)
    return found


def value(figure: str) -> float:
    return float(figure.replace(",", ""))


def test_the_figure_pattern_finds_measurements_and_not_names() -> None:
    text = "TTFT **0.71 s** against 2.22-3.37 s, 88% and 1.0-1.5x; 4,380 against 2,163-2,568"
    want = {"0.71", "2.22", "3.37", "88", "1.0", "1.5", "4,380", "2,163", "2,568"}
    assert figures(text) == want
    names = "Python ≥ 3.10, Qwen2.5-0.5B, AVX-512, 2-core, a 1,500-line file, `1.25 s`, v1.2.3"
    assert figures(names) == set()


def test_every_front_page_figure_is_in_the_benchmarks_page() -> None:
    held = {value(x) for x in re.findall(NUMBER, BENCHMARKS.read_text())}
    missing = []
    for page in FRONT:
        for figure in sorted(figures(page.read_text())):
            if value(figure) not in held:
                missing.append(f"{page.relative_to(ROOT)}: {figure}")
    assert not missing, (
        "figures quoted on a front page that docs/benchmarks.md does not hold (measure them "
        "there, with their command, machine and date, or quote what it holds): " + str(missing)
    )
