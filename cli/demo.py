"""`make demo`: the whole pipeline on one machine, with nothing installed but this package.

Starts an embedded redis-server, makes the tiny random-weight model if it is missing,
starts a worker process, submits a handful of documents at mixed priorities, streams one
answer, prints the rest and a throughput line, then stops the worker and Redis.
(The tiny model has random weights: its text is gibberish, produced the real way.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from broker_config import keys
from broker_config.connection import redact
from broker_config.embedded import EmbeddedRedis
from producer.client import Client

MODEL = Path("models/tiny-llama")
DOCS = [
    ("interactive", "Summarize: The council approved the new bridge after a long debate."),
    ("standard", "Summarize: Rain is expected across the north for most of the week."),
    ("standard", "Translate to French: The library opens at nine."),
    ("batch", "Summarize: The museum reopened its east wing with a map exhibition."),
    ("batch", "List three facts about winter gardens."),
    ("batch", "Summarize: A small press printed the letters of a forgotten poet."),
    ("batch", "Write a title for: the river stone and the quiet city."),
    ("interactive", "Answer briefly: what is a paper machine?"),
]


def wait_for_worker(client: Client, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not client.redis.scard(keys.WORKERS):
        if proc.poll() is not None:
            raise SystemExit("the worker exited; see its output above")
        if time.monotonic() > deadline:
            raise SystemExit("the worker did not start in time")
        time.sleep(0.2)


def main() -> int:
    if not (MODEL / "config.json").exists():
        print(f"making the tiny model in {MODEL} ...", flush=True)
        from gpu_workers.models.factory import make_model

        make_model(MODEL, family="llama", size="tiny")
    with (
        tempfile.TemporaryDirectory(prefix="plurai-demo-") as data,
        EmbeddedRedis(Path(data) / "redis") as url,
    ):
        print(f"redis-server (embedded) at {redact(url)}", flush=True)
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cli",
                "worker",
                "--model",
                str(MODEL),
                "--url",
                url,
                "--log-level",
                "WARNING",
            ],
            env={**os.environ, "PLURAI_HEARTBEAT_INTERVAL_S": "1"},
        )
        try:
            client = Client(url)
            print("starting a worker (loading the engine) ...", flush=True)
            wait_for_worker(client, worker)
            start = time.perf_counter()
            jobs = [
                client.submit(
                    text,
                    max_tokens=48,
                    lane=lane,
                    priority=i % 3,
                    metadata={"doc": i},
                    ignore_eos=True,
                )
                for i, (lane, text) in enumerate(DOCS)
            ]
            print(
                f"\nsubmitted {len(jobs)} documents; streaming doc 0 ({DOCS[0][0]} lane):\n> ",
                end="",
            )
            for text in jobs[0].stream():
                print(text, end="", flush=True)
            print("\n")
            records = client.wait_all(jobs, timeout=300)
            elapsed = time.perf_counter() - start
            for i, rec in enumerate(records[1:], start=1):
                print(f"[doc {i} | {rec.lane:<11} | {rec.state}] {(rec.text or '')[:70]!r}")
            tokens = sum(rec.output_tokens or 0 for rec in records)
            print(
                f"\n{len(records)} jobs, {tokens} tokens in {elapsed:.2f}s: "
                f"{tokens / elapsed:.1f} tokens/s, {len(records) / elapsed:.2f} jobs/s"
            )
            client.close()
            return 0 if all(rec.state == "completed" for rec in records) else 1
        finally:
            worker.terminate()
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()


if __name__ == "__main__":
    raise SystemExit(main())
