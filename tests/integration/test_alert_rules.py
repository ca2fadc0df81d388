"""The alert rules and the Grafana dashboard in deploy/ name only metrics that a running
worker or gateway exports, every alert has a runbook entry in docs/operations.md, and the
rules pass `promtool check rules` where promtool is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from plurai.broker_config import keys
from plurai.gateway.metrics import GatewayMetrics
from plurai.producer.client import Client
from plurai.results import records

from .conftest import ROOT

RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "plurai.json"
NAME = re.compile(r"\bplurai_[a-z0-9_]+\b")


def rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in doc["panels"] for t in panel["targets"]]


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def exported(text: str) -> set[str]:
    """The series names of a /metrics page: each family's, with its type's suffixes (a
    labelled counter has no series until its first increment, but its name is known)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
        names.update(s.name for s in family.samples)
    return names


def test_every_metric_named_is_exported(redis_url, workers):
    workers.start(1, "--metrics-port", "0")
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    (worker_id,) = r.smembers(keys.WORKERS)
    port = int(r.hget(keys.worker(worker_id), "metrics_port") or 0)
    job = Client(redis_url).submit(token_ids=[5, 6, 7], max_tokens=3)
    assert job.result(timeout=60).state == records.COMPLETED
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        names = exported(resp.read().decode())
    gateway = GatewayMetrics()
    gateway.done("chat", 200, 0.01)
    names |= exported(gateway.render()[0].decode())
    exprs = [rule["expr"] for rule in rules()] + dashboard_exprs()
    used = {n for e in exprs for n in NAME.findall(e)}
    assert used, "no metric names found"
    assert not used - names, f"named but not exported: {sorted(used - names)}"


def test_each_alert_has_a_runbook_entry():
    headings = re.findall(r"^#{2,4} (.+)$", (ROOT / "docs" / "operations.md").read_text(), re.M)
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-") for h in headings}
    alerts = [rule for rule in rules() if "alert" in rule]
    assert len(alerts) >= 6
    for rule in alerts:
        link = rule["annotations"]["runbook"]
        assert link.startswith("docs/operations.md#"), rule["alert"]
        assert link.split("#", 1)[1] in anchors, f"{rule['alert']}: no heading for {link}"
        assert rule["annotations"]["summary"]


def test_the_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool (Debian package prometheus: `make install` installs it)")
    run = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_dashboard_is_grafana_json():
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] and doc["panels"]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for panel in doc["panels"]:
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
    assert Path(DASHBOARD).stat().st_size < 64 * 1024
