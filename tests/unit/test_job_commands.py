"""results/jobs.py without Redis: the commands it builds and the script names it knows.
tests/integration/test_jobs.py and test_jobs_control.py run every call against a real
redis-server."""

from __future__ import annotations

import hashlib

import pytest

from plurai.broker_config import keys
from plurai.results import jobs, scripts


def test_sha_is_the_sha1_of_the_script_text() -> None:
    names = ("QUEUED", "SUBMIT", "ENQUEUE", "TAKE", "BEGIN", "DELTAS", "FINALIZE", "CANCEL")
    for name in (*names, "RELEASE", "REQUEUE", "RENEW", "CHECK"):
        assert jobs.sha(name) == hashlib.sha1(getattr(scripts, name).encode()).hexdigest()
    with pytest.raises(KeyError, match="no script"):
        jobs.sha("NOPE")


def test_command_is_evalsha_with_the_number_of_keys() -> None:
    call = jobs.check(job_ids=["a", "b"])
    assert call.command() == ["EVALSHA", jobs.sha("CHECK"), 2, "plurai:job:{a}", "plurai:job:{b}"]
    assert call.command("f00")[1] == "f00"
    stream = keys.request_stream("batch")
    renew = jobs.renew(stream=stream, consumer="w", entry_ids=[b"1-0", b"2-0"])
    assert renew.command()[2:] == [1, "plurai:{default}:req:batch", keys.GROUP, "w", b"1-0", b"2-0"]


def test_submit_keys_with_and_without_an_idempotency_key() -> None:
    named = dict(
        lane="standard",
        model="m",
        shard=3,
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
    # each call's keys share one hash tag: one Cluster slot
    assert plain.record.keys == ["plurai:job:{j1}"]
    assert plain.queue.keys == ["plurai:{m:3}:req:standard"]
    assert (plain.job_id, plain.lane, plain.model) == ("j1", "standard", "m")
    keyed = jobs.submit(**named, idempotency_key="k")
    assert keyed.queue.keys == ["plurai:{m:3}:req:standard", "plurai:{m:3}:idem:k"]
    assert keyed.queue.args == plain.queue.args
    # a record written for nothing is deleted: the key was another job's, or the lane full
    assert plain.cleanup(1, "j1") is None
    assert plain.cleanup(1, "other") == ["DEL", "plurai:job:{j1}"]
    assert plain.cleanup(1, Exception("QUEUEFULL 5")) == ["DEL", "plurai:job:{j1}"]
    assert plain.cleanup(0, "other") is None  # the record was there before: not ours


def test_deltas_encode_mode_text_and_ids() -> None:
    call = jobs.deltas(
        worker="w",
        maxlen=100,
        items=[
            jobs.Delta("a", "hi", [1, 2]),
            jobs.Delta("b", "all", [3], reset=True),
            jobs.Delta("c", "x", [4], index=2),  # a choice of a job of n > 1
        ],
    )
    assert call.keys == [
        *(keys.job("a"), keys.output("a"), keys.progress("a")),
        *(keys.job("b"), keys.output("b"), keys.progress("b")),
        *(keys.job("c"), keys.output("c"), keys.progress("c")),
    ]
    assert call.args == [
        *("w", 100, 86400),
        *("d", "hi", "[1,2]", "", "a", b""),
        *("r", "all", "[3]", "", "a", b""),
        *("d", "x", "[4]", 2, "a", b""),
    ]


def test_finalize_acks_its_entry_only_after_its_reply() -> None:
    named = dict(
        job_id="j",
        state="completed",
        finish_reason="stop",
        fields=["text", "x"],
        ttl_s=1,
        stream_ttl_s=2,
        stream_maxlen=3,
    )
    stream = keys.request_stream("batch")
    with_entry = jobs.finalize(**named, lane="batch", entry=(stream, b"1-0"))
    without = jobs.finalize(**named)
    job_keys = [keys.job("j"), keys.output("j"), keys.progress("j")]
    assert with_entry.keys == without.keys == job_keys
    assert with_entry.then == jobs.ack(stream, b"1-0") and without.then == []
    assert with_entry.entry == (stream, b"1-0") and without.entry is None
    # on one Redis the script acks the entry itself, in the same step as the result
    inside = jobs.finalize(**named, lane="batch", entry=(stream, b"1-0"), ack_inside=True)
    assert inside.keys == [*job_keys, stream] and inside.then == []
    assert inside.args[7:10] == [keys.GROUP, b"1-0", "text"]
    assert without.args[7:10] == ["", "", "text"]
    assert jobs.finalize(**named, ack_inside=True).keys == without.keys  # no entry: no ack
    assert jobs.ack(stream, b"1-0") == [
        ["XACK", stream, keys.GROUP, b"1-0"],
        ["XDEL", stream, b"1-0"],
    ]


def test_resynced_rewrites_unless_the_job_had_no_deltas() -> None:
    def final(resync: jobs.Resync) -> jobs.Call:
        return jobs.finalize(
            job_id="j",
            lane="batch",
            entry=(keys.request_stream("batch"), "1-0"),
            state="completed",
            finish_reason="stop",
            fields=[],
            ttl_s=1,
            stream_ttl_s=2,
            stream_maxlen=3,
            resync=resync,
        )

    auto = final(jobs.RESYNC_AUTO)
    assert jobs.resynced(auto) == final(jobs.RESYNC_ALWAYS)
    assert auto == final(jobs.RESYNC_AUTO)  # unchanged
    assert jobs.resynced(final(jobs.RESYNC_NEVER)) == final(jobs.RESYNC_NEVER)
    with pytest.raises(ValueError):
        jobs.resynced(jobs.check(job_ids=["j"]))
