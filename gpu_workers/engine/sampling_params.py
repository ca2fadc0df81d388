"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from plurai.gpu_workers.engine.errors import ErrorCode, RequestError

MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
SEEDS = 2**63  # a seed is in [0, SEEDS)
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_text(v: str) -> bool:
    """Whether `v` is valid Unicode (encodable as UTF-8: no lone surrogate)."""
    try:
        v.encode()
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N >= 0: sampled token's logprob plus top N
    skip_special_tokens: bool = True
    speculate: bool = True  # false: no speculative decoding for this request
    # structured output (gpu_workers/engine/grammar.py), at most one of the three:
    # {"type": "json_schema", "json_schema": {"schema": {...}, ...}}, {"type": "json_object"}
    # or {"type": "text"} (none) as OpenAI spells it; a regex the whole output matches; or a
    # list of strings the output is one of
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    n: int = 1  # choices: sequences sampled from the one prompt (see for_choice)

    def __post_init__(self) -> None:
        def bad(msg: str) -> RequestError:
            return RequestError(ErrorCode.INVALID_PARAMS, msg)

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, float) or (is_int(v) and -(2**63) <= v < 2**63)

        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            v = getattr(self, name)
            if not is_num(v) or not math.isfinite(v):
                raise bad(f"{name} must be a finite number, got {v!r}")
            setattr(self, name, float(v))
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad(
                f"temperature must be in [0, {MAX_TEMPERATURE}] (0 is greedy), "
                f"got {self.temperature}"
            )
        if not is_int(self.top_k) or not 0 <= self.top_k < 2**31:
            raise bad(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise bad(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}] (1 disables it), "
                f"got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < SEEDS):
            raise bad(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            is_int(t) and 0 <= t < 2**31 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids must be a list of token ids (integers >= 0)")
        for name in ("ignore_eos", "skip_special_tokens", "speculate"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a boolean, got {_short(getattr(self, name))}")
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= 20
        ):
            raise bad(f"logprobs must be an integer in [0, 20] or null, got {self.logprobs!r}")
        if not is_int(self.n) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {_short(self.n)}")
        self._check_constraint(bad)

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of n: one sequence, sampled as a request of seed
        seed + index (mod 2^63; vLLM's rule), so each choice is reproducible on its own and
        choice 0 is the request with n 1. Unseeded choices share the engine's generator."""
        seed = None if self.seed is None else (self.seed + index) % SEEDS
        return replace(self, n=1, seed=seed)

    def _check_constraint(self, bad: Any) -> None:
        """Shapes only: the grammar compiler says whether a schema or regex is usable."""
        rf = self.response_format
        if rf is not None:
            if not isinstance(rf, dict) or rf.get("type") not in RESPONSE_FORMATS:
                raise bad(
                    "response_format must be an object whose type is one of "
                    f"{list(RESPONSE_FORMATS)}, got {_short(rf)}"
                )
            extra = sorted(set(rf) - {"type", "json_schema"})
            if extra:
                raise bad(f"unknown response_format field(s) {extra}")
            if rf["type"] == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                    raise bad(
                        'response_format of type json_schema needs "json_schema": '
                        '{"name": ..., "schema": {a JSON schema object}}'
                    )
            elif "json_schema" in rf:
                raise bad(f"response_format of type {rf['type']} takes no json_schema")
            if rf["type"] == "text":
                self.response_format = None  # the default: no constraint
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise bad("regex must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise bad("choice must be a non-empty list of non-empty strings")
        # JSON can escape a lone surrogate; the grammar compiler takes UTF-8
        if self.regex is not None and not _is_text(self.regex):
            raise bad("regex holds a lone surrogate (not valid Unicode text)")
        if self.choice is not None and not all(_is_text(c) for c in self.choice):
            raise bad("choice holds a lone surrogate (not valid Unicode text)")
        given = [k for k in ("response_format", "regex", "choice") if getattr(self, k) is not None]
        if len(given) > 1:
            raise bad(f"give at most one of response_format, regex and choice; got {given}")

    @property
    def constrained(self) -> bool:
        return self.response_format is not None or self.regex is not None or self.choice is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a wire dict; unknown keys are an error, not silently dropped."""
        if not isinstance(d, dict):
            raise RequestError(ErrorCode.INVALID_PARAMS, "sampling parameters must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise RequestError(
                ErrorCode.INVALID_PARAMS,
                f"unknown sampling field(s) {unknown}; allowed: {sorted(known)}",
            )
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
