"""The Kubernetes manifests in deploy/ stay in step with the code: KEDA's triggers name the
lane streams and consumer group that broker_config.keys names, one per configured lane; the
scaled object targets the worker Deployment; a pod gets more time to stop than the worker's
grace period."""

from __future__ import annotations

from pathlib import Path

import yaml

from broker_config import keys
from broker_config.settings import Settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def docs(name: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / name).read_text())}


def test_keda_scales_the_worker_deployment_on_every_lane() -> None:
    worker = docs("worker.yaml")["Deployment"]
    auto = docs("autoscale.yaml")
    scaled, auth = auto["ScaledObject"], auto["TriggerAuthentication"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == worker["metadata"]["name"]
    triggers = scaled["spec"]["triggers"]
    assert [t["metadata"]["stream"] for t in triggers] == [
        keys.request_stream(lane) for lane in Settings().lanes
    ]
    for t in triggers:
        assert t["type"] == "redis-streams"
        assert t["metadata"]["consumerGroup"] == keys.GROUP
        assert int(t["metadata"]["lagCount"]) > 0
        assert t["authenticationRef"]["name"] == auth["metadata"]["name"]
    lows = [int(t["metadata"]["lagCount"]) for t in triggers]
    assert lows == sorted(lows)  # the top lane scales first


def test_a_worker_pod_outlives_its_grace_period() -> None:
    spec = docs("worker.yaml")["Deployment"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert spec["terminationGracePeriodSeconds"] > float(env["PLURAI_GRACE_PERIOD_S"])
    port = int(env["PLURAI_METRICS_PORT"])
    assert [p["containerPort"] for p in container["ports"]] == [port]
    assert container["args"][0] == "worker"
