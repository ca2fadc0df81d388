"""docs/settings.md: every setting described, its readers named, the page current."""

from __future__ import annotations

import pytest

from plurai.broker_config import settings_doc
from plurai.broker_config.settings import BulkSettings, Settings

FIELDS = [*Settings.model_fields, *(f"batch.{n}" for n in BulkSettings.model_fields)]


@pytest.mark.parametrize("cls", [Settings, BulkSettings])
def test_every_setting_has_a_description(cls) -> None:
    missing = [name for name, f in cls.model_fields.items() if not (f.description or "").strip()]
    assert not missing, f"give these a docstring in broker_config/settings.py: {missing}"


def test_every_setting_names_who_reads_it() -> None:
    who = settings_doc.readers()
    assert sorted(set(FIELDS) - set(who)) == [], "add them to READ_BY"
    assert sorted(set(who) - set(FIELDS)) == [], "READ_BY names settings that do not exist"


def test_a_setting_twice_in_read_by_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(settings_doc.READ_BY, "again", "poll_ms")
    with pytest.raises(ValueError, match="poll_ms"):
        settings_doc.readers()


def test_the_page_is_current() -> None:
    assert settings_doc.main(["--check"]) == 0, "run python -m plurai.broker_config.settings_doc"


def test_a_row_gives_variable_default_range_and_description() -> None:
    rows = [line for line in settings_doc.render().splitlines() if "`PLURAI_BALANCE_MS`" in line]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split(" | ")]
    assert cells[:4] == ["`PLURAI_BALANCE_MS`", "`1000`", ">= 0, <= 10_000", "workers"]
    assert cells[4].startswith("Load balance between the workers of a queue")


def test_a_stale_page_is_found(tmp_path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    page = tmp_path / "settings.md"
    page.write_text(settings_doc.render().replace("1000", "999"))
    monkeypatch.setattr(settings_doc, "DOC", page)
    assert settings_doc.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert settings_doc.main([]) == 0
    assert settings_doc.main(["--check"]) == 0
