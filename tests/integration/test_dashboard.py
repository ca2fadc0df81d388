"""The dashboard (/dashboard of the gateway, and `plurai dashboard`): a headless Chromium
shows the live figures while jobs run (the backlog, then falling; the worker; the jobs
submitted, completed, with their tokens); the page and its data answer 401 without an
admin key beyond loopback; a reading's Redis commands do not grow with the backlog."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import redis

from plurai.broker_config import keys, stats
from plurai.broker_config.embedded import free_port
from plurai.broker_config.settings import Settings
from plurai.gateway import apikeys, dashboard
from plurai.producer.client import Client
from plurai.results import wait

from .conftest import ROOT
from .faults import FAST
from .test_gateway import Gateway

FAST_PAGE = {"PLURAI_DASHBOARD_REFRESH_S": "0.5", "PLURAI_DASHBOARD_SAMPLE_S": "1"}
# as the browser tests of these machines start Chromium: no network beyond loopback
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str:
    """The Chromium the test set-up installed (`make install`), else skip."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; `make install`)")
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no Chromium (Debian package chromium: `make install` installs it)")
    return path


def cells(page, table: str, row_attr: str, value: str) -> list[str]:
    return page.locator(f'#{table} tr[{row_attr}="{value}"] td').all_inner_texts()


def wait_for(check, timeout: float = 60.0, what: str = "") -> None:
    give_up = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < give_up, f"not seen in {timeout}s: {what}"
        time.sleep(0.2)


