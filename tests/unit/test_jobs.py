"""results/jobs.py without Redis: the commands it builds and the script names it knows.
tests/integration/test_jobs.py runs every call against a real redis-server."""

from __future__ import annotations

import hashlib

import pytest

from broker_config import keys
from results import jobs, scripts


def test_sha_is_the_sha1_of_the_script_text() -> None:
    for name in ("SUBMIT", "BEGIN", "DELTAS", "FINALIZE", "CANCEL", "REQUEUE", "RENEW", "CHECK"):
        assert jobs.sha(name) == hashlib.sha1(getattr(scripts, name).encode()).hexdigest()
    with pytest.raises(KeyError, match="no script"):
        jobs.sha("NOPE")


def test_command_is_evalsha_with_the_number_of_keys() -> None:
    call = jobs.check(job_ids=["a", "b"])
    assert call.command() == ["EVALSHA", jobs.sha("CHECK"), 2, "plurai:job:a", "plurai:job:b"]
    assert call.command("f00")[1] == "f00"
    renew = jobs.renew(lane="batch", consumer="w", entry_ids=[b"1-0", b"2-0"])
    assert renew.command()[2:] == [1, "plurai:req:batch", keys.GROUP, "w", b"1-0", b"2-0"]


def test_submit_keys_with_and_without_an_idempotency_key() -> None:
    named = dict(
        lane="standard",
        job_id="j1",
        fields=["v", 1],
        created_ms=5,
        priority=0,
        metadata_json=None,
        stream_maxlen=10,
        queued_ttl_s=20,
        idempotency_ttl_s=30,
        max_queued=0,
    )
    plain = jobs.submit(**named)
    assert plain.keys == ["plurai:req:standard", "plurai:job:j1"]
    assert (plain.job_id, plain.lane) == ("j1", "standard")
    keyed = jobs.submit(**named, idempotency_key="k")
    assert keyed.keys[2] == keys.idempotency("k") and keyed.args == plain.args


def test_deltas_encode_mode_text_and_ids() -> None:
    call = jobs.deltas(
        worker="w",
        maxlen=100,
        items=[jobs.Delta("a", "hi", [1, 2]), jobs.Delta("b", "all", [3], reset=True)],
    )
    assert call.keys == [keys.job("a"), keys.output("a"), keys.job("b"), keys.output("b")]
    assert call.args == ["w", 100, "d", "hi", "[1,2]", "r", "all", "[3]"]


def test_finalize_without_a_lane_has_no_stream_to_ack() -> None:
    named = dict(
        job_id="j",
        entry_id=b"1-0",
        state="completed",
        finish_reason="stop",
        fields=["text", "x"],
        ttl_s=1,
        stream_ttl_s=2,
        stream_maxlen=3,
        dead_letter_maxlen=4,
    )
    with_lane = jobs.finalize(**named, lane="batch")
    without = jobs.finalize(**named, lane=None)
    assert len(with_lane.keys) == 4 and with_lane.keys[3] == keys.request_stream("batch")
    assert without.keys == with_lane.keys[:3]


def test_resynced_rewrites_unless_the_job_had_no_deltas() -> None:
    def final(resync: jobs.Resync) -> jobs.Call:
        return jobs.finalize(
            job_id="j",
            lane="batch",
            entry_id="1-0",
            state="completed",
            finish_reason="stop",
            fields=[],
            ttl_s=1,
            stream_ttl_s=2,
            stream_maxlen=3,
            resync=resync,
            dead_letter_maxlen=4,
        )

    auto = final(jobs.RESYNC_AUTO)
    assert jobs.resynced(auto) == final(jobs.RESYNC_ALWAYS)
    assert auto == final(jobs.RESYNC_AUTO)  # unchanged
    assert jobs.resynced(final(jobs.RESYNC_NEVER)) == final(jobs.RESYNC_NEVER)
    with pytest.raises(ValueError):
        jobs.resynced(jobs.check(job_ids=["j"]))
