"""The processes of bench/fleet_sim.py: worker processes (threads of real `Worker`s on
`SimBackend`s) and the producer (a closed loop of `submit_many` / `wait_all`). Each runs
in a spawned process and puts one JSON line of its figures on a queue.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import traceback
from collections import deque
from typing import Any

from bench.sim_backend import WORDS, SimBackend
from plurai.broker_config.connection import connect
from plurai.broker_config.settings import Settings

LANES = (("interactive", 0.2), ("standard", 0.5), ("batch", 0.3))


def worker_proc(cfg: dict[str, Any], stop: Any, out: Any) -> None:
    """Run cfg['ids'] workers as threads until `stop`; put a JSON line of their figures."""
    logging.basicConfig(level=logging.WARNING)
    from plurai.gpu_workers.worker import Worker

    workers: list[tuple[Worker, SimBackend]] = []
    for wid, model in cfg["ids"]:
        overrides: dict[str, Any] = {"redis_url": cfg["url"]}
        if model:
            overrides["served_model"] = model
        if cfg["shards"] > 1:
            overrides["shards"] = cfg["shards"]
        backend = SimBackend(
            max_num_seqs=cfg["max_num_seqs"],
            kv_tokens=cfg["kv_tokens"],
            max_model_len=cfg["max_model_len"],
            step_base_ms=cfg["step_base_ms"],
            step_per_seq_ms=cfg["step_per_seq_ms"],
            model_fingerprint=f"sim-{model or 'default'}",
        )
        names = {model} if model else {"sim"}
        w = Worker(backend, connect(cfg["url"]), Settings(**overrides), wid, model_names=names)
        workers.append((w, backend))
    errors: list[str] = []

    def run(w: Worker) -> None:
        try:
            w.run()
        except BaseException:
            errors.append(f"{w.id}: {traceback.format_exc(limit=6)}")

    threads = [threading.Thread(target=run, args=(w,), daemon=True) for w, _ in workers]
    for t in threads:
        t.start()
    stop.wait()
    for w, _ in workers:
        w.request_stop(cfg["grace_s"])
    for t in threads:
        t.join(cfg["grace_s"] + 10)
    per_second: dict[int, list[float]] = {}
    for _, b in workers:
        for sec, v in b.per_second.items():
            acc = per_second.setdefault(sec, [0, 0, 0.0])
            for i in range(3):
                acc[i] += v[i]
    result = {
        "jobs_done": sum(w.publisher.jobs_done for w, _ in workers),
        "alive": sum(t.is_alive() for t in threads),
        "errors": errors,
        "per_second": {str(k): v for k, v in per_second.items()},
    }
    out.put(json.dumps(result))


# -- the producer: a closed loop of submit_many / wait_all ----------------------------


def producer_proc(cfg: dict[str, Any], out: Any) -> None:
    """Threads that each keep `depth` batches of `batch` jobs in flight (submit_many, then
    wait_all on the oldest) until cfg['end'], then wait for the rest; puts one JSON line:
    per job [created_ms, started_ms, finished_ms, ok, lane index], and counts."""
    logging.basicConfig(level=logging.WARNING)
    from plurai.producer.client import Client

    rows: list[list[int]] = []
    lanes = [n for n, _ in LANES]
    counts = {"submitted": 0, "final": 0, "ok": 0}
    errors: list[str] = []
    lock = threading.Lock()

    def one(seed: int) -> None:
        rng = random.Random(seed)
        client = Client(cfg["url"])
        want: dict[str, tuple[int, str]] = {}  # job id: max_tokens, model
        inflight: deque[list[str]] = deque()

        def submit() -> None:
            reqs = []
            for _ in range(cfg["batch"]):
                req: dict[str, Any] = {
                    "prompt": " ".join(rng.choices(WORDS, k=rng.randint(4, 64))),
                    "max_tokens": rng.randint(*cfg["max_tokens"]),
                    "temperature": 0.0,
                    "lane": rng.choices([n for n, _ in LANES], [w for _, w in LANES])[0],
                }
                if cfg["models"]:
                    req["model"] = rng.choice(cfg["models"])
                reqs.append(req)
            jobs = client.submit_many(reqs)
            for j, r in zip(jobs, reqs, strict=True):
                want[j.id] = (r["max_tokens"], r.get("model", "default"))
            inflight.append([j.id for j in jobs])

        def settle() -> None:
            ids = inflight.popleft()
            recs = client.wait_all(ids, timeout=cfg["wait_s"])
            got = []
            for rec in recs:
                max_tokens, model = want.pop(rec.id)
                ok = (
                    rec.final
                    and rec.state == "completed"
                    and rec.finish_reason == "length"
                    and rec.output_tokens == max_tokens
                    and (rec.worker or "").endswith("-" + model)  # a worker of its model
                )
                lane = lanes.index(rec.lane) if rec.lane in lanes else -1
                got.append(
                    [rec.created_ms or 0, rec.started_ms or 0, rec.finished_ms or 0, ok, lane]
                )
            with lock:
                rows.extend(got)
                counts["submitted"] += len(ids)
                counts["final"] += sum(r.final for r in recs)
                counts["ok"] += sum(int(g[3]) for g in got)

        try:
            while time.time() < cfg["end"]:
                while len(inflight) < cfg["depth"]:
                    submit()
                settle()
            while inflight:
                settle()
        except BaseException:
            errors.append(traceback.format_exc(limit=6))
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(cfg["seed"] + i,)) for i in range(cfg["threads"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(json.dumps({**counts, "errors": errors, "rows": rows}))
