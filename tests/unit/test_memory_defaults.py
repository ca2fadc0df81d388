"""Memory defaults and refusals: a CPU engine's KV budgets are a bounded share of the
host's memory, its container's limit where lower; PLURAI_VLLM_KV_SHARE is checked; a full
Redis is told apart from other refusals, a script's refused write included."""

from __future__ import annotations

import pytest
import redis
from pydantic import ValidationError

from plurai.broker_config.memory import is_oom
from plurai.broker_config.settings import Settings
from plurai.gpu_workers.engine import config
from plurai.gpu_workers.engine.config import EngineConfig


def limit(monkeypatch, tmp_path, value: str) -> None:
    path = tmp_path / "memory.max"
    path.write_text(value + "\n")
    monkeypatch.setattr(config, "CGROUP_LIMITS", (str(path),))


def test_a_container_limit_bounds_the_kv_budgets(monkeypatch, tmp_path):
    limit(monkeypatch, tmp_path, str(2 << 30))  # a 2 GiB container on a larger host
    c = EngineConfig(model="m")
    assert c.kv_cache_bytes == c.kv_host_bytes == int((2 << 30) * config.HOST_SHARE)
    assert EngineConfig(model="m", kv_cache_bytes=123).kv_cache_bytes == 123  # given: kept


def test_without_a_limit_the_host_counts_and_1_gib_is_the_most(monkeypatch, tmp_path):
    limit(monkeypatch, tmp_path, "max")  # cgroup v2: no limit
    total = config.host_memory_bytes()
    assert total > 0
    assert EngineConfig(model="m").kv_cache_bytes == min(1 << 30, int(total * config.HOST_SHARE))


def test_the_vllm_share_is_checked(monkeypatch):
    assert Settings().vllm_kv_share == 0.2
    monkeypatch.setenv("PLURAI_VLLM_KV_SHARE", "0.95")
    with pytest.raises(ValidationError):
        Settings()


def test_full_redis_refusals_are_told_apart():
    assert is_oom(redis.exceptions.OutOfMemoryError("command not allowed when used memory"))
    script = (
        "Error running script (call to f_ab): @user_script:4: @user_script: 4: -OOM command "
        "not allowed when used memory > 'maxmemory'."
    )
    assert is_oom(redis.ResponseError(script))
    assert not is_oom(redis.ResponseError("WRONGTYPE Operation against a key"))
    assert not is_oom(redis.ConnectionError("OOM command not allowed"))  # not a reply
    assert not is_oom(ValueError("OOM command not allowed"))
