"""The live progress view of `plurai batch status`.

Rates and ETA come from the batch record (lines done since the batch started), not from
this process, so a status view started late, or again after a crash, shows the same.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from plurai.producer.bulk import manage, store
from plurai.producer.client import Client


def _eta(s: float | None) -> str:
    if s is None:
        return "--:--"
    s = int(s)
    return (
        f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


def _fields(b: dict[str, Any]) -> dict[str, Any]:
    c = b["request_counts"]
    return {
        "description": f"{b['id']} {b['status']}",
        "completed": c["completed"] + c["failed"],
        "total": max(1, c["total"]),
        "failed": c["failed"],
        "tps": b["tokens_per_s"],
        "eta": _eta(b["eta_s"]),
    }


def watch(
    client: Client, batch_id: str, console: Console | None = None, every: float = 0.5
) -> dict:
    """Show the batch's progress until it ends; returns its final info."""
    b = manage.info(client, batch_id)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed"),
        TextColumn("{task.fields[tps]:.1f} tok/s"),
        TextColumn("ETA {task.fields[eta]}"),
    )
    with Progress(*columns, console=console, auto_refresh=False) as bar:
        f = _fields(b)
        task = bar.add_task(**f)
        while True:
            bar.update(task, **_fields(b))
            bar.refresh()
            if b["status"] in store.TERMINAL:
                return b
            time.sleep(every)
            b = manage.info(client, batch_id)
