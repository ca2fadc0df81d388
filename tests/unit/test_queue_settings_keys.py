"""Settings sources and key names."""

from __future__ import annotations

import fakeredis
import pytest

from plurai.broker_config import keys, protocol
from plurai.broker_config.groups import ensure_groups
from plurai.broker_config.settings import BulkSettings, Settings
from plurai.broker_config.text import text


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PLURAI_CONFIG", "PLURAI_REDIS_URL", "PLURAI_LANES"):
        monkeypatch.delenv(name, raising=False)
    s = Settings()
    assert s.redis_url is None
    assert s.lanes == ["interactive", "standard", "batch"]
    assert s.lane_or_default(None) == "standard"
    with pytest.raises(ValueError, match="unknown lane 'urgent'"):
        s.lane_or_default("urgent")


def test_env_over_toml_over_defaults(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "plurai.toml"
    cfg.write_text(
        'redis_url = "rediss://u:p@h:6380/1"\nmax_tokens_limit = 99\nlanes = ["hi", "lo"]\ndefault_lane = "lo"\n'
    )
    monkeypatch.setenv("PLURAI_CONFIG", str(cfg))
    monkeypatch.setenv("PLURAI_MAX_TOKENS_LIMIT", "7")
    s = Settings()
    assert s.redis_url == "rediss://u:p@h:6380/1"
    assert s.max_tokens_limit == 7
    assert s.lanes == ["hi", "lo"]
    assert Settings(max_tokens_limit=3).max_tokens_limit == 3


def test_bulk_settings_env_over_the_batch_table(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "plurai.toml"
    cfg.write_text("max_tokens_limit = 9\nwindow = 1\n[batch]\nwindow = 512\nttl_s = 5\n")
    monkeypatch.setenv("PLURAI_CONFIG", str(cfg))
    monkeypatch.setenv("PLURAI_BATCH_TTL_S", "7")
    bs = BulkSettings()
    assert (bs.window, bs.ttl_s, bs.pass_s) == (512, 7, 5.0)  # table, env, default
    assert BulkSettings(ttl_s=3).ttl_s == 3
    assert Settings().max_tokens_limit == 9  # the [batch] table does not bother Settings
    monkeypatch.setenv("PLURAI_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(FileNotFoundError, match="PLURAI_CONFIG"):
        BulkSettings()


def test_missing_config_file_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLURAI_CONFIG", "/nonexistent/plurai.toml")
    with pytest.raises(FileNotFoundError, match="PLURAI_CONFIG"):
        Settings()


def test_bad_lanes_refused() -> None:
    with pytest.raises(ValueError):
        Settings(lanes=["a", "a"])
    with pytest.raises(ValueError):
        Settings(lanes=["has space"])


def test_key_names() -> None:
    # protocol v2: hash tags keep each script's keys in one Redis Cluster slot
    assert keys.request_stream("batch") == "plurai:{default}:req:batch"
    assert keys.request_stream("batch", "m-1", 2) == "plurai:{m-1:2}:req:batch"
    assert keys.job("abc") == "plurai:job:{abc}"
    assert keys.output("abc") == "plurai:out:{abc}"
    assert keys.done_channel("abc") == "plurai:done:abc"
    assert keys.idempotency("k") == "plurai:{default}:idem:k"
    assert keys.idempotency("k", "m", 1) == "plurai:{m:1}:idem:k"
    assert keys.MODELS == "plurai:models"
    # the shard: CRC-32 of the idempotency key (or job id), modulo the shard count
    assert keys.shard_of("k", 1) == 0
    assert {keys.shard_of(f"job-{i}", 4) for i in range(100)} == {0, 1, 2, 3}
    assert keys.worker("w1") == "plurai:worker:w1"
    assert keys.GROUP == "workers"
    assert keys.CANCEL_CHANNEL == "plurai:cancel"
    # bulk requests' idempotency keys: the same string on the wire as ever
    assert keys.bulk_idempotency("batch_1", "line-7", 2, 0) == "bulk:batch_1:64cc59f5f8285ebd:2:0"


def test_a_job_records_key_read_back() -> None:
    job_id = protocol.new_job_id()
    assert keys.job_of(keys.job(job_id)) == job_id
    assert keys.job_of(keys.job(job_id).encode()) == job_id
    hostile = [
        keys.output(job_id),  # another kind of key
        f"plurai:job:{job_id}",  # no braces
        "plurai:job:{}",
        "plurai:job:{short}",  # under 8 characters: no job id
        "plurai:job:{" + "a" * 129 + "}",
        "plurai:job:{a/b:c{d}e}",
        "plurai:job:{abcdefgh}x",
        "xplurai:job:{abcdefgh}",
        b"plurai:job:{abc\xffdefgh}",  # not ASCII
        "plurai:job:{abcdéfghi}",
        "",
    ]
    assert [keys.job_of(k) for k in hostile] == [None] * len(hostile)


def test_text() -> None:
    assert text(b"caf\xc3\xa9") == "café" and text("x") == "x" and text(3) == "3"
    assert text(b"\xff") == "\ufffd"


def test_group_bootstrap_is_idempotent() -> None:
    r = fakeredis.FakeRedis()
    r.xadd(keys.request_stream("batch"), {"early": "1"})
    streams = [keys.request_stream("interactive"), keys.request_stream("batch")]
    ensure_groups(r, streams)
    ensure_groups(r, streams)
    groups = r.xinfo_groups(keys.request_stream("batch"))
    assert [g["name"] for g in groups] == [b"workers"]
    # the group starts at 0: an entry added before any worker is still delivered
    got = r.xreadgroup("workers", "w", {keys.request_stream("batch"): ">"}, count=10)
    assert len(got[0][1]) == 1
