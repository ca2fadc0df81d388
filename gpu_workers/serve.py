"""The `plurai worker` entry: arguments, settings, the engine, Redis (embedded when no URL is
given), the metrics endpoint and signals, around one Worker.

    plurai worker --model models/tiny-llama [--url redis://...]
    plurai worker --backend vllm --model DIR [--tp N --pp M] [--vllm KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
from pathlib import Path
from typing import Any

from plurai.broker_config import locks, logs, memory, tracing
from plurai.broker_config.connection import connect, redact
from plurai.broker_config.settings import DEFAULT_METRICS_PORT, Settings
from plurai.gpu_workers.backend import Backend
from plurai.gpu_workers.startup import (
    Exit,
    StartError,
    Starting,
    check_model,
    resolve_model,
    wait_for_redis,
)
from plurai.gpu_workers.worker import Worker, new_worker_id

log = logging.getLogger("plurai.worker")


def serve_metrics(worker: Worker, url: str, settings: Settings) -> int:
    """Start the worker's /metrics endpoint; returns its port (0: none was asked for)."""
    port = settings.metrics_port
    if port < 0:
        return 0
    # Its own connection with short timeouts: a scrape must not hang on a slow Redis.
    worker.metrics.watch_queue(
        connect(url, socket_timeout=2, socket_connect_timeout=2),
        worker.lanes,
        settings.default_model,
    )
    try:
        bound = worker.metrics.serve(port, settings.metrics_host)
    except OSError as e:
        if "metrics_port" in settings.model_fields_set:
            raise StartError(
                Exit.USAGE,
                f"cannot serve metrics on {settings.metrics_host}:{port} ({e}); "
                "choose another --metrics-port (0: any free port, -1: none)",
            ) from e
        bound = worker.metrics.serve(0, settings.metrics_host)
        log.warning("metrics port %d is taken (another worker?); serving on %d", port, bound)
    log.info("metrics on http://%s:%d/metrics", settings.metrics_host, bound)
    return bound


def _engine_option(text: str) -> tuple[str, Any]:
    name, _, value = text.partition("=")
    if not name or not _:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


SPEC_FIELDS = ("speculative", "num_speculative_tokens", "ngram_min", "ngram_max")


def _vllm_speculative(options: dict[str, Any]) -> dict[str, Any] | None:
    """The native engine's speculative-decoding choice (taken out of `options`) as vLLM's
    speculative_config: prompt lookup is vLLM's "ngram" method, a draft model its
    "draft_model". None: off."""
    from plurai.gpu_workers.engine.config import EngineConfig

    given = {k: options.pop(k) for k in SPEC_FIELDS if k in options}
    if given.get("speculative", "off") == "off":
        return None
    try:  # the native engine's checks and defaults
        c = EngineConfig(model="", **given)
    except (TypeError, ValueError) as e:
        raise StartError(Exit.USAGE, str(e)) from e
    if c.draft_model:
        return {
            "method": "draft_model",
            "model": c.draft_model,
            "num_speculative_tokens": c.num_speculative_tokens,
        }
    return {
        "method": "ngram",
        "num_speculative_tokens": c.num_speculative_tokens,
        "prompt_lookup_min": c.ngram_min,
        "prompt_lookup_max": c.ngram_max,
    }


def make_backend(args: argparse.Namespace, settings: Settings) -> Backend:
    options = dict(args.engine)
    # The shared KV tier's Redis: the engine opens no connection of its own.
    kv_url = options.pop("kv_redis_url", None) or settings.kv_redis_url
    if getattr(args, "backend", "native") == "vllm":
        vllm_options = dict(args.vllm)
        spec = _vllm_speculative(options)
        if options:
            raise StartError(
                Exit.USAGE,
                "--engine sets native engine fields (and speculative decoding's, which vLLM "
                f"takes too); give vLLM's as --vllm, not {sorted(options)}",
            )
        if spec is not None:
            vllm_options.setdefault("speculative_config", spec)
        try:
            from plurai.gpu_workers.vllm_backend.backend import VllmBackend
            from plurai.gpu_workers.vllm_backend.cpu_support import Unsupported
        except ImportError as e:
            raise StartError(
                Exit.BACKEND_FAILED,
                f"--backend vllm needs vLLM ({e}); `make vllm-install` makes an "
                "environment with it: .venv-vllm/bin/plurai worker --backend vllm ...",
            ) from e
        try:
            return VllmBackend(
                settings.model_dir,
                tensor_parallel=args.tp,
                pipeline_parallel=args.pp,
                options=vllm_options,
                kv_redis_url=kv_url,
            )
        except Unsupported as e:
            raise StartError(Exit.MODEL_UNSUPPORTED, str(e)) from e
        except ValueError as e:
            raise StartError(Exit.USAGE, str(e)) from e
    if args.vllm:
        raise StartError(Exit.USAGE, "--vllm options need --backend vllm")
    from plurai.gpu_workers.engine.config import EngineConfig
    from plurai.gpu_workers.engine.engine import Engine

    kv_redis = connect(kv_url, socket_timeout=2.0, socket_connect_timeout=2.0) if kv_url else None
    config = EngineConfig(
        model=settings.model_dir, tensor_parallel=args.tp, pipeline_parallel=args.pp, **options
    )
    return Engine(config, kv_redis=kv_redis)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="a local Hugging Face model folder, or a hub id org/name found in (or, where a "
        "network allows, fetched into) huggingface_hub's cache (PLURAI_MODEL_DIR)",
    )
    p.add_argument("--revision", help="the hub revision (branch, tag, commit) of a hub id")
    p.add_argument(
        "--served-model",
        help="the model name clients ask for; this worker reads its queue "
        "(PLURAI_SERVED_MODEL; default PLURAI_DEFAULT_MODEL, 'default')",
    )
    p.add_argument(
        "--shards", type=int, help="request streams per lane of the served model (PLURAI_SHARDS)"
    )
    p.add_argument("--url", help="Redis URL (PLURAI_REDIS_URL); none: an embedded redis-server")
    p.add_argument("--worker-id", help="consumer name; default host-pid-random")
    p.add_argument("--grace", type=float, help="seconds to finish running jobs on SIGTERM")
    p.add_argument(
        "--backend",
        choices=("native", "vllm"),
        default="native",
        help="the engine: native (default) or vllm (installed by `make vllm-install`)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes) per stage")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (processes)")
    p.add_argument(
        "--engine",
        type=_engine_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a native EngineConfig field, e.g. --engine num_kv_blocks=256 (repeatable)",
    )
    p.add_argument(
        "--vllm",
        type=_engine_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a vLLM EngineArgs field, e.g. --vllm gpu_memory_utilization=0.9 (repeatable)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help=f"Prometheus /metrics port (PLURAI_METRICS_PORT, default {DEFAULT_METRICS_PORT}; "
        "0: any free port; -1: none)",
    )
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR (PLURAI_LOG_LEVEL)")
    p.add_argument(
        "--log-format", choices=logs.FORMATS, help="text or json lines (PLURAI_LOG_FORMAT)"
    )


