"""The map-reduce plan of a document: prompts per level, each within the context.

Level 0 applies the task's template to token-bounded chunks of the document. When a level
has more than one prompt, the next level applies the task's reduce template to their joined
outputs, split again if still too long. A level with a single prompt gives the result.
The same functions drive the queue (drive.py) and the offline reference (`run_offline`).

Structured tasks constrain every request, map and reduce alike (Task.sampling): extract
sends the schema as `response_format`, classify sends the labels as `choice`, so that a
reduce merges the chunks' outputs under the same constraint and the final output is one
too. The engine still stops a request at max_tokens, so each line's final output is
checked (Task.check) before it is written as a success; one that fails becomes an error
line with the code INVALID_OUTPUT.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import llguidance
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, best_match
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for
from referencing.exceptions import Unresolvable

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
INVALID_OUTPUT = "invalid_output"  # the error code of a final output that fails Task.check
# one pass over the template, so a document that contains "{schema}" stays as it is
_PLACEHOLDER = re.compile(r"\{(text|schema|labels)\}")


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
        if self.name == "extract":
            if not self.schema:
                raise ValueError("task extract needs a JSON schema (--schema)")
            schema_of(self.schema)
        if self.name == "classify" and not self.labels:
            raise ValueError("task classify needs labels (--labels a,b,c)")
        if not all(isinstance(x, str) and x for x in self.labels):
            raise ValueError("labels must be non-empty strings")
        if self.name == "custom" and (not self.template or "{text}" not in self.template):
            raise ValueError("task custom needs a template containing {text} (--template)")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")

    def fits(self, max_grammar_bytes: int) -> Task:
        """The task, if its constraint fits the wire's limit (Settings.max_grammar_bytes),
        else ValueError: checked where the batch is made and where it is driven."""
        sampling = self.sampling()
        for name in ("response_format", "choice"):
            value = sampling.get(name)
            size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
            if value is not None and size > max_grammar_bytes:
                what = "schema (--schema)" if name == "response_format" else "labels (--labels)"
                raise ValueError(
                    f"the {what} take {size} bytes as the request's {name}; the limit is "
                    f"{max_grammar_bytes} (PLURAI_MAX_GRAMMAR_BYTES)"
                )
        return self

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "labels": list(self.labels)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        return cls(**{**d, "labels": tuple(d.get("labels") or ())})

    def render(self, text: str, level: int) -> str:
        if self.name == "custom":
            assert self.template is not None
            t = self.template if level == 0 else (self.reduce_template or self.template)
        else:
            t = (_MAP if level == 0 else _REDUCE)[self.name]
        values = {"text": text, "schema": self.schema or "", "labels": ", ".join(self.labels)}
        return _PLACEHOLDER.sub(lambda m: values[m.group(1)], t)

    def sampling(self) -> dict[str, Any]:
        """The sampling fields of every request of the task, at every level."""
        out: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature}
        if self.name == "extract":
            assert self.schema is not None
            out["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "extract", "schema": json.loads(self.schema)},
            }
        elif self.name == "classify":
            out["choice"] = list(self.labels)
        return out

    def check(self, output: str, finish_reason: str) -> str | None:
        """Why a line's final output cannot be written as a success (None: it can): for
        extract, JSON that validates against the schema; for classify, one of the labels."""
        cut = finish_reason == "length"
        raise_it = f"raise max_tokens (--max-tokens, now {self.max_tokens})"
        if self.name == "classify" and output not in self.labels:
            if cut:
                return f"the output {output[:80]!r} was cut off at max_tokens: {raise_it}"
            return f"the output {output[:80]!r} is not one of the labels {list(self.labels)}"
        if self.name != "extract":
            return None
        assert self.schema is not None
        try:
            value = json.loads(output)
        except ValueError as e:
            if cut:
                return (
                    f"the output was cut off at max_tokens before its JSON closed: {raise_it}, "
                    "or make the schema's output shorter (fewer fields, maxLength, maxItems)"
                )
            return f"the output is not JSON ({e}): {output[:80]!r}"
        try:
            error = best_match(_validator(self.schema).iter_errors(value))
        except Unresolvable as e:
            return f"the schema has a $ref that cannot be resolved: {e}"
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path) or "the top level"
        more = f"; it was cut off at max_tokens: {raise_it}" if cut else ""
        return f"the output does not validate against the schema at {where}: {error.message}{more}"


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
    generate: Callable[[list[str], dict[str, Any]], list[str]],
) -> list[str]:
    """Each document's result by the same plan, level by level, with `generate` (prompts
    and the sampling fields every request of the queue carries, Task.sampling() -> their
    outputs, e.g. Engine.generate with SamplingParams(**sampling)): the reference for the
    queue's results. Outputs are not checked here (Task.check)."""
    pending = {i: split(task, t, 0, tokenizer, max_model_len) for i, t in enumerate(texts)}
    level = 0
    results: dict[int, str] = {}
    while pending:
        order = [(i, p) for i, ps in pending.items() for p in ps]
        outs = generate([p for _, p in order], task.sampling())
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


def schema_of(text: str) -> dict[str, Any]:
    """The JSON schema in `text`; ValueError saying what is wrong if it is not JSON, not an
    object, or not a valid schema of its draft (its `$schema`; 2020-12 if it names none)."""
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"the schema (--schema) is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(
            f"the schema (--schema) must be a JSON object, not {type(schema).__name__}"
        )
    try:
        _draft(schema).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "the top level"
        raise ValueError(
            f"the schema (--schema) is not a valid JSON schema at {where}: {e.message}"
        ) from None
    # what the workers' grammar compiler (llguidance) cannot enforce, refused now rather
    # than on every line: e.g. "not", "if"/"then", "uniqueItems"
    grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        reason = " ".join(x.strip() for x in problem.splitlines() if x.strip())
        raise ValueError(f"the schema (--schema) cannot be enforced: {reason}"[:500])
    return schema


def _draft(schema: dict[str, Any]) -> type[Validator]:
    if "$schema" not in schema:
        return Draft202012Validator
    name = schema["$schema"]
    cls = validator_for(schema, default=None) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"the schema's $schema {name!r} names no JSON schema draft known here")
    return cls


@functools.lru_cache(maxsize=8)
def _validator(schema: str) -> Validator:
    obj = json.loads(schema)
    return _draft(obj)(obj)
