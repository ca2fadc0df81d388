"""How entries enter a worker's engine: a few per engine step, ranked by lane first and
the job's own priority second."""

from __future__ import annotations

from broker_config.connection import connect
from broker_config.protocol import MAX_PRIORITY
from broker_config.settings import Settings
from gpu_workers.worker import Worker
from producer.client import Client


class Recorder:
    """Stands in for the engine: always has room, records what it is given."""

    num_running = num_waiting = 0
    max_model_len = 4096
    max_num_seqs = 64

    def __init__(self) -> None:
        self.added: list[tuple[str, int]] = []

    def has_unfinished(self) -> bool:
        return bool(self.added)

    def can_admit(self, *_a: object) -> bool:
        return True

    def add(self, request_id: str, priority: int, **_kw: object) -> None:
        self.added.append((request_id, priority))


def test_entries_enter_by_lane_then_priority_a_few_per_step(redis_url):
    settings = Settings(redis_url=redis_url, takes_per_step=3, fair_every=0, top_lane_reserve=0)
    engine = Recorder()
    w = Worker(engine, connect(redis_url), settings, worker_id="w1")
    w.start()
    with Client(redis_url) as client:
        batch = [client.submit("b", lane="batch", priority=-5).id for _ in range(4)]
        top = client.submit("i", lane="interactive", priority=7).id
        w._fill()
        assert [rid for rid, _ in engine.added] == [top, *batch[:2]]  # 3, highest lane first
        ranks = dict(engine.added)
        assert ranks[top] == 7  # the top lane: the job's own priority
        assert ranks[batch[0]] == 2 * (2 * MAX_PRIORITY + 1) - 5  # two lanes down
        w._fill()
        assert [rid for rid, _ in engine.added] == [top, *batch]
        assert client.job(top).status() == "running"


def test_default_takes_scale_with_the_engine(redis_url):
    engine = Recorder()
    engine.max_num_seqs = 128
    w = Worker(engine, connect(redis_url), Settings(redis_url=redis_url), worker_id="w1")
    w.start()
    with Client(redis_url) as client:
        client.submit_many([{"prompt": "x", "lane": "interactive"} for _ in range(10)])
        w._fill()
        assert len(engine.added) == 8  # 128 slots / 16
