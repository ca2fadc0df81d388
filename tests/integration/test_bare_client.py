"""`pip install plurai` is the client alone: installed into a fresh venv with no torch,
transformers, Celery or Starlette, it submits a job that a worker runs (this process's,
on the tiny model), reads the same result the full install reads, and each command that
needs an extra says which one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.engine import Engine
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from tests.helpers import driven_worker

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("torch", "transformers", "celery", "starlette", "uvicorn", "llguidance", "numpy")

SUBMIT = """
import json, sys
from plurai import Client
with Client(sys.argv[1]) as client:
    job = client.submit("bare client", max_tokens=6, temperature=0)
    r = job.result(timeout=120)
loaded = sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)
print(json.dumps({"text": r.text, "tokens": r.token_ids, "state": r.state, "loaded": loaded}))
"""


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv holding `pip install <this repository>` and nothing else: its python.
    Installed from a copy of the tracked files, as a fresh clone is: a checkout's own
    `build/` (left by an earlier install) would otherwise go into the wheel."""
    base = tmp_path_factory.mktemp("bare")
    venv, source = base / "venv", base / "source"
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, tracked):
        if (ROOT / name.decode()).is_file():
            (source / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name.decode(), source / name.decode())
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(source)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    yield python


def bare_env() -> dict[str, str]:
    # run outside the repository, so that only the installed packages can be imported
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def run_bare(bare: Path, code: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """`python -c code argv...` in the bare venv, outside the repository, to its end."""
    return subprocess.run(
        [str(bare), "-c", code, *argv],
        cwd=bare.parent,
        env=bare_env(),
        capture_output=True,
        text=True,
    )


def test_the_bare_client_has_no_engine_dependencies(bare: Path) -> None:
    check = "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m)])"
    out = run_bare(bare, check, *EXTRAS)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_everything_installs_under_one_top_level_name(bare: Path) -> None:
    """`pip install plurai` adds the package `plurai` (plurai.producer, ...) and no
    top-level `producer`, `results`, `cli`, ... that could clash with a user's own."""
    check = (
        "import importlib.util as u, sys, plurai.producer, plurai.results; "
        "print([m for m in sys.argv[1:] if u.find_spec(m)], plurai.producer.__file__)"
    )
    mine = ["producer", "results", "cli", "gateway", "broker_config", "gpu_workers", "kv_store"]
    out = run_bare(bare, check, *mine)
    assert out.returncode == 0, out.stderr
    found, where = out.stdout.strip().split(" ", 1)
    assert found == "[]" and "site-packages/plurai/producer" in where, out.stdout


def test_started_in_a_checkout_it_finds_the_installed_packages(bare: Path) -> None:
    """A container's WORKDIR or a clone holds plurai/ with only its __init__.py, first on
    sys.path: the packages are still found, installed."""
    source = bare.parents[2] / "source"
    assert (source / "plurai" / "__init__.py").is_file()
    code = "import plurai, plurai.producer.client as c; print(plurai.Client is c.Client)"
    out = subprocess.run(
        [str(bare), "-c", code], cwd=source, env=bare_env(), capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


def test_the_bare_client_submits_a_job_a_worker_runs(bare: Path, redis_url, tiny_model) -> None:
    engine = Engine(
        EngineConfig(model=str(tiny_model), kv_cache_bytes=8 << 20, threads=1, dtype="fp32")
    )
    worker = driven_worker(redis_url, engine)
    proc = subprocess.Popen(
        [str(bare), "-c", SUBMIT, redis_url, json.dumps(EXTRAS)],
        cwd=bare.parent,
        env=bare_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while proc.poll() is None:
            worker.iterate()
        worker.writer.settle()
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
        worker.cancels.close()
    assert proc.returncode == 0, err
    got = json.loads(out)
    assert got["loaded"] == [] and got["state"] == "completed"
    # exactly what the engine gives the same prompt offline
    want = engine.generate(["bare client"], SamplingParams(max_tokens=6, temperature=0))[0]
    engine.close()
    assert got["tokens"] == want.token_ids
    assert got["text"] == want.text


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["worker", "--model", "m"], "worker"),
        (["make-model", "--help"], "worker"),
        (["gateway", "--url", "redis://127.0.0.1:1"], "gateway"),
        (["batch", "submit", "lines.jsonl", "--url", "redis://127.0.0.1:1"], "bulk"),
    ],
)
def test_a_command_that_needs_an_extra_names_it(bare: Path, argv: list[str], extra: str) -> None:
    plurai = bare.parent / "plurai"
    (bare.parent / "lines.jsonl").write_text('{"custom_id": "a", "prompt": "hi"}\n')
    out = subprocess.run(
        [str(plurai), *argv], cwd=bare.parent, env=bare_env(), capture_output=True, text=True
    )
    assert out.returncode == 2, out.stderr
    assert f"pip install 'plurai[{extra}]'" in out.stderr
    assert "Traceback" not in out.stderr
