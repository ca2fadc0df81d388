"""The map-reduce plan of a document: prompts per level, each within the context.

Level 0 applies the task's template to token-bounded chunks of the document. When a level
has more than one prompt, the next level applies the task's reduce template to their joined
outputs, split again if still too long. A level with a single prompt gives the result.
The same functions drive the queue (drive.py) and the offline reference (`run_offline`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TASKS = ("summarize", "extract", "classify", "custom")
SEPARATOR = "\n\n"

_MAP = {
    "summarize": "Summarize the following text.\n\n{text}\n\nSummary:",
    "extract": (
        "Extract the fields of this JSON schema from the text and answer with JSON only.\n"
        "Schema: {schema}\n\nText:\n{text}\n\nJSON:"
    ),
    "classify": (
        "Classify the text into exactly one of these labels: {labels}. "
        "Answer with the label only.\n\nText:\n{text}\n\nLabel:"
    ),
}
_REDUCE = {
    "summarize": "Combine these partial summaries into one summary.\n\n{text}\n\nSummary:",
    "extract": (
        "Merge these partial JSON extractions into one JSON object for this schema.\n"
        "Schema: {schema}\n\n{text}\n\nJSON:"
    ),
    "classify": (
        "These are labels given to parts of one text: {text}\n"
        "Answer with the one label from {labels} that fits the whole text.\n\nLabel:"
    ),
}
MAX_LEVELS = 8


@dataclass(frozen=True)
class Task:
    name: str  # one of TASKS
    max_tokens: int = 64
    temperature: float = 0.0
    schema: str | None = None  # extract: a JSON schema, as text
    labels: tuple[str, ...] = ()  # classify
    template: str | None = None  # custom: must contain {text}
    reduce_template: str | None = None  # custom: defaults to `template`

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"unknown task {self.name!r}; choose one of {', '.join(TASKS)}")
        if self.name == "extract" and not self.schema:
            raise ValueError("task extract needs a JSON schema (--schema)")
        if self.name == "classify" and not self.labels:
            raise ValueError("task classify needs labels (--labels a,b,c)")
        if self.name == "custom" and (not self.template or "{text}" not in self.template):
            raise ValueError("task custom needs a template containing {text} (--template)")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["labels"] = list(self.labels)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        return cls(**{**d, "labels": tuple(d.get("labels") or ())})

    def render(self, text: str, level: int) -> str:
        if self.name == "custom":
            assert self.template is not None
            t = self.template if level == 0 else (self.reduce_template or self.template)
        else:
            t = (_MAP if level == 0 else _REDUCE)[self.name]
        return (
            t.replace("{text}", text)
            .replace("{schema}", self.schema or "")
            .replace("{labels}", ", ".join(self.labels))
        )

    def sampling(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature}


Counter = Callable[[str], int]


def token_counter(tokenizer: Any) -> Counter:
    """Prompt length as the engine counts it (the tokenizer's default special tokens)."""
    return lambda text: len(tokenizer(text).input_ids)


def split(task: Task, text: str, level: int, tokenizer: Any, max_model_len: int) -> list[str]:
    """Prompts for `text` at `level`, each leaving room for max_tokens within max_model_len.
    Chunks are cut at token boundaries of the text (by character offsets, so no text is
    changed) and shrunk until the rendered prompt fits."""
    count = token_counter(tokenizer)
    budget = max_model_len - task.max_tokens
    whole = task.render(text, level)
    if count(whole) <= budget:
        return [whole]
    room = budget - count(task.render("", level))
    if room < 2 * task.max_tokens or room < 8:
        raise ValueError(
            f"max_model_len {max_model_len} leaves {room} tokens per chunk for this task's "
            f"prompt and max_tokens {task.max_tokens}: too few to split a long document"
        )
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)[
        "offset_mapping"
    ]
    prompts: list[str] = []
    i = 0
    while i < len(offsets):
        n = min(room, len(offsets) - i)
        while True:
            end = offsets[i + n - 1][1] if i + n < len(offsets) else len(text)
            prompt = task.render(text[offsets[i][0] : end], level)
            over = count(prompt) - budget
            if over <= 0 or n == 1:
                break
            n = max(1, n - over)
        prompts.append(prompt)
        i += n
    return prompts


def combine(outputs: list[str]) -> str:
    return SEPARATOR.join(o.strip() for o in outputs)


def run_offline(
    task: Task,
    texts: list[str],
    tokenizer: Any,
    max_model_len: int,
    generate: Callable[[list[str]], list[str]],
) -> list[str]:
    """Each document's result by the same plan, level by level, with `generate` (a list of
    prompts -> their outputs, e.g. Engine.generate): the reference for the queue's results."""
    pending = {i: split(task, t, 0, tokenizer, max_model_len) for i, t in enumerate(texts)}
    level = 0
    results: dict[int, str] = {}
    while pending:
        order = [(i, p) for i, ps in pending.items() for p in ps]
        outs = generate([p for _, p in order])
        by_doc: dict[int, list[str]] = {}
        for (i, _), o in zip(order, outs, strict=True):
            by_doc.setdefault(i, []).append(o)
        level += 1
        nxt = {}
        for i, ps in pending.items():
            if len(ps) == 1:
                results[i] = by_doc[i][0]
            else:
                if level > MAX_LEVELS:
                    raise ValueError(f"document {i} did not reduce within {MAX_LEVELS} levels")
                nxt[i] = split(task, combine(by_doc[i]), level, tokenizer, max_model_len)
        pending = nxt
    return [results[i] for i in range(len(texts))]


def schema_text(schema: str | dict[str, Any] | None) -> str | None:
    if schema is None or isinstance(schema, str):
        return schema
    return json.dumps(schema, separators=(",", ":"))
