"""Redis lost between a job's last step and the storing of its result: the worker keeps the
result, backs off, and stores it once Redis is back (in-process, with a stand-in engine)."""

from __future__ import annotations

import time

import redis

from plurai.broker_config.embedded import EmbeddedRedis
from plurai.gpu_workers.backend import AddRequest, StepOutput
from plurai.producer.client import Client
from plurai.results import records
from tests.helpers import driven_worker

from .faults import pending


class OneStepEngine:
    """Finishes every request in one step with the text 'done'; `on_step` runs first."""

    num_running = num_waiting = prompt_backlog = 0
    max_model_len = 4096
    max_num_seqs = 64
    step_tokens = 512
    model_fingerprint = "fake"

    def __init__(self, on_step) -> None:
        self.on_step = on_step
        self.ids: list[str] = []

    def add(self, req: AddRequest) -> list[str]:
        self.ids.append(req.request_id)
        return [""]

    def can_admit(self, *_a) -> bool:
        return True

    def preempted(self) -> list[str]:
        return []

    def wake(self) -> None:
        pass

    def has_unfinished(self) -> bool:
        return bool(self.ids)

    def abort(self, request_id: str) -> bool:
        return False

    def stats(self) -> dict:
        return {}

    def step(self) -> list[StepOutput]:
        self.on_step()
        ids, self.ids = self.ids, []
        return [
            StepOutput(
                request_id=i,
                new_token_ids=[5],
                text_delta="done",
                finished=True,
                finish_reason="stop",
                num_prompt_tokens=3,
                num_output_tokens=1,
                num_cached_tokens=0,
            )
            for i in ids
        ]


def test_result_kept_across_redis_outage(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    try:
        redis.Redis.from_url(url).config_set("appendfsync", "always")
        job = Client(url).submit("hello", max_tokens=4)
        engine = OneStepEngine(on_step=lambda: server.proc.kill() or server.proc.wait())
        worker = driven_worker(url, engine, "w1")
        # Takes the job, starts it, steps: Redis dies before the result is stored. Whichever
        # call meets the dead connection keeps the result.
        for _ in range(3):
            try:
                worker.iterate()
            except redis.ConnectionError:
                pass
        assert engine.ids == [] and worker.running == {}
        assert len(worker.writer.unsent) == 1
        server.start()  # same port, same append-only file
        give_up = time.monotonic() + 30
        while worker.writer.unsent and time.monotonic() < give_up:
            try:
                worker.iterate()
            except redis.ConnectionError:
                time.sleep(0.1)
        rec = job.record()
        assert rec.state == records.COMPLETED and rec.text == "done" and rec.worker == "w1"
        assert pending(redis.Redis.from_url(url)) == 0  # acked with the stored result
        worker.cancels.close()
    finally:
        server.stop()
