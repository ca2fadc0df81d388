"""The Kubernetes manifests in deploy/ stay in step with the code: KEDA's triggers name the
lane streams and consumer group that broker_config.keys names, one per configured lane; the
scaled object targets the worker Deployment; a pod gets more time to stop than the worker's
grace period."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from plurai.broker_config import keys
from plurai.broker_config.settings import Settings

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


KINDS = {  # the API group of each kind deploy/ uses
    "Deployment": "apps/v1",
    "StatefulSet": "apps/v1",
    "Service": "v1",
    "ScaledObject": "keda.sh/v1alpha1",
    "TriggerAuthentication": "keda.sh/v1alpha1",
}


def manifests() -> list[dict]:
    return [d for f in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())]


def pods() -> list[dict]:
    return [d for d in manifests() if d["kind"] in ("Deployment", "StatefulSet")]


def test_every_manifest_is_a_known_kind_with_a_unique_name() -> None:
    names = [(d["kind"], d["metadata"]["name"]) for d in manifests()]
    assert {k for k, _ in names} == set(KINDS)
    assert len(set(names)) == len(names)
    for d in manifests():
        assert d["apiVersion"] == KINDS[d["kind"]], d["metadata"]["name"]
    for d in pods():  # a workload selects the pods its template makes
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_each_service_reaches_a_named_port_of_the_pods_it_selects() -> None:
    services = [d for d in manifests() if d["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} == {"redis", "plurai-gateway"}
    for service in services:
        selected = [
            p for p in pods()
            if service["spec"]["selector"].items() <= p["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert len(selected) == 1, service["metadata"]["name"]
        ports = {
            port["name"]: port["containerPort"]
            for c in selected[0]["spec"]["template"]["spec"]["containers"]
            for port in c["ports"]
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, service["metadata"]["name"]


def test_the_gateway_listens_where_its_service_sends_and_is_probed_open() -> None:
    gateway = docs("gateway.yaml")["Deployment"]["spec"]["template"]["spec"]
    (container,) = gateway["containers"]
    args = container["args"]
    assert args[0] == "gateway" and args[args.index("--host") + 1] == "0.0.0.0"
    assert int(args[args.index("--port") + 1]) == container["ports"][0]["containerPort"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"  # needs no API key


def test_redis_is_the_address_keda_reads_and_keeps_what_the_queue_needs() -> None:
    service = docs("redis.yaml")["Service"]
    (port,) = service["spec"]["ports"]
    addresses = {
        t["metadata"]["address"] for t in docs("autoscale.yaml")["ScaledObject"]["spec"]["triggers"]
    }
    assert addresses == {f"{service['metadata']['name']}.plurai.svc:{port['port']}"}
    (container,) = docs("redis.yaml")["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"


SECRETS = {("plurai-redis", "url"), ("plurai-redis", "password"), ("plurai-webhooks", "secret")}


def test_every_plurai_variable_is_a_setting_and_every_secret_is_the_one_made() -> None:
    known = {f"PLURAI_{f.upper()}" for f in Settings.model_fields}
    for d in pods():
        for c in d["spec"]["template"]["spec"]["containers"]:
            for e in c.get("env", []):
                if e["name"].startswith("PLURAI_"):
                    assert e["name"] in known, e["name"]
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                # the Secrets the headers create: worker.yaml's (url, password), webhooks.yaml's
                if ref:
                    assert (ref["name"], ref["key"]) in SECRETS, ref


# KEDA's kinds have no schema in Kubernetes' own; the tests above check them against the code
KEDA = {"ScaledObject", "TriggerAuthentication"}


@pytest.mark.parametrize("version", ["1.30.0", "latest"])
def test_the_manifests_pass_the_kubernetes_schema(version: str) -> None:
    """Every Kubernetes object in deploy/ against the API's schema (strict: no unknown
    field), as kubeconform checks it, for the oldest and newest supported releases."""
    import kubernetes_validate.utils as kv

    release = kv.latest_version() if version == "latest" else version
    checked = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None or doc["kind"] in KEDA:
                continue
            try:
                kv.validate(doc, release, strict=True)
            except kv.ValidationError as e:
                raise AssertionError(f"{path.name} {doc['kind']}: {e.message}") from None
            checked.append(doc["kind"])
    assert {"Deployment", "StatefulSet", "Service"} <= set(checked), checked


def test_the_webhook_sender_starts_only_once_told_its_hosts_and_secret() -> None:
    """Applied with the rest of deploy/, it runs no pod until scaled up: the sender refuses to
    start without a secret, and with no hosts allowed every webhook is refused at submit."""
    sender = docs("webhooks.yaml")["Deployment"]
    assert sender["spec"]["replicas"] == 0
    (container,) = sender["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert container["args"] == ["webhooks"]
    assert env["PLURAI_WEBHOOK_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "plurai-webhooks"
    header = (DEPLOY / "webhooks.yaml").read_text()
    assert "secret generic plurai-webhooks --from-literal=secret=" in header
