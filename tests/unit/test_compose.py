"""docker-compose.yml: it parses, every Plurai service runs a real entry point of the
package, every PLURAI_* variable it sets is a real setting, every service restarts, the
default stack runs on a machine without a GPU while the `gpu` profile gives each worker a
device of its own, and the bulk driver serves the workers' model."""

from __future__ import annotations

import importlib
import re
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml

from plurai.broker_config.settings import BulkSettings, Settings

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def services() -> dict:
    return compose()["services"]


def image_entrypoint() -> list[str]:
    line = next(
        x for x in (ROOT / "Dockerfile").read_text().splitlines() if x.startswith("ENTRYPOINT")
    )
    return yaml.safe_load(line.removeprefix("ENTRYPOINT").strip())


def argv(service: dict) -> list[str]:
    entry = service.get("entrypoint") or image_entrypoint()
    command = service.get("command") or []
    if isinstance(command, str):
        command = shlex.split(command)
    # compose variables with defaults, as docker compose would fill them with no .env
    return [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in [*entry, *command]]


WORKERS = ("worker", "worker-gpu0", "worker-gpu1")


def test_every_plurai_service_runs_a_real_entry_point():
    ours = {n: s for n, s in services().items() if s.get("image") == "plurai" or "build" in s}
    assert set(ours) == {*WORKERS, "gateway", "celery-worker", "celery-beat", "webhooks"}
    flag = {**dict.fromkeys(WORKERS, "--model"), "gateway": "--port", "webhooks": "--url"}
    for name, service in ours.items():
        args = argv(service)
        if args[0] == "plurai":
            (script,) = entry_points(group="console_scripts", name="plurai")
            assert script.value == "plurai.cli.main:main"
            # the same arguments, asking for help: exits 0 only for a real subcommand
            run = subprocess.run(
                [sys.executable, "-m", "plurai.cli", *args[1:2], "--help"],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            assert run.returncode == 0 and flag[name] in run.stdout, (name, run.stderr[-500:])
        else:
            assert args[:2] == ["celery", "-A"], name
            app = importlib.import_module(args[2]).app
            assert app.conf.accept_content == ["json"], name
            assert args[3] in ("worker", "beat"), name


def test_environment_names_real_settings():
    known = {f"PLURAI_{f.upper()}" for f in Settings.model_fields}
    known |= {f"PLURAI_BATCH_{f.upper()}" for f in BulkSettings.model_fields}
    for name, service in services().items():
        for var in service.get("environment") or {}:
            if var.startswith("PLURAI_"):
                assert var in known, f"{name}: {var} is no Plurai setting"
    redis = services()["redis"]["command"]
    assert "--appendonly" in redis and redis[redis.index("--appendonly") + 1] == "yes"


def test_prometheus_scrapes_every_worker_on_its_metrics_port():
    worker = services()["worker"]
    port = int(worker["environment"]["PLURAI_METRICS_PORT"])
    assert str(port) in worker["expose"]
    prom = services()["prometheus"]
    (mount,) = prom["volumes"]
    folder, inside = mount.removesuffix(":ro").split(":")
    (flag,) = [a for a in prom["command"] if a.startswith("--config.file=")]
    config = ROOT / folder / Path(flag.split("=", 1)[1]).relative_to(inside)
    scrape = yaml.safe_load(config.read_text())
    assert scrape["rule_files"] == ["alerts.yml"] and (config.parent / "alerts.yml").is_file()
    (job,) = scrape["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == list(WORKERS) and sd["port"] == port
    for name in WORKERS:
        assert services()[name]["environment"] == worker["environment"], name


def test_the_default_stack_needs_no_gpu_and_each_gpu_worker_has_its_own():
    default = {n: s for n, s in services().items() if not s.get("profiles")}
    assert "worker" in default
    for name, service in default.items():
        assert "deploy" not in service, f"{name} reserves a device without a profile"
    cpu = services()["worker"]["build"]["args"]["TORCH_INDEX"]
    assert cpu.endswith("/whl/cpu")  # torch's CPU build: no CUDA libraries in the image
    devices = []
    for name in WORKERS[1:]:
        service = services()[name]
        assert service["profiles"] == ["gpu"] and service["image"] != "plurai", name
        assert service["build"]["args"]["TORCH_INDEX"] == "", name  # pip's own: CUDA
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and len(device["device_ids"]) == 1, name
        devices += device["device_ids"]
    assert len(set(devices)) == len(devices) == len(WORKERS) - 1


def test_every_long_lived_service_restarts_unless_stopped():
    # every service here runs until stopped (none is a one-shot job)
    for name, service in services().items():
        assert service.get("restart") == "unless-stopped", name


def test_the_bulk_driver_is_given_the_workers_model():
    worker = argv(services()["worker"])
    model = worker[worker.index("--model") + 1]
    env = services()["celery-worker"]["environment"]
    model_dir = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", env["PLURAI_MODEL_DIR"])
    assert model_dir == model
    mounts = {v.split(":")[1] for v in services()["celery-worker"]["volumes"]}
    assert any(model.startswith(m + "/") for m in mounts)


def _compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        return ["docker", "compose"]
    return None


@pytest.mark.parametrize("profile", [None, "gpu", "monitoring", "webhooks"])
def test_docker_compose_config_passes(profile: str | None) -> None:
    """Compose's own check of the file (its schema, interpolation, anchors) per profile."""
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no docker-compose (Debian package docker-compose: `make install`)")
    argv = [*cli, *(["--profile", profile] if profile else []), "config", "-q"]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_prometheus_config_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool (Debian package prometheus: `make install` installs it)")
    path = ROOT / "deploy" / "prometheus" / "compose.yml"
    run = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