def test_browser_shows_the_live_queue(redis_url, tmp_path, workers) -> None:
    path = chromium()
    from playwright.sync_api import sync_playwright

    gw = Gateway(redis_url, tmp_path / "gateway.log", env=FAST_PAGE)
    client = Client(redis_url)
    r = redis.Redis.from_url(redis_url)
    try:
        jobs = [client.submit(f"job {i} of the dashboard test", max_tokens=96) for i in range(30)]
        ids = {j.id for j in jobs}
        # a bulk batch under way and a dead letter whose text is markup (shown as text)
        now_ms = int(time.time() * 1000)
        r.zadd(keys.BATCHES, {"batch_dash": now_ms})
        r.hset(
            keys.batch("batch_dash"),
            mapping={"status": "in_progress", "total": 10, "completed": 4, "failed": 1},
        )
        bold = "<b id=injected>too many deliveries</b>"
        r.xadd(keys.DEAD_LETTER, {"lane": "batch", "error": bold, "job_id": "job-deadbeef"})
        # a webhook that waits for its job, and one given up (results/webhooks.py)
        r.zadd(keys.WEBHOOKS_DUE, {jobs[0].id: now_ms + 3_600_000})
        r.hset(keys.WEBHOOKS_COUNTS, "failed", 2)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1600})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(gw.base + "/dashboard")
            # the backlog before any worker: 30 waiting in the default model's standard lane
            lane = f'#lanes tr[data-model="{keys.DEFAULT_MODEL}"][data-lane="standard"]'
            page.wait_for_selector(lane, timeout=20_000)
            wait_for(lambda: page.locator(lane + " td").nth(3).inner_text() == "30", 20, "30")
            waiting = (
                f'[data-chart="{keys.DEFAULT_MODEL}/waiting"] polyline[data-series="standard"]'
            )
            wait_for(lambda: page.locator(waiting).get_attribute("data-last") == "30", 20, "chart")
            batch = cells(page, "batches", "data-batch", "batch_dash")
            assert batch[1] == "in_progress" and batch[2].endswith("5/10 50%"), batch
            assert batch[3:6] == ["4", "1", "10"], batch
            assert page.locator("#dead-count").inner_text() == "(1)"
            dead = page.locator("#dead tbody td").all_inner_texts()
            assert bold in dead and "job-deadbeef" in dead, dead
            assert page.locator("#injected").count() == 0  # text, never markup
            totals = page.locator("#totals").inner_text()
            assert "1 webhooks waiting" in totals and "2 webhooks failed" in totals, totals

            (proc,) = workers.start(1, "--engine", "max_num_seqs=4", env=FAST)
            # the worker's row, serving, with KV in use at some point
            row = f'#workers tr[data-worker*="-{proc.pid}-"]'
            page.wait_for_selector(row, timeout=30_000)
            wait_for(lambda: "serving" in page.locator(row).inner_text(), 30, "serving")
            # the backlog falls: seen below 30 while jobs still wait, then 0
            wait_for(lambda: int(page.locator(lane + " td").nth(3).inner_text()) < 30, 60, "<30")
            page.screenshot(path=str(tmp_path / "dashboard-running.png"), full_page=True)
            wait.wait_many(r, list(ids), 180)
            wait_for(lambda: page.locator(lane + " td").nth(3).inner_text() == "0", 30, "0")
            wait_for(lambda: page.locator(waiting).get_attribute("data-last") == "0", 30, "chart 0")
            # the chart kept the whole fall: 30 at its top, 0 now
            assert page.locator(waiting).get_attribute("data-max") == "30"
            assert int(page.locator(waiting).get_attribute("data-points")) >= 3
            # every job submitted, completed on that worker, with its tokens
            wait_for(
                lambda: len(page.locator("#jobs tr[data-state=completed]").all()) == 30, 30, "jobs"
            )
            shown = page.locator("#jobs tr[data-job-id]")
            assert {shown.nth(i).get_attribute("data-job-id") for i in range(30)} == ids
            job = jobs[0]
            rec = job.record()
            texts = cells(page, "jobs", "data-job-id", job.id)
            assert texts[3] == "completed" and texts[4] == rec.worker
            assert texts[8] == str(rec.output_tokens) and texts[6] == str(rec.prompt_tokens)
            assert texts[5].endswith("ms") or texts[5].endswith(" s")  # a TTFT
            done = page.locator(row + " td").nth(9)  # jobs done, from its next heartbeat
            wait_for(lambda: done.inner_text() == "30", 20, "jobs done")
            # throughput: the standard lane's jobs ended per second rose above 0, and the
            # model's live tokens per second was charted
            jobs_rate = f'[data-chart="{keys.DEFAULT_MODEL}/jobs"] polyline[data-series="standard"]'
            assert float(page.locator(jobs_rate).get_attribute("data-max")) > 0
            live = f'[data-chart="{keys.DEFAULT_MODEL}/tokens"] polyline[data-series="all, live"]'
            assert int(page.locator(live).get_attribute("data-points")) >= 2
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            assert not errors, errors
            browser.close()
    finally:
        gw.stop()
        client.close()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000


def _basic(secret: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"admin:{secret}".encode()).decode()}


def test_the_dashboard_needs_an_admin_key(redis_url, tmp_path) -> None:
    r = redis.Redis.from_url(redis_url)
    paths = ["/dashboard", "/dashboard/data", "/dashboard/dashboard.js"]
    # beyond loopback without keys: nobody
    wide = Gateway(redis_url, tmp_path / "wide.log", host="0.0.0.0")
    try:
        for path in paths:
            resp = httpx.get(wide.base + path, timeout=10)
            assert resp.status_code == 401, path
            assert resp.headers["www-authenticate"].startswith("Basic ")
            assert "plurai keys create" in resp.json()["error"]["message"]
        user, _ = apikeys.create_key(r, "acme")
        admin, _ = apikeys.create_key(r, "ops", admin=True)
        time.sleep(1.1)  # whether keys exist is read at most once a second
        for headers in (
            {},
            {"Authorization": f"Bearer {user}"},
            _basic(user),
            {"Authorization": "Bearer pk-" + "x" * 43},
            _basic("wrong"),
        ):
            for path in paths:
                resp = httpx.get(wide.base + path, headers=headers, timeout=10)
                assert resp.status_code == 401, (path, headers.keys())
        assert (
            "admin"
            in httpx.get(
                wide.base + "/dashboard/data", headers={"Authorization": f"Bearer {user}"}
            ).json()["error"]["message"]
        )
        for headers in ({"Authorization": f"Bearer {admin}"}, _basic(admin)):
            page = httpx.get(wide.base + "/dashboard", headers=headers, timeout=10)
            assert page.status_code == 200 and "dashboard.js" in page.text
            assert "script-src 'self'" in page.headers["content-security-policy"]
            data = httpx.get(wide.base + "/dashboard/data", headers=headers, timeout=10)
            assert data.status_code == 200 and "snapshot" in data.json()
        # the API itself is unchanged: the user's key still works there, Basic does not
        assert httpx.get(wide.base + "/v1/models", headers=_basic(admin)).status_code == 401
    finally:
        wide.stop()
    # a loopback gateway with keys asks for the admin key too
    local = Gateway(redis_url, tmp_path / "local.log")
    try:
        assert httpx.get(local.base + "/dashboard/data", timeout=10).status_code == 401
        ok = httpx.get(local.base + "/dashboard/data", headers=_basic(admin), timeout=10)
        assert ok.status_code == 200
    finally:
        local.stop()


