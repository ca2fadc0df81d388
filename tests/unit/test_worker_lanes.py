"""The order in which a worker reads the lanes: highest first, with every fair_every-th
pull starting at the next lower lane in turn."""

from __future__ import annotations

import fakeredis

from plurai.broker_config.settings import Settings
from plurai.gpu_workers.intake import Intake
from plurai.gpu_workers.metrics import Metrics
from plurai.gpu_workers.writer import Writer


def intake(settings: Settings) -> Intake:
    r = fakeredis.FakeRedis()
    metrics = Metrics("w", settings.lanes)
    return Intake(r, settings, "w", metrics, Writer(r, settings, "w"), settings.limits(), set())


def orders(settings: Settings, pulls: int) -> list[str]:
    i = intake(settings)
    firsts = []
    for _ in range(pulls):
        firsts.append(i.lane_order()[0])
        i._pulls += 1
    return firsts


def test_every_nth_pull_starts_lower_in_turn():
    firsts = orders(Settings(fair_every=4), 16)
    assert firsts == ["interactive"] * 3 + ["standard"] + ["interactive"] * 3 + ["batch"] + [
        "interactive"
    ] * 3 + ["standard"] + ["interactive"] * 3 + ["batch"]
    i = intake(Settings(fair_every=4))
    i._pulls = 7
    assert i.lane_order() == ["batch", "interactive", "standard"]  # wraps round to the top


def test_strict_order_when_off():
    assert set(orders(Settings(fair_every=0), 20)) == {"interactive"}
    assert set(orders(Settings(fair_every=4, lanes=["only"]), 8)) == {"only"}
