"""Every error code a job, a submit, the engine, `plurai dead-letters` or `plurai lane` can
end with is in docs/protocol.md, "Error codes", and the page names no code that does not
exist."""

from __future__ import annotations

import re
from pathlib import Path

from plurai.broker_config.errors import Code, ErrorCode
from plurai.producer.dead_letters import DeadCode
from plurai.producer.lanes import LaneCode

PAGE = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def section() -> str:
    text = PAGE.read_text()
    start = text.index("\n## Error codes\n")
    return text[start : text.index("\n## ", start + 1)]


def codes() -> set[str]:
    """Code's, the engine's own (ErrorCode: duplicate_request_id, of offline use) and the
    refusals of `plurai dead-letters` and `plurai lane` (DeadCode, LaneCode)."""
    return {
        v for cls in (Code, ErrorCode, DeadCode, LaneCode) for k, v in vars(cls).items()
        if k.isupper() and isinstance(v, str)
    }  # fmt: skip


def test_every_code_is_documented() -> None:
    text = section()
    missing = sorted(c for c in codes() if f"`{c}`" not in text)
    assert not missing, f"add them to docs/protocol.md, Error codes: {missing}"


def test_the_table_names_only_codes_that_exist() -> None:
    rows = re.findall(r"^\| `([a-z_0-9]+)` \|", section(), re.M)
    assert rows, "the table was not found"
    assert sorted(set(rows) - codes()) == []