def test_plurai_dashboard_on_its_own(redis_url, tmp_path) -> None:
    port = free_port()
    log = tmp_path / "dashboard.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "plurai.cli", "dashboard", "--url", redis_url, "--port", str(port)],
        cwd=ROOT,
        stdout=open(log, "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        env={**os.environ, **FAST_PAGE},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        give_up = time.monotonic() + 60
        while True:
            try:
                resp = httpx.get(base + "/dashboard/data", timeout=1)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < give_up, log.read_text()
                time.sleep(0.1)
        assert resp.status_code == 200
        body = resp.json()
        assert body["jobs"] == [] and body["dead_letters"]["count"] == 0
        assert httpx.get(base + "/", follow_redirects=True).text.count("dashboard.js") == 1
        # samples accrue in the background for the charts
        time.sleep(2.5)
        assert len(httpx.get(base + "/dashboard/data").json()["history"]) >= 2
        # a since that is no count of ms reads as 0: the whole history, never an error
        for since in ("\u00b2", "-5", "x" * 100, "9" * 40, "1e9", ""):
            got = httpx.get(base + "/dashboard/data", params={"since": since})
            assert got.status_code == 200 and len(got.json()["history"]) >= 2, since
        assert httpx.get(base + "/dashboard/../metrics").status_code == 404
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _commands(r: redis.Redis) -> int:
    return int(r.info("stats")["total_commands_processed"])


def test_a_reading_costs_the_same_whatever_the_backlog(redis_url) -> None:
    """Redis commands per refresh: the same with 100 and 2,000 jobs waiting (and a long
    recent-jobs index, many dead letters and batches): every list is read with a COUNT."""
    r = redis.Redis.from_url(redis_url)
    settings = Settings()
    client = Client(redis_url)
    costs = []
    for backlog in (100, 2000):
        have = sum(x.waiting for x in stats.snapshot(r, settings.lanes).lanes)
        client.submit_many({"prompt": "x", "max_tokens": 1} for _ in range(backlog - have))
        pipe = r.pipeline(transaction=False)
        for i in range(backlog):
            pipe.xadd(keys.RECENT, {"id": f"job-{backlog}-{i:05d}", "model": "m", "lane": "batch"})
            pipe.xadd(keys.DEAD_LETTER, {"lane": "batch", "error": "x", "fields": "{}"})
            pipe.zadd(keys.BATCHES, {f"b{backlog}-{i}": i})
        pipe.execute()
        before = _commands(r)
        _, reading = dashboard.read(r, settings)
        costs.append(_commands(r) - before - 1)  # less the INFO that read the count
        waiting = sum(q["waiting"] for q in reading["snapshot"]["lanes"])
        assert waiting == backlog
        assert len(reading["jobs"]) == dashboard.RECENT_JOBS
        assert reading["dead_letters"]["count"] >= backlog
    client.close()
    assert costs[0] == costs[1], costs
    assert costs[0] < 100, costs
