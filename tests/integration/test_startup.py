"""A worker's start: a model that is missing, damaged or unsupported, or a Redis that does
not answer, ends the process within seconds with one line and its own exit code; a start
that takes time shows as a `starting` heartbeat; --model takes a hub id found in
huggingface_hub's cache (laid out here; no network)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plurai.broker_config import keys
from plurai.broker_config.connection import connect
from plurai.broker_config.embedded import free_port
from plurai.broker_config.stats import snapshot
from plurai.gpu_workers.startup import Exit
from plurai.producer.client import Client

from .conftest import ENGINE_ARGS, ROOT


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "plurai.cli", "worker", "--metrics-port", "-1", *ENGINE_ARGS, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PLURAI_HEARTBEAT_INTERVAL_S": "1", **(env or {})},
    )


def refused(*args: str, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """The exit code and the error lines of a start that must fail within 10 s."""
    p = start(*args, env=env)
    out, _ = p.communicate(timeout=10)
    assert "Traceback" not in out, out
    return p.returncode, [line for line in out.splitlines() if " ERROR " in line]


@pytest.fixture(scope="module")
def no_redis() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there


def copy_model(tiny_model: Path, to: Path) -> Path:
    shutil.copytree(tiny_model, to, ignore=shutil.ignore_patterns(".plurai-*"))
    return to


@pytest.mark.parametrize(
    ("damage", "code", "says"),
    [
        ("gone", Exit.MODEL_MISSING, "does not exist"),
        ("no config", Exit.MODEL_MISSING, "no config.json"),
        ("no weights", Exit.MODEL_MISSING, "no safetensors weights"),
        ("truncated", Exit.MODEL_DAMAGED, "truncated; download it again"),
        ("config not json", Exit.MODEL_DAMAGED, "config.json does not parse"),
        ("header not json", Exit.MODEL_DAMAGED, "header does not parse"),
        ("architecture", Exit.MODEL_UNSUPPORTED, "'GPT2LMHeadModel' is not one the native"),
        ("no tokenizer", Exit.MODEL_MISSING, "has no tokenizer"),
    ],
)
def test_a_bad_model_ends_the_start_with_one_line_and_its_code(
    tiny_model, tmp_path, no_redis, damage, code, says
):
    model = copy_model(tiny_model, tmp_path / "m")
    weights = model / "model.safetensors"
    if damage == "gone":
        shutil.rmtree(model)
    elif damage == "no config":
        (model / "config.json").unlink()
    elif damage == "no weights":
        weights.unlink()
    elif damage == "truncated":  # a download cut short
        os.truncate(weights, weights.stat().st_size - 4096)
    elif damage == "config not json":
        (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"')
    elif damage == "header not json":
        data = bytearray(weights.read_bytes())
        data[8:16] = b"\xff" * 8
        weights.write_bytes(bytes(data))
    elif damage == "architecture":
        config = json.loads((model / "config.json").read_text())
        config["architectures"] = ["GPT2LMHeadModel"]
        (model / "config.json").write_text(json.dumps(config))
    elif damage == "no tokenizer":
        (model / "tokenizer.json").unlink()
    # Redis is not reached: the model is checked first, so a bad one fails at once
    rc, errors = refused("--model", str(model), "--url", no_redis)
    assert rc == code, errors
    assert len(errors) == 1 and says in errors[0], errors


def test_redis_that_does_not_answer_is_waited_for_visibly_then_ends_the_start(tiny_model, no_redis):
    rc, errors = refused(
        "--model", str(tiny_model), "--url", no_redis, env={"PLURAI_REDIS_WAIT_S": "6"}
    )
    assert rc == Exit.REDIS_UNREACHABLE
    assert len(errors) == 1 and "did not answer in 6 s" in errors[0], errors


def test_a_start_shows_as_starting_until_the_worker_serves(tiny_model, redis_url):
    r = connect(redis_url)
    p = start("--model", str(tiny_model), "--url", redis_url)
    seen: list[tuple[str, str]] = []
    try:
        deadline = time.monotonic() + 120
        while not seen or seen[-1][0] != "serving":
            assert time.monotonic() < deadline, f"no serving heartbeat; saw {seen}"
            assert p.poll() is None, p.communicate()[0]
            for w in snapshot(r, ["standard"]).workers:
                if not seen or seen[-1] != (w.state, w.stage):
                    seen.append((w.state, w.stage))
            time.sleep(0.02)
        # every state before `serving` is `starting` (its first stage, `connecting`, lasts
        # a moment: a loaded machine's poll may or may not see it), loading the model among them
        assert all(state == "starting" for state, _ in seen[:-1]), seen
        assert any(stage.startswith("loading model") for _, stage in seen[:-1]), seen
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=60)
    for stage in ("checking model", "connecting to Redis", "loading model", "joining the queue"):
        assert f"start: {stage}" in out, out


def test_a_worker_killed_in_its_start_leaves_no_starting_entry_for_long(tiny_model, redis_url):
    r = connect(redis_url)
    p = start("--model", str(tiny_model), "--url", redis_url)
    try:
        deadline = time.monotonic() + 60
        while not r.scard(keys.WORKERS):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        p.kill()
        p.wait()
        time.sleep(3.5)  # three beats of 1 s
        assert not snapshot(r, ["standard"]).workers
    finally:
        p.kill()
        p.communicate()


def lay_out_hub_cache(cache: Path, repo: str, model: Path, commit: str) -> None:
    """What huggingface_hub writes for a downloaded model: blobs, a snapshot folder of
    links to them, and a ref naming the snapshot."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "blobs").mkdir()
    for f in model.iterdir():
        if f.is_file() and not f.name.startswith("."):
            blob = root / "blobs" / f"{f.name}.blob"
            shutil.copy(f, blob)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)


def test_a_hub_id_is_served_from_the_hub_cache_offline(tiny_model, tmp_path, redis_url):
    cache = tmp_path / "hub"
    lay_out_hub_cache(cache, "acme/tiny-llama", tiny_model, "a" * 40)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    p = start("--model", "acme/tiny-llama", "--url", redis_url, env=env)
    try:
        with Client(redis_url) as client:
            job = client.submit("hub", max_tokens=4, ignore_eos=True)
            assert job.result(timeout=120).output_tokens == 4
            (worker,) = snapshot(client.redis, ["standard"]).workers
            assert "acme/tiny-llama" in worker.model.split(","), worker.model
    finally:
        p.terminate()
        p.communicate(timeout=60)
    # a revision the cache does not hold, and an id it does not hold: one line, code 3
    rc, errors = refused("--model", "acme/tiny-llama", "--revision", "v9", env=env)
    assert (
        rc == Exit.MODEL_MISSING
        and "hub model acme/tiny-llama@v9 is not in the hub cache" in errors[0]
    )
    rc, errors = refused("--model", "acme/other", env=env)
    assert rc == Exit.MODEL_MISSING and len(errors) == 1, errors
