"""Token stream parsing and the restart-aware text follower."""

from __future__ import annotations

import pytest

from results import tokens
from results.records import JobRecord


def ev(type_: str, text: str = "") -> tokens.Event:
    return tokens.Event(type=type_, text=text)


def test_follower_passes_deltas() -> None:
    f = tokens.TextFollower()
    assert [f.feed(e) for e in (ev("start"), ev("delta", "ab"), ev("delta", "c"), ev("end"))] == [
        "",
        "ab",
        "c",
        "",
    ]


def test_follower_skips_a_repeated_run_after_reset() -> None:
    f = tokens.TextFollower()
    out = [
        f.feed(e)
        for e in (
            ev("delta", "abc"),
            ev("reset"),
            ev("start"),
            ev("delta", "ab"),
            ev("delta", "cd"),
            ev("delta", "e"),
        )
    ]
    assert "".join(out) == "abcde"


def test_follower_raises_when_the_rerun_differs() -> None:
    f = tokens.TextFollower()
    f.feed(ev("delta", "abc"))
    f.feed(ev("reset"))
    with pytest.raises(tokens.JobRestarted):
        f.feed(ev("delta", "x"))


def test_parse_and_record() -> None:
    e = tokens.parse({b"type": b"delta", b"text": b"hi", b"token_ids": b"[1,2]"})
    assert (e.type, e.text, e.token_ids) == ("delta", "hi", [1, 2])
    rec = JobRecord.from_hash(
        "j",
        {
            b"state": b"completed",
            b"final": b"1",
            b"token_ids": b"[3]",
            b"output_tokens": b"1",
            b"metadata": b'{"a": 1}',
        },
    )
    assert (
        rec.final and rec.token_ids == [3] and rec.output_tokens == 1 and rec.metadata == {"a": 1}
    )
    assert JobRecord.from_hash("j", {}).state == "unknown"
