"""Bulk batches end to end: a real Celery worker, a real GPU worker, a real redis-server.

Documents longer than the workers' context (max_model_len 128) are split and reduced; each
output line must equal the same plan run offline through Engine.generate.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from plurai.broker_config import keys
from plurai.broker_config.settings import BulkSettings
from plurai.producer.bulk import manage, plan, store
from plurai.producer.bulk.drive import tokenizer
from plurai.producer.client import Client

from .conftest import ROOT

CONTEXT = 128
MAX_TOKENS = 8
WORDS = "the a river stone light north quiet letter garden winter paper machine city old".split()


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    # about a third are longer than the context: 70 words are ~120 tokens here
    sizes = [rng.randint(80, 260) if rng.random() < 0.35 else rng.randint(3, 40) for _ in range(n)]
    return [" ".join(rng.choice(WORDS) for _ in range(k)) for k in sizes]


class Celery:
    """A Celery worker process (`celery -A plurai.broker_config.celery_app worker --pool solo`)."""

    def __init__(
        self, url: str, log_dir: Path, model: Path, env: dict[str, str] | None = None
    ) -> None:
        self.url, self.log_dir, self.n, self.model = url, log_dir, 0, model
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_dir / f"celery-{self.n}.log", "wb")  # noqa: SIM115
        self.n += 1
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "plurai.broker_config.celery_app",
                "worker",
                "--pool",
                "solo",
                "-c",
                "1",
                "--loglevel",
                "INFO",
                "-n",
                f"bulk{self.n}@127.0.0.1",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "PLURAI_REDIS_URL": self.url,
                "PLURAI_MODEL_DIR": str(self.model),
                "PLURAI_BATCH_PASS_S": "2",
                "PLURAI_BATCH_MAX_LINE_BYTES": "4096",
                **self.env,
            },
        )

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def gpu(module_redis_url: str, tiny_model: Path, tmp_path_factory, workers_class) -> Iterator[str]:
    w = workers_class(module_redis_url, tiny_model, tmp_path_factory.mktemp("gpu"))
    w.start(1, "--engine", f"max_model_len={CONTEXT}")
    yield module_redis_url
    w.stop()


@pytest.fixture
def celery(gpu: str, tmp_path: Path, tiny_model: Path) -> Iterator[Celery]:
    from plurai.broker_config.celery_app import app, configure

    configure(app, gpu)  # this process sends the first step of each batch
    c = Celery(gpu, tmp_path, tiny_model)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> list[str]:
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig
    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    engine = Engine(
        EngineConfig(
            model=str(tiny_model), dtype="fp32", max_model_len=CONTEXT, kv_cache_bytes=32 << 20
        )
    )
    task = plan.Task("summarize", max_tokens=MAX_TOKENS)
    return plan.run_offline(
        task,
        documents(200),
        engine.tokenizer,
        CONTEXT,
        lambda prompts, sampling: [
            c.text for c in engine.generate(prompts, SamplingParams(**sampling))
        ],
    )


def submit_docs(client: Client, tmp_path: Path, texts: list[str], model: Path) -> str:
    path = tmp_path / "docs.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"doc-{i}", "text": t}) + "\n" for i, t in enumerate(texts))
    )
    task = plan.Task("summarize", max_tokens=MAX_TOKENS)
    return manage.create(
        client, BulkSettings(), path, task=task, model_dir=str(model), max_model_len=CONTEXT
    )


def wait_done(client: Client, batch_id: str, timeout: float = 150) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        b = manage.info(client, batch_id)
        if b["status"] in store.TERMINAL:
            return b
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id}: {manage.info(client, batch_id)}")


def lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines()]


def check_docs(client: Client, batch_id: str, expected: list[str]) -> None:
    out, err = manage.results(client, batch_id)
    assert err == ""
    got = lines(out)
    assert [x["custom_id"] for x in got] == [f"doc-{i}" for i in range(len(expected))]
    texts = [x["response"]["body"]["choices"][0]["text"] for x in got]
    assert texts == expected
    b = manage.info(client, batch_id)
    assert b["status"] == "completed"
    assert b["request_counts"] == {"total": len(expected), "completed": len(expected), "failed": 0}


def test_documents_split_reduce_match_offline(celery, tmp_path, tiny_model, expected):
    texts = documents(200)
    tok = tokenizer(str(tiny_model))
    long_docs = sum(len(tok(t).input_ids) > CONTEXT for t in texts)
    assert 30 <= long_docs < 200  # the batch exercises splitting and reducing
    with Client(celery.url) as client:
        batch_id = submit_docs(client, tmp_path, texts, tiny_model)
        wait_done(client, batch_id)
        check_docs(client, batch_id, expected)


def test_celery_worker_killed_mid_batch_resumes(celery, tmp_path, tiny_model, expected):
    texts = documents(200)
    with Client(celery.url) as client:
        batch_id = submit_docs(client, tmp_path, texts, tiny_model)
        end = time.monotonic() + 120
        while manage.read(client, batch_id).completed < 20:
            assert time.monotonic() < end, "no progress before the kill"
            time.sleep(0.05)
        celery.kill()
        done_at_kill = manage.read(client, batch_id).completed
        assert done_at_kill < 200, "the batch finished before the kill; make it longer"
        celery.start()
        wait_done(client, batch_id)
        check_docs(client, batch_id, expected)
        assert client.redis.hlen(keys.batch_lines(batch_id)) == 200


def test_malformed_lines_go_to_the_error_file(celery, tmp_path):
    good = {"method": "POST", "body": {"max_tokens": 4, "temperature": 0}}
    rows = [
        json.dumps(
            {
                **good,
                "custom_id": "a",
                "url": "/v1/completions",
                "body": {**good["body"], "prompt": "the river"},
            }
        ),
        "{not json",
        json.dumps({**good, "custom_id": "b", "url": "/v1/embeddings", "body": {"input": "x"}}),
        json.dumps({**good, "url": "/v1/completions", "body": {"prompt": "no id"}}),
        json.dumps(
            {**good, "custom_id": "a", "url": "/v1/completions", "body": {"prompt": "again"}}
        ),
        json.dumps(
            {**good, "custom_id": "big", "url": "/v1/completions", "body": {"prompt": "x" * 5000}}
        ),
        json.dumps(
            {
                **good,
                "custom_id": "c",
                "url": "/v1/chat/completions",
                "body": {**good["body"], "messages": [{"role": "user", "content": "hello"}]},
            }
        ),
        json.dumps(
            {
                **good,
                "custom_id": "d",
                "url": "/v1/completions",
                "body": {"prompt": "x", "max_tokens": 10**9},
            }
        ),
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(rows) + "\n")
    with Client(celery.url) as client:
        batch_id = manage.create(client, BulkSettings(), path)
        b = wait_done(client, batch_id)
        out, err = manage.results(client, batch_id)
    ok = lines(out)
    assert [x["custom_id"] for x in ok] == ["a", "c"]
    assert ok[0]["response"]["body"]["object"] == "text_completion"
    assert ok[1]["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    errors = {(x["custom_id"], x["error"]["code"]): x["error"]["message"] for x in lines(err)}
    assert set(errors) == {
        (None, "invalid_json"),
        ("b", "invalid_url"),
        (None, "missing_custom_id"),
        ("a", "duplicate_custom_id"),
        ("big", "line_too_large"),
        ("d", "max_tokens_over_limit"),
    }
    assert "line 2" in errors[(None, "invalid_json")]
    assert "already used on line 1" in errors[("a", "duplicate_custom_id")]
    assert b["status"] == "completed"
    assert b["request_counts"] == {"total": 8, "completed": 2, "failed": 6}


def test_cli_submit_status_cancel_results(celery, tmp_path, tiny_model, capsys):
    from plurai.cli import main as cli

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, t in enumerate(documents(200, seed=3)):
        (docs / f"{i:03d}.txt").write_text(t)
    url = ["--url", celery.url]
    common = ["--task", "summarize", "--max-tokens", "8", "--model", str(tiny_model)]
    assert cli.main(["batch", "submit", str(docs), *common, "--max-model-len", "128", *url]) == 0
    batch_id = capsys.readouterr().out.strip()
    assert cli.main(["batch", "cancel", batch_id, *url]) == 0
    assert capsys.readouterr().out.strip() == "cancelling"
    with Client(celery.url) as client:
        b = wait_done(client, batch_id)
    assert b["status"] == "cancelled"
    assert cli.main(["batch", "status", batch_id, "--json", *url]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "cancelled"
    assert cli.main(["batch", "results", batch_id, "--dir", str(tmp_path / "out"), *url]) == 0
    ok = lines((tmp_path / "out" / f"{batch_id}_output.jsonl").read_text())
    err = lines((tmp_path / "out" / f"{batch_id}_errors.jsonl").read_text())
    ids = [x["custom_id"] for x in ok + err]
    assert sorted(ids) == [f"{i:03d}.txt" for i in range(200)]  # each once, none missing
    for command in ("status", "cancel", "results"):
        assert cli.main(["batch", command, "batch_nosuch", *url]) == 1
        assert "no batch batch_nosuch" in capsys.readouterr().err
    assert {x["error"]["code"] for x in err} == {"batch_cancelled"}
    assert len(err) > 0
    assert b["request_counts"] == {"total": 200, "completed": len(ok), "failed": len(err)}


def test_maintenance_expires_a_batch_past_its_window(celery, tmp_path, tiny_model, monkeypatch):
    from plurai.producer.bulk import tasks

    with Client(celery.url) as client:
        batch_id = submit_docs(client, tmp_path, documents(200, seed=4), tiny_model)
        monkeypatch.setenv("PLURAI_BATCH_COMPLETION_WINDOW_S", "0")
        report = tasks.maintain()  # what beat runs; here in the test's process
        assert batch_id in report["expired"]
        b = wait_done(client, batch_id)
        out, err = manage.results(client, batch_id)
    assert b["status"] == "expired"
    ids = [x["custom_id"] for x in lines(out) + lines(err)]
    assert sorted(ids) == sorted(f"doc-{i}" for i in range(200))
    assert {x["error"]["code"] for x in lines(err)} == {"batch_expired"}


def test_gpu_worker_killed_mid_batch_resumes(redis_url, workers, tmp_path, tiny_model, expected):
    from plurai.broker_config.celery_app import app, configure

    fast_reclaim = {"PLURAI_RECLAIM_IDLE_MS": "2000", "PLURAI_RECLAIM_INTERVAL_S": "0.5"}
    workers.start(1, "--engine", f"max_model_len={CONTEXT}", env=fast_reclaim)
    configure(app, redis_url)
    c = Celery(redis_url, tmp_path, tiny_model)
    c.start()
    try:
        with Client(redis_url) as client:
            batch_id = submit_docs(client, tmp_path, documents(200), tiny_model)
            end = time.monotonic() + 120
            while manage.read(client, batch_id).completed < 20:
                assert time.monotonic() < end, "no progress before the kill"
                time.sleep(0.05)
            workers.procs[0].kill()
            workers.procs[0].wait()
            assert manage.read(client, batch_id).completed < 200
            workers.start(1, "--engine", f"max_model_len={CONTEXT}", env=fast_reclaim)
            wait_done(client, batch_id)
            check_docs(client, batch_id, expected)
    finally:
        c.stop()
