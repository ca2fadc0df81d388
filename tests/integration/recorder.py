"""A stand-in engine for the worker's intake tests: always room, records what it is given."""

from __future__ import annotations

import threading
from typing import Any

from plurai.gpu_workers.backend import AddRequest, RequestError, StepOutput


class Recorder:
    """Stands in for the engine: always has room, records what it is given."""

    num_running = num_waiting = prompt_backlog = 0
    max_model_len = 4096
    max_num_seqs = 64
    step_tokens = 512
    model_fingerprint = "fake"

    def __init__(self) -> None:
        self.added: list[tuple[str, int]] = []
        self.aborted: list[str] = []

    def has_unfinished(self) -> bool:
        return bool(self.added)

    def can_admit(self, *_a: object) -> bool:
        return True

    def preempted(self) -> list[str]:
        return []

    def wake(self) -> None:
        pass

    def add(self, req: AddRequest) -> list[str]:
        if req.prompt == "refuse me":
            raise RequestError("invalid_params", "temperature must be in 0..100")
        self.added.append((req.request_id, req.priority))
        return [""]

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True

    def stats(self) -> dict[str, Any]:
        return {"running": len(self.added), "waiting": 0, "kv_usage": 0.0}

    def step(self) -> list[StepOutput]:  # generates nothing: a test says what a step gave
        return []


def token(job_id: str, n: int) -> StepOutput:
    """The job's n-th output token, as a backend's step gives it."""
    return StepOutput(
        request_id=job_id,
        new_token_ids=[n],
        text_delta="a",
        finished=False,
        finish_reason=None,
        num_prompt_tokens=1,
        num_output_tokens=n,
        num_cached_tokens=0,
    )


class Waiting(Recorder):
    """Steps as vLLM's engine process does: each step waits for the engine's outputs (none
    come here) until its wait ends or wake() is called."""

    WAIT_S = 60.0

    def __init__(self) -> None:
        super().__init__()
        self.woken = False
        self.cond = threading.Condition()
        self.waits_ended = 0  # steps that waited WAIT_S out: a poll, not a wake-up

    def wake(self) -> None:
        with self.cond:
            self.woken = True
            self.cond.notify_all()

    def step(self) -> list[StepOutput]:
        with self.cond:
            if not self.cond.wait_for(lambda: self.woken, self.WAIT_S):
                self.waits_ended += 1
            self.woken = False
        return []
