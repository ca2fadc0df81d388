"""A worker's start, made visible: the model named by --model found (a local folder or a
hub id in huggingface_hub's cache) and checked before anything loads it, and a `starting`
heartbeat kept in Redis from the moment the worker reaches it until it serves, so that
`plurai status` and the metrics show a worker stuck in its start. A start that cannot
succeed ends the process with one line and an exit code of its own (StartError)."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from enum import IntEnum
from pathlib import Path
from typing import Any

import redis

from plurai.broker_config import keys
from plurai.broker_config.connection import redact
from plurai.gpu_workers.models.files import NATIVE, safetensors_problem, weight_files

log = logging.getLogger("plurai.worker")


class Exit(IntEnum):
    """`plurai worker`'s exit codes (docs/operations.md, "Starting workers")."""

    OK = 0
    ERROR = 1  # anything unforeseen: a Plurai bug
    USAGE = 2  # bad arguments or settings (argparse's code too)
    MODEL_MISSING = 3
    MODEL_DAMAGED = 4
    MODEL_UNSUPPORTED = 5
    REDIS_UNREACHABLE = 6
    REDIS_CONFIG = 7  # a Redis whose settings would lose results (e.g. an eviction policy)
    BACKEND_FAILED = 8  # the engine did not start (kernels, memory, vLLM)


class StartError(Exception):
    def __init__(self, code: Exit, message: str) -> None:
        super().__init__(message)
        self.code = code


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
# what a worker reads of a hub model: configs, tokenizers, safetensors (no .bin, no onnx)
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def resolve_model(name: str, revision: str | None = None) -> Path:
    """The local folder of `name`: a folder as given, else a hub id (`org/name`) fetched
    into (or, offline, found in) huggingface_hub's cache at `revision`."""
    path = Path(name).expanduser()
    if path.exists() or not HUB_ID.match(name):
        if revision:
            raise StartError(Exit.USAGE, f"--revision is for hub ids; {name!r} is a folder")
        if not path.exists():
            raise StartError(Exit.MODEL_MISSING, f"model folder {name} does not exist")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    log.info("model %s%s: looking in the hub cache", name, f"@{revision}" if revision else "")
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError:
        raise StartError(
            Exit.MODEL_MISSING,
            f"no folder {name}, and hub model {name}{'@' + revision if revision else ''} "
            f"is not in the hub cache ({os.environ.get('HF_HUB_CACHE') or '~/.cache/huggingface/hub'})"
            " and the hub cannot be reached; download it where a network is, or give a folder",
        ) from None
    except HFValidationError as e:
        raise StartError(Exit.USAGE, f"--model {name!r}: {e}") from None
    except Exception as e:  # the hub's answer: not found, gated, no such revision
        raise StartError(
            Exit.MODEL_MISSING, f"no folder {name}, and the hub says: {type(e).__name__}: {e}"
        ) from None


def check_model(path: Path, native: bool = True) -> None:
    """What can be told of a model folder before loading it: config.json readable (and, for
    the native engine, an architecture it runs), every safetensors file whole, a
    tokenizer. Raises StartError with the fix."""
    if not path.is_dir():
        raise StartError(Exit.MODEL_MISSING, f"model folder {path} is not a folder")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise StartError(Exit.MODEL_MISSING, f"{path} is not a model folder: no config.json")
    try:
        config = json.loads(config_file.read_bytes())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise StartError(Exit.MODEL_DAMAGED, f"{config_file} does not parse ({e})") from None
    if native:
        archs = config.get("architectures") or []
        arch = archs[0] if isinstance(archs, list) and archs else None
        if arch not in NATIVE:
            raise StartError(
                Exit.MODEL_UNSUPPORTED,
                f"{path}: architecture {arch!r} is not one the native engine runs "
                f"({', '.join(NATIVE)}); try --backend vllm",
            )
    try:
        files = weight_files(path)
    except FileNotFoundError as e:
        raise StartError(Exit.MODEL_MISSING, str(e)) from None
    except (OSError, ValueError) as e:
        raise StartError(Exit.MODEL_DAMAGED, str(e)) from None
    for f in files:
        if not f.is_file():
            raise StartError(Exit.MODEL_MISSING, f"{f} is missing (named by the weight index)")
        problem = safetensors_problem(f)
        if problem:
            raise StartError(Exit.MODEL_DAMAGED, f"{f}: {problem}; download it again")
    if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise StartError(
            Exit.MODEL_MISSING, f"{path} has no tokenizer (tokenizer.json or tokenizer.model)"
        )


def wait_for_redis(r: redis.Redis, url: str, wait_s: float) -> None:
    """Ping until Redis answers, saying so every few seconds; StartError after wait_s."""
    deadline = time.monotonic() + wait_s
    said = 0.0
    while True:
        try:
            r.ping()
            return
        except redis.AuthenticationError as e:
            raise StartError(Exit.REDIS_UNREACHABLE, f"Redis at {redact(url)}: {e}") from None
        except redis.RedisError as e:
            now = time.monotonic()
            if now >= deadline:
                raise StartError(
                    Exit.REDIS_UNREACHABLE,
                    f"Redis at {redact(url)} did not answer in {wait_s:.0f} s ({e}); "
                    "check the URL and that it runs (PLURAI_REDIS_WAIT_S sets the wait)",
                ) from None
            if now - said >= 5:
                log.warning("waiting for Redis at %s: %s", redact(url), e)
                said = now
            time.sleep(0.5)


class Starting:
    """The `starting` heartbeat: the worker's hash with state=starting and the stage it is
    in, renewed from a thread while the model loads (which may take minutes), so a worker
    stuck in its start shows as such, and one killed in it expires like any other."""

    def __init__(self, r: redis.Redis, worker_id: str, model: str, interval_s: float) -> None:
        self.r, self.id, self.model, self.interval_s = r, worker_id, model, interval_s
        self.stage = "connecting"
        self.since_ms = int(time.time() * 1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="starting-beat", daemon=True)

    def __enter__(self) -> Starting:
        self.beat()
        self._thread.start()
        return self

    def __exit__(self, failed: type[BaseException] | None, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        try:
            if failed is None:  # the serving heartbeat takes over the hash
                self.r.hdel(keys.worker(self.id), "stage", "starting_s")
            else:  # gone from `plurai status` now, not three beats later
                self.r.delete(keys.worker(self.id))
                self.r.srem(keys.WORKERS, self.id)
        except redis.RedisError:
            pass

    def enter(self, stage: str) -> None:
        log.info("start: %s", stage)
        self.stage = stage
        self.beat()

    def beat(self) -> None:
        now = int(time.time() * 1000)
        fields = {
            "state": "starting",
            "stage": self.stage,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "served_model": self.model,
            "beat_ms": now,
            "starting_s": round((now - self.since_ms) / 1000, 1),
        }
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.hset(keys.worker(self.id), mapping=fields)
            pipe.expire(keys.worker(self.id), max(1, int(3 * self.interval_s)))
            pipe.sadd(keys.WORKERS, self.id)
            pipe.execute()
        except redis.RedisError as e:  # the start goes on; the serving heartbeat retries
            log.warning("starting heartbeat not written: %s", e)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()
