"""What the SDK makes of damaged Redis content it reads back: a job record whose fields do
not parse (BadRecord, code bad_record), an error reply to WAIT (NotReplicated), a batch's
damaged generation (its step chain ends) (fakeredis)."""

from __future__ import annotations

import types

import fakeredis
import pytest

from plurai.broker_config import keys
from plurai.producer.errors import NotReplicated, check_replicas
from plurai.results import records
from plurai.results.records import BadRecord, JobRecord


def test_a_good_record_parses():
    rec = JobRecord.from_hash(
        "j1",
        {b"state": b"completed", b"final": b"1", b"prompt_tokens": b"3", b"token_ids": b"[1,2]"},
    )
    assert rec.final and rec.prompt_tokens == 3 and rec.token_ids == [1, 2]


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("prompt_tokens", "x", "not an integer"),
        ("priority", "1.5", "not an integer"),
        ("first_token_ms", "soon", "not an integer"),
        ("token_ids", "[1,", "not JSON"),
        ("metadata", "[" * 100_000, "not JSON"),  # nested past the parser's depth
        ("logprobs", "{nope}", "not JSON"),
    ],
)
def test_a_field_that_does_not_parse_is_a_bad_record(field, value, says):
    r = fakeredis.FakeRedis()
    r.hset(keys.job("j2"), mapping={"state": "completed", "final": "1", field: value})
    with pytest.raises(BadRecord, match=f"job j2: record field '{field}' is {says}") as e:
        records.get(r, "j2")
    assert e.value.code == "bad_record" and isinstance(e.value, ValueError)


def test_an_error_reply_to_wait_is_not_replicated():
    refused = RuntimeError("NOPERM this user has no permissions to run the 'wait' command")
    with pytest.raises(NotReplicated, match="0 of 1 replicas") as e:
        check_replicas(["j"], refused, 1, 100)
    assert e.value.__cause__ is refused and e.value.job_ids == ["j"]
    with pytest.raises(NotReplicated, match="1 of 2 replicas"):
        check_replicas(["j"], 1, 2, 100)
    check_replicas(["j"], 2, 2, 100)  # enough
    check_replicas(["j"], refused, 0, 100)  # not asked for


def test_a_step_of_a_batch_whose_generation_is_damaged_ends_its_chain(monkeypatch):
    from plurai.producer.bulk import drive, tasks

    r = fakeredis.FakeRedis()
    monkeypatch.setattr(tasks, "_client", lambda: types.SimpleNamespace(redis=r))
    monkeypatch.setattr(drive, "step", lambda *a: pytest.fail("a damaged batch was driven"))
    for gen in (b"x", b"\xff", b"99999999999999999999999999"):
        r.hset(keys.batch("batch_1"), "gen", gen)
        assert tasks.step("batch_1", 3) == "superseded"
    r.hset(keys.batch("batch_1"), "gen", b"4")
    assert tasks.step("batch_1", 3) == "superseded"
