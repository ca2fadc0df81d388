"""The dashboard's own cost: the page's weight, and what one refresh asks of Redis as the
backlog grows.

    python bench/dashboard.py [--backlogs 100,10000,100000] [--readings 20] [--smoke]

Page weight: the bytes of the page and the two files it loads (all it loads: no charting
library, the charts are SVG drawn by dashboard.js), raw and gzipped. Cost: for each backlog (jobs queued on one
model, no worker; as many entries in the recent-jobs index, the dead letters and the
batches index), the Redis commands one reading sends (INFO's total_commands_processed)
and its time (median of --readings, this machine's loopback Redis). The last line is one
JSON object of measured figures and ratios. --smoke: backlogs of 10 and 100, three
readings each: a check that the bench runs, not a measurement.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.workload import add_smoke_arg, json_line  # noqa: E402
from plurai.broker_config import keys  # noqa: E402
from plurai.broker_config.embedded import EmbeddedRedis  # noqa: E402
from plurai.broker_config.settings import Settings  # noqa: E402
from plurai.gateway import dashboard  # noqa: E402
from plurai.producer.client import Client  # noqa: E402


def page_weight() -> dict[str, int]:
    files = {
        n: resources.files("gateway").joinpath("static", n).read_bytes() for n in dashboard.ASSETS
    }
    raw = sum(len(b) for b in files.values())
    return {
        **{name.replace("dashboard.", "") + "_bytes": len(b) for name, b in files.items()},
        "total_bytes": raw,
        "total_gzip_bytes": sum(len(gzip.compress(b, 9)) for b in files.values()),
        "requests": len(files),
    }


def fill(r: redis.Redis, client: Client, backlog: int) -> None:
    """Top the queue, the recent-jobs index, dead letters and batches up to `backlog`."""
    have = r.xlen(keys.request_stream("standard"))
    for start in range(have, backlog, 5000):
        n = min(5000, backlog - start)
        client.submit_many({"prompt": "x", "max_tokens": 1} for _ in range(n))
        pipe = r.pipeline(transaction=False)
        for i in range(start, start + n):
            pipe.xadd(
                keys.RECENT, {"id": f"bench-job-{i:08d}", "model": "default", "lane": "standard"}
            )
            pipe.xadd(keys.DEAD_LETTER, {"lane": "standard", "error": "bench", "fields": "{}"})
            pipe.zadd(keys.BATCHES, {f"bench{i}": i})
        pipe.execute()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backlogs", default="100,10000,100000")
    p.add_argument("--readings", type=int, default=20)
    add_smoke_arg(p)
    args = p.parse_args()
    if args.smoke:
        args.backlogs, args.readings = "10,100", 3
    backlogs = sorted(int(x) for x in args.backlogs.split(","))
    settings = Settings()
    weight = page_weight()
    print(f"page: {weight}")
    costs: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis")
        url = server.start()
        try:
            r = redis.Redis.from_url(url)
            client = Client(url)
            for backlog in backlogs:
                fill(r, client, backlog)
                commands, times = [], []
                for _ in range(args.readings):
                    before = int(r.info("stats")["total_commands_processed"])
                    t = time.perf_counter()
                    _, reading = dashboard.read(r, settings)
                    times.append(time.perf_counter() - t)
                    commands.append(int(r.info("stats")["total_commands_processed"]) - before - 1)
                json.dumps(reading)  # what the endpoint sends
                costs[str(backlog)] = {
                    "commands": statistics.median(commands),
                    "reading_ms": round(1000 * statistics.median(times), 2),
                    "json_bytes": len(json.dumps(reading)),
                }
                print(f"backlog {backlog}: {costs[str(backlog)]}")
            client.close()
        finally:
            server.stop()
    low, high = costs[str(backlogs[0])], costs[str(backlogs[-1])]
    json_line(
        {
            "bench": "dashboard",
            "page": weight,
            "per_reading": costs,
            "commands_ratio_largest_to_smallest_backlog": round(
                high["commands"] / low["commands"], 3
            ),
            "reading_time_ratio_largest_to_smallest_backlog": round(
                high["reading_ms"] / low["reading_ms"], 2
            ),
        },
        args.smoke,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
