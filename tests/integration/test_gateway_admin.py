"""The gateway's admin API (gateway/admin.py): lane and dead-letter controls over HTTP,
only with an admin key sent as a bearer token (never on a keyless gateway, never from a
browser's Basic credentials), each refusal with its code."""

from __future__ import annotations

import base64

import redis

from plurai.broker_config import keys, protocol, stats
from plurai.broker_config.settings import Settings
from plurai.gateway import apikeys
from plurai.producer.client import Client
from plurai.results import records
from tests.helpers import gateway


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_the_admin_api_needs_an_admin_key(redis_url) -> None:
    with gateway(redis_url) as http:  # keyless and on loopback: the API serves, admin not
        resp = http.post("/admin/lanes/batch/purge")
        assert resp.status_code == 401
        assert "admin scope" in resp.json()["error"]["message"]
        assert http.get("/v1/models").status_code == 200
    r = redis.Redis.from_url(redis_url)
    user, _ = apikeys.create_key(r, "acme")
    admin, _ = apikeys.create_key(r, "ops", admin=True)
    with gateway(redis_url) as http:
        resp = http.post("/admin/lanes/batch/pause", headers=_bearer(user))
        assert resp.status_code == 403
        assert resp.json()["error"]["code"] == "admin_scope_required"
        basic = base64.b64encode(f"ops:{admin}".encode()).decode()
        resp = http.post("/admin/lanes/batch/pause", headers={"Authorization": f"Basic {basic}"})
        assert resp.status_code == 401  # what a browser would send for a cross-site form
        assert r.scard(keys.PAUSED) == 0
        assert http.get("/admin/lanes", headers=_bearer(admin)).json() == {"paused": []}


def test_lane_controls_over_http(redis_url) -> None:
    r = redis.Redis.from_url(redis_url)
    admin, _ = apikeys.create_key(r, "ops", admin=True)
    auth = _bearer(admin)
    with gateway(redis_url) as http, Client(redis_url) as client:
        resp = http.post("/admin/lanes/standard/pause", headers=auth)
        assert resp.json() == {"lane": "standard", "paused": True, "changed": True}
        again = http.post("/admin/lanes/standard/pause", headers=auth).json()
        assert again["changed"] is False
        listed = http.get("/admin/lanes", headers=auth).json()
        assert listed == {"paused": [{"model": "default", "lane": "standard"}]}
        lanes = {q.name: q.paused for q in stats.snapshot(r, Settings().lanes).lanes}
        assert lanes["standard"] and not lanes["batch"]
        resumed = http.post("/admin/lanes/standard/resume", headers=auth).json()
        assert resumed == {"lane": "standard", "paused": False, "changed": True}

        waiting = [client.submit(f"waits {i}", lane="batch") for i in range(3)]
        resp = http.post("/admin/lanes/batch/purge", headers=auth)
        assert resp.json() == {"lane": "batch", "cancelled": 3}
        assert all(j.record().state == records.CANCELLED for j in waiting)

        resp = http.post("/admin/lanes/nosuch/purge", headers=auth)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "unknown_lane"
        resp = http.post("/admin/lanes/batch/pause?model=" + "m" * 300, headers=auth)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "bad_model"
        assert http.post("/admin/lanes/batch/delete", headers=auth).status_code in (404, 405)


def test_dead_letter_controls_over_http(redis_url) -> None:
    r = redis.Redis.from_url(redis_url)
    admin, _ = apikeys.create_key(r, "ops", admin=True)
    auth = _bearer(admin)
    job_id = protocol.new_job_id()
    dead_id = r.xadd(keys.DEAD_LETTER, {"lane": "batch", "error": "bad", "job_id": job_id})
    dead_id = dead_id.decode()
    with gateway(redis_url) as http:
        listed = http.get("/admin/dead-letters?count=10", headers=auth).json()["data"]
        assert [(d["id"], d["job_id"], d["requeueable"]) for d in listed] == [
            (dead_id, job_id, False)
        ]
        for count in ("0", "x", "100000"):
            resp = http.get(f"/admin/dead-letters?count={count}", headers=auth)
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "bad_count"
        resp = http.post(f"/admin/dead-letters/{dead_id}/requeue", headers=auth)
        assert resp.status_code == 422 and resp.json()["error"]["code"] == "not_requeueable"
        resp = http.post("/admin/dead-letters/not-an-id/requeue", headers=auth)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "unknown_dead_letter"
        resp = http.delete(f"/admin/dead-letters/{dead_id}", headers=auth)
        assert resp.json() == {"id": dead_id, "dropped": True}
        resp = http.delete(f"/admin/dead-letters/{dead_id}", headers=auth)
        assert resp.status_code == 404
        assert r.xlen(keys.DEAD_LETTER) == 0
