"""pyproject's package list: installed, every package of the repository lives under
`plurai.` (its folder mapped by package-dir), so a package folder left out of the list
would be missing from every install."""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_installed_under_plurai() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = dict(tool["package-dir"])
    assert tops.pop("plurai") == "plurai"  # the client's names, `from plurai import Client`
    assert not [
        p for p in (ROOT / "plurai").iterdir() if p.name not in ("__init__.py", "__pycache__")
    ]
    found = {"plurai"}
    for name, folder in tops.items():
        assert name == f"plurai.{folder}", name
        for init in (ROOT / folder).rglob("__init__.py"):
            sub = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join([name, *sub]))
    assert set(tool["packages"]) == found
    # the card's folders with code in them, each one of the mapped packages
    code = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"bench", "tests", "plurai"}
    assert {f"plurai.{c}" for c in code} == set(tops)


def test_the_client_imports_from_the_top() -> None:
    import plurai
    from plurai.producer import Client, __all__

    assert plurai.Client is Client and sorted(plurai.__all__) == sorted(__all__)


def test_the_image_copies_every_package_folder() -> None:
    """The Dockerfile copies folders by name before `pip install .`: one left out is missing
    from the image, and the install fails (setuptools finds no such package directory)."""
    tops = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied = {
        line.split()[1]
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and len(line.split()) == 3
    }
    assert set(tops.values()) <= copied, set(tops.values()) - copied
