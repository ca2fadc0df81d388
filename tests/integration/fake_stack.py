"""A gateway process, and a stand-in worker for gateway tests that measure the gateway,
not a model.

The stand-in heartbeats
as a worker serving `model`, takes request entries from the model's lanes and answers each
at once through the workers' own scripts (BEGIN, DELTAS, FINALIZE, the ack).

A job of fewer than BIG_MAX_TOKENS max_tokens gets min(max_tokens, TOKENS) tokens of
" tok" (finish_reason `stop` when fewer than asked); one asking for BIG_MAX_TOKENS or
more gets BIG_ENTRIES deltas of ENTRY_CHARS characters (256 KiB), and one asking for
HUGE_MAX_TOKENS or more HUGE_ENTRIES (12 MiB): more than the kernel's socket buffers
take (4 MiB at most by default), so that a client that does not read leaves the rest
to the gateway."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import redis

from plurai.broker_config import keys, protocol
from plurai.broker_config.routes import registry_value
from plurai.broker_config.settings import Settings
from plurai.results import jobs, records

from .test_gateway import Gateway

TOKENS = 8
BIG_MAX_TOKENS = 4000
HUGE_MAX_TOKENS = 4090
ENTRY_CHARS = 1024
BIG_ENTRIES = 256
HUGE_ENTRIES = 12 * 1024


class FakeWorker:
    def __init__(self, url: str, model: str = "flood", worker_id: str = "fake-0") -> None:
        self.url, self.model, self.id = url, model, worker_id
        self.lanes = Settings().lanes
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.answered = 0

    def start(self) -> FakeWorker:
        r = redis.Redis.from_url(self.url)
        for lane in self.lanes:
            try:
                r.xgroup_create(
                    keys.request_stream(lane, self.model), keys.GROUP, "0", mkstream=True
                )
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
        self._beat(r)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=10)

    def _beat(self, r: redis.Redis) -> None:
        now = records.now_ms()
        beat = {
            "model": self.model,
            "model_id": self.model,
            "served_model": self.model,
            "max_model_len": 4096,
            "state": "serving",
            "beat_ms": now,
            "shards": 1,
        }
        pipe = r.pipeline(transaction=False)
        pipe.hset(keys.worker(self.id), mapping=beat)
        pipe.expire(keys.worker(self.id), 5)
        pipe.sadd(keys.WORKERS, self.id)
        pipe.hset(keys.MODELS, self.model, registry_value(1, now))
        pipe.execute()

    def _run(self) -> None:
        r = redis.Redis.from_url(self.url)
        jobs.load(r, "BEGIN", "DELTAS", "FINALIZE")
        streams = {keys.request_stream(lane, self.model): ">" for lane in self.lanes}
        beat_at = time.monotonic()
        while not self.stop_event.is_set():
            if time.monotonic() - beat_at > 1:
                self._beat(r)
                beat_at = time.monotonic()
            reply = r.xreadgroup(keys.GROUP, self.id, streams, count=64, block=100)
            for stream, entries in reply or []:
                for entry_id, fields in entries:
                    self._answer(r, stream.decode(), entry_id, fields)
                    self.answered += 1

    def _answer(self, r: redis.Redis, stream: str, entry_id: bytes, fields: dict) -> None:
        env = protocol.parse_envelope(fields, protocol.Limits())
        job_id = env.job_id
        begin = jobs.begin(
            job_id=job_id,
            worker=self.id,
            now_ms=records.now_ms(),
            ttl_s=600,
            deadline_ms=None,
            lane="",
            priority=0,
            metadata_json=None,
            tenant=env.tenant,
        )
        if jobs.run(r, begin) not in (b"run", "run"):
            for command in jobs.ack(stream, entry_id):
                r.execute_command(*command)
            return
        if env.max_tokens >= BIG_MAX_TOKENS:
            n = HUGE_ENTRIES if env.max_tokens >= HUGE_MAX_TOKENS else BIG_ENTRIES
            deltas = [("x" * (ENTRY_CHARS - 1) + "\n", [7]) for _ in range(n)]
        else:
            deltas = [(" tok", [5]) for _ in range(min(env.max_tokens, TOKENS))]
        for at in range(0, len(deltas), 1024):
            pipe = r.pipeline(transaction=False)
            for text, ids in deltas[at : at + 1024]:
                call = jobs.deltas(
                    worker=self.id, maxlen=100_000, items=[jobs.Delta(job_id, text, ids)]
                )
                pipe.execute_command(*call.command())
            pipe.execute()
        text = "".join(t for t, _ in deltas)
        token_ids = [i for _, ids in deltas for i in ids]
        reason = "length" if len(token_ids) >= env.max_tokens else "stop"
        final = jobs.finalize(
            job_id=job_id,
            state=records.COMPLETED,
            finish_reason=reason,
            fields=records.final_fields(
                text=text,
                token_ids=token_ids,
                prompt_tokens=3,
                worker=self.id,
                finished_ms=records.now_ms(),
            ),
            ttl_s=600,
            stream_ttl_s=600,
            stream_maxlen=100_000,
            entry=(stream, entry_id),
        )
        jobs.run(r, final)
        for command in final.then:
            r.execute_command(*command)


class GatewayProcess(Gateway):
    """`plurai gateway` on a free loopback port, its output in `log`, with what the flood
    tests read of it."""

    def __init__(self, url: str, log: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(url, log, env)
        self.log = log

    def rss_mib(self) -> float:
        """The gateway process's resident memory now."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def gauge(self, name: str) -> float:
        for line in httpx.get(self.base + "/metrics", timeout=5).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"no {name} in /metrics")
