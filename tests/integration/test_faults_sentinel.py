"""Redis Sentinel: a real primary, a replica and three sentinels on free ports. Workers and
the SDK connect with a redis+sentinel:// URL; the primary is SIGKILLed mid-run and the
sentinels promote the replica: every job submitted (and replicated, PLURAI_SUBMIT_REPLICAS)
before the failover gets exactly one result. A submit that no replica acknowledged is
reported to the client, which can send it again."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from plurai.broker_config.connection import connect
from plurai.broker_config.embedded import find_binary, free_port
from plurai.broker_config.settings import Settings
from plurai.producer.aio import AsyncClient
from plurai.producer.client import Client
from plurai.producer.errors import NotReplicated
from plurai.results import records

from .faults import FAST, LANES, drained, end_entries

SERVICE = "plurai-main"


class Sentinels:
    """A primary, a replica of it and three sentinels watching them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.binary = find_binary("redis-server")
        self.procs: dict[str, subprocess.Popen] = {}
        self.primary_port, self.replica_port = free_port(), free_port()
        self._server("primary", self.primary_port)
        self._server(
            "replica", self.replica_port, "--replicaof", "127.0.0.1", str(self.primary_port)
        )
        self.sentinel_ports = [free_port() for _ in range(3)]
        for i, port in enumerate(self.sentinel_ports):
            conf = root / f"sentinel-{i}.conf"  # a sentinel rewrites its file: one each
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {root}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
            )
            self._spawn(f"sentinel-{i}", [self.binary, str(conf), "--sentinel"])
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        self.url = f"redis+sentinel://{hosts}/{SERVICE}/0"
        self._wait_ready()

    def _server(self, name: str, port: int, *extra: str) -> None:
        cmd = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        self._spawn(name, [*cmd, "--appendonly", "no", "--dir", str(self.root), *extra])

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def _wait_ready(self) -> None:
        give_up = time.monotonic() + 30
        while True:
            try:
                replica = redis.Redis(port=self.replica_port)
                sentinel = redis.Redis(port=self.sentinel_ports[0])
                linked = replica.info("replication").get("master_link_status") == "up"
                seen = sentinel.execute_command("SENTINEL", "REPLICAS", SERVICE)
                if (
                    linked
                    and seen
                    and len(sentinel.execute_command("SENTINEL", "SENTINELS", SERVICE)) == 2
                ):
                    return
            except redis.RedisError:
                pass
            assert time.monotonic() < give_up, "the sentinel set did not come up"
            time.sleep(0.2)

    def kill_primary(self) -> None:
        proc = self.procs["primary"]
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def sentinels(tmp_path: Path):
    s = Sentinels(tmp_path)
    yield s
    s.stop()


def test_failover_mid_run_gives_every_job_one_result(
    sentinels, tiny_model, workers_class, tmp_path
):
    url = sentinels.url
    w = workers_class(url, tiny_model, tmp_path)
    client = Client(url, settings=Settings(submit_replicas=1, submit_replicas_timeout_ms=5000))
    try:
        w.start(2, env=FAST)
        reqs = [
            {"prompt": f"failover {i}", "max_tokens": 12, "ignore_eos": True, "lane": LANES[i % 3]}
            for i in range(300)
        ]
        ids = [j.id for j in client.submit_many(reqs)]  # each on the replica too (WAIT)
        r = connect(url, socket_timeout=5)
        give_up = time.monotonic() + 120
        while sum(rec.final for rec in records.get_many(r, ids)) < 30:
            assert time.monotonic() < give_up, "the workers never ran jobs"
            time.sleep(0.02)
        sentinels.kill_primary()  # no shutdown: what the replica has is what survives
        recs: list[records.JobRecord] = []
        give_up = time.monotonic() + 150
        while time.monotonic() < give_up:
            try:
                recs = records.get_many(r, ids)
                if all(rec.final for rec in recs):
                    break
            except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError):
                pass  # the failover is under way
            time.sleep(0.3)
        assert [rec.state for rec in recs] == [records.COMPLETED] * 300
        assert end_entries(r, ids) == [1] * 300  # one result each, written once
        assert drained(r)
        assert r.execute_command("ROLE")[0] in (b"master", "master")
        assert connect(url).connection_pool.get_master_address()[1] == sentinels.replica_port
        assert all(p.poll() is None for p in w.procs)  # the workers rode it out
    finally:
        client.close()
        assert w.stop() == [0, 0]


def test_a_submit_no_replica_acknowledged_is_reported(sentinels):
    replica = sentinels.procs["replica"]
    client = Client(
        sentinels.url, settings=Settings(submit_replicas=1, submit_replicas_timeout_ms=300)
    )
    os.kill(replica.pid, signal.SIGSTOP)  # the replica takes nothing in for now
    try:
        with pytest.raises(NotReplicated) as e:
            client.submit("unreplicated", max_tokens=4, idempotency_key="k-unreplicated")
        assert e.value.acked == 0 and len(e.value.job_ids) == 1
        with pytest.raises(NotReplicated):
            client.submit_many([{"prompt": f"p{i}", "max_tokens": 4} for i in range(3)])

        async def the_async_client() -> None:
            aio = AsyncClient(sentinels.url, settings=client.settings)
            try:
                with pytest.raises(NotReplicated):
                    await aio.submit("async", max_tokens=4)
                with pytest.raises(NotReplicated):
                    await aio.submit_many([{"prompt": "p", "max_tokens": 4}])
            finally:
                await aio.aclose()

        asyncio.run(the_async_client())
    finally:
        os.kill(replica.pid, signal.SIGCONT)
    # once the replica is back, the same submit (same idempotency key) is the same job, now
    # acknowledged by it
    again = client.submit("unreplicated", max_tokens=4, idempotency_key="k-unreplicated")
    assert again.id == e.value.job_ids[0]
    client.close()
