"""`make demo`: the whole pipeline on one machine, with nothing installed but this package.

Starts an embedded redis-server, makes the tiny model if it is missing (trained for about
25 s on a public-domain book, so its answers read like words; cached afterwards), starts a
worker process, submits a handful of documents at mixed priorities, streams one answer,
prints the rest and a throughput line; then starts the HTTP gateway and streams one chat
answer through it with the official `openai` client; then stops everything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from plurai.broker_config.connection import redact
from plurai.broker_config.embedded import EmbeddedRedis, free_port, stop_process
from plurai.broker_config.stats import serving_workers
from plurai.producer.client import Client

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
    while not serving_workers(client.redis):
        if proc.poll() is not None:
            raise SystemExit("the worker exited; see its output above")
        if time.monotonic() > deadline:
            raise SystemExit("the worker did not start in time")
        time.sleep(0.2)


def through_gateway(url: str) -> bool:
    """Start a gateway on the demo's Redis and stream one chat answer with `openai`."""
    try:
        import httpx
        from openai import OpenAI
    except ImportError:
        print("(pip install openai to see the same queue through the HTTP gateway)")
        return True
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "plurai.cli", "gateway", "--url", url, "--port", str(port)]
        + ["--log-level", "WARNING"]
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(base + "/health", timeout=1)
                break
            except httpx.HTTPError:
                if gateway.poll() is not None or time.monotonic() > deadline:
                    print("the gateway did not start")
                    return False
                time.sleep(0.1)
        api = OpenAI(base_url=base + "/v1", api_key="none needed on localhost")
        question = "Who did Alice meet in the garden?"
        print(f"\nthe same queue over HTTP (plurai gateway on {base}, the openai client):")
        print(f"> {question}\n< ", end="", flush=True)
        stream = api.chat.completions.create(
            model=MODEL.name,
            messages=[{"role": "user", "content": question}],
            max_tokens=48,
            temperature=0.8,
            seed=1,
            stream=True,
        )
        for chunk in stream:
            if chunk.choices:
                print(chunk.choices[0].delta.content or "", end="", flush=True)
        print()
        return True
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)


def main() -> int:
    from plurai.gpu_workers.models.factory import describe, make_model

    if not (MODEL / "plurai_factory.json").exists():
        print(f"training the tiny model in {MODEL} (about 25 s, once) ...", flush=True)
    make_model(MODEL, family="llama", size="tiny", train=True)  # a cached build returns at once
    print(f"model: {describe(MODEL)}", flush=True)
    with (
        tempfile.TemporaryDirectory(prefix="plurai-demo-") as data,
        EmbeddedRedis(Path(data) / "redis") as url,
    ):
        print(f"redis-server (embedded) at {redact(url)}", flush=True)
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "plurai.cli",
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
                    temperature=0.8,
                    seed=i,
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
                line = " ".join((rec.text or "").split())[:70]
                print(f"[doc {i} | {rec.lane:<11} | {rec.state}] {line}")
            tokens = sum(rec.output_tokens or 0 for rec in records)
            print(
                f"\n{len(records)} jobs, {tokens} tokens in {elapsed:.2f}s: "
                f"{tokens / elapsed:.1f} tokens/s, {len(records) / elapsed:.2f} jobs/s"
            )
            client.close()
            ok = all(rec.state == "completed" for rec in records)
            return 0 if through_gateway(url) and ok else 1
        finally:
            stop_process(worker, timeout=60)


if __name__ == "__main__":
    raise SystemExit(main())
