"""A simulated engine for the queue benches and their tests: `SimBackend` implements the
Backend interface (gpu_workers/backend.py) with continuous batching over `max_num_seqs`
slots and a KV budget in tokens; its step sleeps `base + per_seq * batch` ms and yields
one token per running request. bench/fleet_sim.py runs real Workers on it;
tests/unit/test_fleet_sim.py checks it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plurai.broker_config.errors import ErrorCode
from plurai.gpu_workers.backend import AddRequest, RequestError, StepOutput

WORDS = "the a river stone light north quiet letter garden winter paper machine city old".split()

# Step time of the simulated engine: base + per_seq * running sequences, in ms. The shape
# comes from `bench/step_profile.py --model models/tiny-llama --requests 32` on the 2-core
# avx512_bf16 machine: decode steps of 1.1 ms at 1-4 sequences and 1.7 ms at 29-32, i.e.
# about 1.05 ms + 0.021 ms per sequence (per-sequence cost ~2% of the base, as on a GPU,
# where decode is bound by reading the weights). Its absolute size is that of a GPU decode
# step of a mid-size model, 30 ms: one worker then does ~25 steps/s, so 64 of them make
# ~1,600 worker-loop turns/s, which 2 cores carry; the tiny model's own 1-2 ms steps would
# make this bench measure Python, not the queue.
STEP_BASE_MS = 30.0
STEP_PER_SEQ_MS = 0.6
STEP_SOURCE = (
    "shape from bench/step_profile.py on models/tiny-llama (2-core avx512_bf16): "
    "1.05 ms + 0.021 ms/seq; scaled to a 30 ms base (a GPU decode step)"
)


@dataclass
class _Seq:
    id: str
    prompt_tokens: int
    max_tokens: int
    priority: int
    order: int
    output: int = 0

    @property
    def need(self) -> int:
        return self.prompt_tokens + self.max_tokens


def estimate_tokens(
    prompt: str | None, token_ids: list[int] | None, messages: list[dict] | None
) -> int:
    """A cheap prompt length: exact for token ids, ~4 characters a token for text, plus 4
    per chat message for its template."""
    if token_ids is not None:
        return len(token_ids)
    if messages is not None:
        return sum(4 + len(str(m.get("content", ""))) // 4 for m in messages)
    return max(1, len(prompt or "") // 4)


class SimBackend:
    """A Backend whose step sleeps the simulated step time: continuous batching over
    `max_num_seqs` slots and `kv_tokens` of KV (each request reserves prompt + max_tokens
    when admitted), one token per running request per step, finish 'length' at
    max_tokens. Lower `priority` runs first."""

    def __init__(
        self,
        *,
        max_num_seqs: int = 16,
        kv_tokens: int = 4096,
        max_model_len: int = 2048,
        step_base_ms: float = STEP_BASE_MS,
        step_per_seq_ms: float = STEP_PER_SEQ_MS,
        model_fingerprint: str = "sim",
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if kv_tokens < max_model_len:
            raise ValueError("kv_tokens must hold at least one request of max_model_len")
        self.model_fingerprint = model_fingerprint
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_tokens = max_model_len  # a step computes any one prompt whole
        self.kv_tokens = kv_tokens
        self.step_base_ms = step_base_ms
        self.step_per_seq_ms = step_per_seq_ms
        self._sleep = sleep
        self._running: dict[str, _Seq] = {}
        self._waiting: dict[str, _Seq] = {}
        self._order = 0
        self.steps = 0
        # per wall-clock second: [steps, sequences stepped, seconds inside steps]
        self.per_second: dict[int, list[float]] = {}

    def add(self, req: AddRequest) -> list[str]:
        request_id = req.request_id
        if req.output_ids:  # its tokens are made up: a job cut off starts over
            raise RequestError(ErrorCode.BAD_PROGRESS, "the simulated engine does not resume jobs")
        if request_id in self._running or request_id in self._waiting:
            raise RequestError(ErrorCode.DUPLICATE_ID, f"{request_id} is already here")
        max_tokens = (req.params or {}).get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise RequestError(ErrorCode.INVALID_PARAMS, "max_tokens must be an integer >= 1")
        n = estimate_tokens(req.prompt, req.token_ids, req.messages)
        if n + 1 > self.max_model_len:
            raise RequestError(
                ErrorCode.PROMPT_TOO_LONG, f"{n} prompt tokens; at most {self.max_model_len - 1}"
            )
        max_tokens = min(max_tokens, self.max_model_len - n)
        self._order += 1
        self._waiting[request_id] = _Seq(
            id=request_id,
            prompt_tokens=n,
            max_tokens=max_tokens,
            priority=req.priority,
            order=self._order,
        )
        return [""]

    def _reserved(self) -> int:
        return sum(s.need for s in self._running.values()) + sum(
            s.need for s in self._waiting.values()
        )

    def can_admit(
        self, prompt_tokens: int, max_tokens: int, priority: int | None = None, spare: int = 0
    ) -> bool:
        # it never preempts: `priority` changes nothing
        if len(self._running) + len(self._waiting) >= self.max_num_seqs:
            return False
        need = prompt_tokens + min(max_tokens, self.max_model_len) + spare
        return self._reserved() + need <= self.kv_tokens

    def _admit(self) -> None:
        used = sum(s.need for s in self._running.values())
        for seq in sorted(self._waiting.values(), key=lambda s: (s.priority, s.order)):
            if len(self._running) >= self.max_num_seqs or used + seq.need > self.kv_tokens:
                break
            del self._waiting[seq.id]
            self._running[seq.id] = seq
            used += seq.need

    def step(self) -> list[StepOutput]:
        self._admit()
        if not self._running:
            return []
        batch = len(self._running)
        seconds = (self.step_base_ms + self.step_per_seq_ms * batch) / 1000
        start = time.time()
        self._sleep(seconds)
        self.steps += 1
        bucket = self.per_second.setdefault(int(start), [0, 0, 0.0])
        bucket[0] += 1
        bucket[1] += batch
        bucket[2] += seconds
        outs = []
        for seq in list(self._running.values()):
            token = 16 + (seq.output * 7 + seq.order) % 1000
            seq.output += 1
            done = seq.output >= seq.max_tokens
            if done:
                del self._running[seq.id]
            outs.append(
                StepOutput(
                    request_id=seq.id,
                    new_token_ids=[token],
                    text_delta=" " + WORDS[token % len(WORDS)],
                    finished=done,
                    finish_reason="length" if done else None,
                    num_prompt_tokens=seq.prompt_tokens,
                    num_output_tokens=seq.output,
                    num_cached_tokens=0,
                )
            )
        return outs

    def abort(self, request_id: str) -> bool:
        return (
            self._running.pop(request_id, None) or self._waiting.pop(request_id, None)
        ) is not None

    def preempted(self) -> list[str]:
        return []

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def wake(self) -> None:
        """A step sleeps its simulated time through, as a real one computes."""

    @property
    def prompt_backlog(self) -> int:
        return sum(s.prompt_tokens for s in self._waiting.values())

    def stats(self) -> dict[str, Any]:
        used = self._reserved()
        return {
            "running": len(self._running),
            "waiting": len(self._waiting),
            "steps": self.steps,
            "kv_tokens_used": used,
            "kv_tokens_total": self.kv_tokens,
            "blocks_total": self.kv_tokens // 16,  # as the heartbeat shows KV, in 16s
            "blocks_used": -(-used // 16),
            "blocks_free": (self.kv_tokens - used) // 16,
        }

    def close(self) -> None:
        self._running.clear()
        self._waiting.clear()