def main(argv: list[str] | argparse.Namespace | None = None) -> int:
    if isinstance(argv, argparse.Namespace):
        args = argv
    else:
        p = argparse.ArgumentParser(prog="plurai worker", description=__doc__.split("\n\n")[0])
        add_arguments(p)
        args = p.parse_args(argv)
    overrides: dict[str, Any] = {}
    for name in ("log_level", "log_format", "metrics_port", "served_model", "shards"):
        if getattr(args, name, None) is not None:
            overrides[name] = getattr(args, name)
    if args.url:
        overrides["redis_url"] = args.url
    if args.grace is not None:
        overrides["grace_period_s"] = args.grace
    if args.worker_id:
        overrides["worker_id"] = args.worker_id
    if args.model:
        overrides["model_dir"] = args.model
    settings = Settings(**overrides)
    logs.setup(settings.log_level, settings.log_format)
    tracing.setup("plurai-worker")  # only where OTEL_* variables ask for traces
    try:
        return serve(args, settings)
    except StartError as e:  # one line, and the code that says which start failed
        log.error("plurai worker: %s", e)
        return int(e.code)
    finally:
        tracing.shutdown()  # the spans not exported yet


def serve(args: argparse.Namespace, settings: Settings) -> int:
    """The start, stage by stage (each logged, and from Redis on in the `starting`
    heartbeat), then the worker's loop until it stops."""
    if not settings.model_dir:
        raise StartError(Exit.USAGE, "give --model (a folder or a hub id), or set PLURAI_MODEL_DIR")
    native = getattr(args, "backend", "native") != "vllm"
    asked = settings.model_dir
    log.info("start: checking model %s", asked)
    model_dir = resolve_model(asked, getattr(args, "revision", None))
    check_model(model_dir, native=native)
    settings = settings.model_copy(update={"model_dir": str(model_dir)})

    from plurai.broker_config.embedded import EmbeddedRedis, running_url

    embedded = None
    url = settings.redis_url
    if url is None:  # one embedded server per data folder, for workers started together
        data = Path(settings.data_dir)
        with locks.held(data / ".redis.lock", timeout_s=60, what="the embedded redis-server"):
            url = running_url(data)
            if url is None:
                embedded = EmbeddedRedis(data / "redis")
                url = embedded.start()
                log.info("started embedded redis-server at %s (data in %s)", redact(url), data)
    engine: Backend | None = None
    try:
        log.info("start: connecting to Redis at %s", redact(url))
        r = connect(url)
        wait_for_redis(r, url, settings.redis_wait_s)
        try:
            memory.check_policy(r)  # before the model loads: an evicting Redis loses results
        except memory.EvictingRedis as e:
            raise StartError(Exit.REDIS_CONFIG, str(e)) from None
        worker_id = settings.worker_id or new_worker_id()
        with Starting(r, worker_id, settings.model, settings.heartbeat_interval_s) as starting:
            starting.enter(f"loading model ({'native' if native else 'vllm'} backend)")
            try:
                engine = make_backend(args, settings)
            except StartError:
                raise
            except Exception as e:
                raise StartError(
                    Exit.BACKEND_FAILED, f"the engine did not start: {type(e).__name__}: {e}"
                ) from e
            # The engine's long-lived objects (a Block per KV block, the model) would be
            # scanned by every full garbage collection: ~160 ms for 262k blocks, a stall in
            # the middle of serving. They live as long as the process, so take them out of
            # the collector's view.
            gc.collect()
            gc.freeze()
            names = {model_dir.name, str(model_dir), str(model_dir.resolve())}
            names |= {asked, engine.model_fingerprint}
            starting.enter("joining the queue")
            worker = Worker(engine, r, settings, worker_id=worker_id, model_names=names)
            worker.metrics_port = serve_metrics(worker, url, settings)

        def on_signal(signum: int, _frame: Any) -> None:
            if worker.stopping and signum == signal.SIGINT:
                worker.request_stop(0.0)
            else:
                worker.request_stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        worker.run()
    finally:
        if engine is not None:
            engine.close()  # the group's other ranks, the KV tier's writer
        if embedded is not None:
            embedded.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
