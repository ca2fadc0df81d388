"""Bulk batches: documents/s and tokens/s of a corpus through the batch pipeline (Celery
worker + one GPU worker + Redis), beside the same map-reduce plan run offline through
Engine.generate, level by level, in this process.

    python bench/bulk.py [--model DIR] [--docs 300] [--max-tokens 32] [--context 256] [--smoke]

Without --model a tiny random-weight model is made in a temporary folder. A third of the
documents are longer than the context, so they are split and reduced. The last line is one
JSON object of measured figures and the ratio pipeline / offline (target >= 0.9).
--smoke: six documents (one split), four tokens each, on the smoke runs' tiny model: a
check that the bench runs, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.workload import add_smoke_arg, json_line, smoke_model  # noqa: E402
from plurai.broker_config.celery_app import app, configure  # noqa: E402
from plurai.broker_config.embedded import EmbeddedRedis  # noqa: E402
from plurai.broker_config.settings import BulkSettings  # noqa: E402
from plurai.broker_config.stats import serving_workers  # noqa: E402
from plurai.producer.bulk import manage, plan, store  # noqa: E402
from plurai.producer.client import Client  # noqa: E402

WORDS = "the a river stone light north quiet letter garden winter paper machine city old".split()


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    sizes = [rng.randint(120, 500) if rng.random() < 0.33 else rng.randint(5, 80) for _ in range(n)]
    return [" ".join(rng.choice(WORDS) for _ in range(k)) for k in sizes]


def engine_args(a: argparse.Namespace) -> dict:
    return {"max_model_len": a.context, "threads": a.threads, "dtype": a.dtype}


def offline(a: argparse.Namespace, task: plan.Task, docs: list[str]) -> dict:
    from plurai.gpu_workers.engine.config import EngineConfig
    from plurai.gpu_workers.engine.engine import Engine
    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=a.model, **engine_args(a)))
    params = SamplingParams(max_tokens=task.max_tokens, temperature=0.0)
    engine.generate(["warm up the engine"], params)
    tokens = 0

    def generate(prompts: list[str], sampling: dict) -> list[str]:
        nonlocal tokens
        out = engine.generate(prompts, SamplingParams(**sampling))
        tokens += sum(len(c.token_ids) for c in out)
        return [c.text for c in out]

    t = time.perf_counter()
    texts = plan.run_offline(task, docs, engine.tokenizer, a.context, generate)
    dt = time.perf_counter() - t
    engine.close()
    gc.collect()
    return {"seconds": dt, "tokens": tokens, "texts": texts}


def pipeline(a: argparse.Namespace, url: str, task: plan.Task, docs: list[str], tmp: Path) -> dict:
    # the Celery worker splits documents with PLURAI_MODEL_DIR's tokenizer: without it every
    # document fails with model_unavailable
    env = {
        **os.environ,
        "PLURAI_REDIS_URL": url,
        "PLURAI_MODEL_DIR": a.model,
        "PLURAI_HEARTBEAT_INTERVAL_S": "1",
    }
    gpu_cmd = [sys.executable, "-m", "plurai.cli", "worker", "--model", a.model, "--url", url]
    gpu_cmd += ["--log-level", "WARNING"]
    for k, v in engine_args(a).items():
        gpu_cmd += ["--engine", f"{k}={v}"]
    celery_cmd = [sys.executable, "-m", "celery", "-A", "plurai.broker_config.celery_app", "worker"]
    celery_cmd += ["--pool", "solo", "-c", "1", "--loglevel", "WARNING", "-n", "bench@127.0.0.1"]
    procs = [
        subprocess.Popen(gpu_cmd, cwd=ROOT, env=env),
        subprocess.Popen(celery_cmd, cwd=ROOT, env=env),
    ]
    try:
        client = Client(url)
        while not serving_workers(client.redis):
            if procs[0].poll() is not None:
                raise SystemExit("GPU worker exited")
            time.sleep(0.1)
        client.submit("warm up the engine", max_tokens=8).result(timeout=120)
        # warm-up batch: the Celery worker loads the tokenizer once
        (tmp / "warm.jsonl").write_text(json.dumps({"id": "w", "text": "warm up"}) + "\n")
        bulk = BulkSettings()
        warm = manage.create(
            client, bulk, tmp / "warm.jsonl", task=task, model_dir=a.model, max_model_len=a.context
        )
        while manage.info(client, warm)["status"] not in store.TERMINAL:
            time.sleep(0.05)
        cpu0 = {
            name: _cpu_s(p.pid) for name, p in zip(("gpu_worker", "celery"), procs, strict=True)
        }
        path = tmp / "docs.jsonl"
        path.write_text(
            "".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(docs))
        )
        t = time.perf_counter()
        batch_id = manage.create(
            client, bulk, path, task=task, model_dir=a.model, max_model_len=a.context
        )
        while manage.info(client, batch_id)["status"] not in store.TERMINAL:
            time.sleep(0.05)
        dt = time.perf_counter() - t
        info = manage.info(client, batch_id)
        cpu = {
            name: round(_cpu_s(p.pid) - cpu0[name], 2)
            for name, p in zip(("gpu_worker", "celery"), procs, strict=True)
        }
        out, err = manage.results(client, batch_id)
        texts = [json.loads(x)["response"]["body"]["choices"][0]["text"] for x in out.splitlines()]
        return {
            "seconds": dt,
            "tokens": info["usage"]["completion_tokens"],
            "texts": texts,
            "status": info["status"],
            "errors": err.count("\n"),
            "first_error": err.partition("\n")[0][:500],
            "cpu_s": cpu,
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--docs", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="fp32")
    add_smoke_arg(p)
    a = p.parse_args()
    if a.smoke:
        a.docs, a.max_tokens, a.context = 6, 4, 128
        a.model = a.model or str(smoke_model())
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if not a.model:
            from plurai.gpu_workers.models.factory import make_model

            a.model = str(make_model(tmp / "tiny-llama", family="llama", size="tiny"))
        a.model = str(Path(a.model).resolve())  # the subprocesses run from the repository root
        task = plan.Task("summarize", max_tokens=a.max_tokens)
        docs = corpus(a.docs)
        off = offline(a, task, docs)
        with EmbeddedRedis(tmp / "redis") as url:
            configure(app, url)
            pipe = pipeline(a, url, task, docs, tmp)
    n = len(docs)
    if pipe["errors"] or len(pipe["texts"]) != n:  # a ratio of failed documents means nothing
        raise SystemExit(
            f"the pipeline gave {len(pipe['texts'])} of {n} documents ({pipe['status']}); "
            f"first error line: {pipe['first_error'] or '-'}"
        )
    same = sum(x == y for x, y in zip(off["texts"], pipe["texts"], strict=False))
    rows = [("offline Engine.generate", off), ("batch pipeline", pipe)]
    for name, r in rows:
        print(
            f"{name:24s} {n / r['seconds']:8.2f} docs/s {r['tokens'] / r['seconds']:9.1f} tokens/s"
            f"  ({r['tokens']} tokens in {r['seconds']:.2f}s)"
        )
    ratio = (pipe["tokens"] / pipe["seconds"]) / (off["tokens"] / off["seconds"])
    print(f"pipeline / offline tokens/s: {ratio:.2f}x (target >= 0.9); {same}/{n} outputs equal")
    json_line(
        {
            "docs": n,
            "max_tokens": a.max_tokens,
            "context": a.context,
            "offline_docs_per_s": round(n / off["seconds"], 2),
            "offline_tokens_per_s": round(off["tokens"] / off["seconds"], 1),
            "pipeline_docs_per_s": round(n / pipe["seconds"], 2),
            "pipeline_tokens_per_s": round(pipe["tokens"] / pipe["seconds"], 1),
            "ratio_tokens_per_s": round(ratio, 3),
            "outputs_equal": same,
            "pipeline_status": pipe["status"],
            "pipeline_errors": pipe["errors"],
            "pipeline_cpu_s": pipe["cpu_s"],
        },
        a.smoke,
    )


if __name__ == "__main__":
    main()
