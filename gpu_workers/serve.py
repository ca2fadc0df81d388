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

from broker_config import logs
from broker_config.connection import connect, redact
from broker_config.settings import DEFAULT_METRICS_PORT, Settings
from gpu_workers.backend import Backend
from gpu_workers.worker import Worker

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
            raise SystemExit(
                f"plurai worker: cannot serve metrics on {settings.metrics_host}:{port} ({e}); "
                "choose another --metrics-port (0: any free port, -1: none)"
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


def make_backend(args: argparse.Namespace, settings: Settings) -> Backend:
    options = dict(args.engine)
    # The shared KV tier's Redis: the engine opens no connection of its own.
    kv_url = options.pop("kv_redis_url", None) or settings.kv_redis_url
    if getattr(args, "backend", "native") == "vllm":
        if options:
            raise SystemExit(
                "plurai worker: --engine sets native engine fields; give vLLM's as --vllm"
            )
        try:
            from gpu_workers.vllm_backend.backend import VllmBackend
        except ImportError as e:
            raise SystemExit(
                f"plurai worker: --backend vllm needs vLLM ({e}); `make vllm-install` makes an "
                "environment with it: .venv-vllm/bin/plurai worker --backend vllm ..."
            ) from e
        try:
            return VllmBackend(
                settings.model_dir,
                tensor_parallel=args.tp,
                pipeline_parallel=args.pp,
                options=dict(args.vllm),
                kv_redis_url=kv_url,
            )
        except ValueError as e:
            raise SystemExit(f"plurai worker: {e}") from e
    if args.vllm:
        raise SystemExit("plurai worker: --vllm options need --backend vllm")
    from gpu_workers.engine.config import EngineConfig
    from gpu_workers.engine.engine import Engine

    kv_redis = connect(kv_url, socket_timeout=2.0, socket_connect_timeout=2.0) if kv_url else None
    config = EngineConfig(
        model=settings.model_dir, tensor_parallel=args.tp, pipeline_parallel=args.pp, **options
    )
    return Engine(config, kv_redis=kv_redis)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="local Hugging Face model directory (PLURAI_MODEL_DIR)")
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
    if not settings.model_dir:
        raise SystemExit("plurai worker: give --model DIR (or set PLURAI_MODEL_DIR)")

    from broker_config.embedded import EmbeddedRedis, running_url

    engine = make_backend(args, settings)
    # The engine's long-lived objects (a Block per KV block, the model) would be scanned by
    # every full garbage collection: ~160 ms for 262k blocks, a stall in the middle of
    # serving. They live as long as the process, so take them out of the collector's view.
    gc.collect()
    gc.freeze()
    model_dir = Path(settings.model_dir)
    names = {model_dir.name, str(model_dir), str(model_dir.resolve()), engine.model_fingerprint}

    embedded = None
    url = settings.redis_url or running_url(Path(settings.data_dir))
    if url is None:
        embedded = EmbeddedRedis(Path(settings.data_dir) / "redis")
        url = embedded.start()
        log.info("started embedded redis-server at %s (data in %s)", redact(url), embedded.data_dir)
    try:
        worker = Worker(engine, connect(url), settings, model_names=names)
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
        engine.close()  # the group's other ranks, the KV tier's writer
        if embedded is not None:
            embedded.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
