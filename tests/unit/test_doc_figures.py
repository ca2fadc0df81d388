"""One figure per fact: a measured figure the README or any page of docs/ quotes is one that
docs/benchmarks.md holds (where each has its command, machine and date), so that a figure
mended there cannot live on, stale, on another page. docs/settings.md is left out: it is
written from the code's settings, defaults rather than measurements. A value that is not a
measurement (a limit, a default, a constant) is written so that it does not read as a
figure: as a code span where a user sets or sends it, else in words."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
SETTINGS = ROOT / "docs" / "settings.md"


def pages() -> list[Path]:
    """The pages that quote figures: the README and docs/*.md but the two above."""
    docs = sorted(p for p in (ROOT / "docs").glob("*.md") if p not in (BENCHMARKS, SETTINGS))
    return [ROOT / "README.md", *docs]


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


def test_the_pages_are_the_readme_and_the_docs_but_benchmarks_and_settings() -> None:
    names = [str(p.relative_to(ROOT)) for p in pages()]
    assert names[0] == "README.md" and "docs/guide.md" in names
    assert "docs/architecture.md" in names and "docs/operations.md" in names
    assert "docs/benchmarks.md" not in names and "docs/settings.md" not in names


def test_every_quoted_figure_is_in_the_benchmarks_page() -> None:
    held = {value(x) for x in re.findall(NUMBER, BENCHMARKS.read_text())}
    missing = []
    for page in pages():
        for figure in sorted(figures(page.read_text())):
            if value(figure) not in held:
                missing.append(f"{page.relative_to(ROOT)}: {figure}")
    assert not missing, (
        "figures quoted outside docs/benchmarks.md that it does not hold: a measured one "
        "belongs there, with its command, machine and date (quote what it holds, or point to "
        "it); a limit, default or constant is no figure: write it as a code span (`1048576`, "
        "`PLURAI_X=0.1`) or in words. " + str(missing)
    )
