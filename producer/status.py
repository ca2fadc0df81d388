"""`plurai status`: lanes, workers, KV use and throughput, read from Redis.

    plurai status              live view, refreshed every second (Ctrl-C to leave)
    plurai status --once       one view, then exit
    plurai status --json       one reading as JSON (broker_config.stats.Snapshot)

Workers report through their heartbeat hash, so their figures are at most one heartbeat
interval (PLURAI_HEARTBEAT_INTERVAL_S) old; lane figures are read live.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from plurai.broker_config import stats
from plurai.broker_config.connection import redact


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


def render(snap: stats.Snapshot) -> Group:
    lanes = Table(title="lanes", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("model", "lane", "workers", "waiting", "pending", "oldest waiting"):
        lanes.add_column(col, justify="left" if col in ("model", "lane") else "right")
    for lane in snap.lanes:
        lanes.add_row(
            lane.model,
            f"{lane.name} (paused)" if lane.paused else lane.name,
            str(lane.workers),
            str(lane.waiting),
            str(lane.pending),
            _age(lane.oldest_waiting_age_s),
        )
    workers = Table(title="workers", title_justify="left", box=box.SIMPLE_HEAD)
    workers.add_column("worker", no_wrap=True)
    workers.add_column("state")
    for col in ("run", "wait", "KV used", "cached", "hits", "spec", "tok/s", "jobs", "beat"):
        workers.add_column(col, justify="right", no_wrap=True)
    for w in snap.workers:
        pct = f"{100 * w.kv_blocks_used / w.kv_blocks_total:.0f}%" if w.kv_blocks_total else "-"
        workers.add_row(
            w.id,
            f"starting: {w.stage}" if w.state == "starting" and w.stage else w.state,
            str(w.running),
            str(w.waiting),
            f"{w.kv_blocks_used}/{w.kv_blocks_total} {pct}",
            str(w.kv_blocks_cached),
            f"{100 * w.prefix_hit_rate:.0f}%",
            # the share of speculatively proposed tokens accepted; - when none proposed
            f"{100 * w.spec_accepted / w.spec_proposed:.0f}%" if w.spec_proposed else "-",
            f"{w.tokens_per_s:.1f}",
            str(w.jobs_done),
            _age(w.beat_age_s),
        )
    t = snap.totals
    summary = (
        f"{t['workers']} worker(s), {t['running']} running, {t['waiting']} waiting, "
        f"{t['pending']} pending, {t['scheduled']} scheduled, {t['tokens_per_s']:.1f} tok/s, "
        f"dead letters {snap.dead_letters}"
    )
    if t.get("webhooks_waiting") or t.get("webhooks_delivered") or t.get("webhooks_failed"):
        summary += (
            f", webhooks {t['webhooks_waiting']} waiting, {t['webhooks_delivered']} delivered, "
            f"{t['webhooks_failed']} failed"
        )
    if snap.stale_workers:
        summary += f", {snap.stale_workers} worker id(s) without a heartbeat"
    return Group(lanes, workers, summary)


def show(
    r: redis.Redis, lanes: list[str], model: str, *, as_json: bool, once: bool, every: float
) -> int:
    """`model`: the deployment's default model, shown even before any worker served it."""
    if as_json:
        print(json.dumps(stats.snapshot(r, lanes, model).to_dict(), indent=2))
        return 0
    console = Console()
    if once:
        console.print(render(stats.snapshot(r, lanes, model)))
        return 0
    with Live(render(stats.snapshot(r, lanes, model)), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(every)
                try:
                    view: Any = render(stats.snapshot(r, lanes, model))
                except redis.RedisError as e:  # keep watching: Redis may come back
                    view = f"cannot read Redis ({redact(str(e))}); retrying every {every:g}s"
                live.update(view, refresh=True)
        except KeyboardInterrupt:
            pass
    return 0
