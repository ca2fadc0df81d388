"""Structured bulk tasks end to end (a Celery worker, a GPU worker, a redis-server): every
request of an extract batch carries its schema, every request of a classify batch its
labels, map and reduce alike, so every output line is JSON that validates, or a label, and
equals the same plan run offline. Outputs that cannot be successes become error lines.

The random-weight model rarely closes a free string, so every string of the schema has an
enum, a pattern or a small maxLength, and max_tokens covers the longest output it allows.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from plurai.broker_config.settings import BulkSettings
from plurai.producer.bulk import manage, plan
from plurai.producer.bulk.drive import tokenizer
from plurai.producer.client import Client

from .test_bulk import WORDS, Celery, lines, wait_done

CONTEXT = 900  # the schema alone is about 410 tokens of the prompt
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["report", "letter", "note"]},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "tags": {
            "type": "array",
            "items": {"enum": ["river", "stone", "city"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "place": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[a-z]{2}$"},
                "north": {"type": "boolean"},
            },
            "required": ["code", "north"],
            "additionalProperties": False,
        },
        "note": {"type": "string", "maxLength": 4},  # optional
    },
    "required": ["kind", "year", "tags", "place"],
    "additionalProperties": False,
}
# about 110 characters at most; 128 tokens even if `note` is written as \u escapes
EXTRACT = plan.Task("extract", max_tokens=128, schema=plan.schema_text(SCHEMA))
CLASSIFY = plan.Task("classify", max_tokens=8, labels=("river", "stone", "old city", "winter"))
CLASSIFY_CONTEXT = 192  # the batch's plan only: its prompts are short


def documents(n: int, seed: int, long_words: tuple[int, int]) -> list[str]:
    rng = random.Random(seed)
    sizes = [
        rng.randint(*long_words) if rng.random() < 0.33 else rng.randint(3, 40) for _ in range(n)
    ]
    return [" ".join(rng.choice(WORDS) for _ in range(k)) for k in sizes]


# about a third long: two chunks and a reduce (a word is about 3.4 tokens here)
EXTRACT_DOCS = documents(200, 11, (100, 170))
CLASSIFY_DOCS = documents(20, 12, (40, 100))


@pytest.fixture(scope="module")
def celery(
    module_redis_url: str, tiny_model: Path, tmp_path_factory, workers_class
) -> Iterator[Celery]:
    from plurai.broker_config.celery_app import app, configure

    gpu = workers_class(module_redis_url, tiny_model, tmp_path_factory.mktemp("gpu"))
    gpu.start(1, "--engine", f"max_model_len={CONTEXT}")
    configure(app, module_redis_url)  # this process sends the first step of each batch
    c = Celery(module_redis_url, tmp_path_factory.mktemp("celery"), tiny_model)
    c.start()
    yield c
    c.stop()
    gpu.stop()


@pytest.fixture(scope="module")
def offline(tiny_model: Path):
    """(task, texts, max_model_len) -> the offline plan's outputs (the engine the worker runs)."""
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig
    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    engine = Engine(
        EngineConfig(
            model=str(tiny_model), dtype="fp32", max_model_len=CONTEXT, kv_cache_bytes=32 << 20
        )
    )

    def run(task: plan.Task, texts: list[str], max_model_len: int) -> list[str]:
        return plan.run_offline(
            task,
            texts,
            engine.tokenizer,
            max_model_len,
            lambda prompts, sampling: [
                c.text for c in engine.generate(prompts, SamplingParams(**sampling))
            ],
        )

    yield run
    engine.close()


def submit(
    client: Client, tmp_path: Path, task: plan.Task, texts: list[str], model: Path, context: int
) -> str:
    path = tmp_path / "docs.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"doc-{i}", "text": t}) + "\n" for i, t in enumerate(texts))
    )
    return manage.create(
        client, BulkSettings(), path, task=task, model_dir=str(model), max_model_len=context
    )


def results(client: Client, batch_id: str) -> tuple[list[dict], list[dict]]:
    wait_done(client, batch_id, timeout=240)
    out, err = manage.results(client, batch_id)
    return lines(out), lines(err)


def texts_of(ok: list[dict]) -> list[str]:
    return [x["response"]["body"]["choices"][0]["text"] for x in ok]


def long_docs(task: plan.Task, texts: list[str], model: Path, context: int) -> int:
    tok = tokenizer(str(model))
    return sum(len(plan.split(task, t, 0, tok, context)) > 1 for t in texts)


def test_every_extraction_validates_and_equals_the_offline_plan(
    celery, tmp_path, tiny_model, offline
):
    assert 50 <= long_docs(EXTRACT, EXTRACT_DOCS, tiny_model, CONTEXT) <= 90
    with Client(celery.url) as client:
        batch_id = submit(client, tmp_path, EXTRACT, EXTRACT_DOCS, tiny_model, CONTEXT)
        expected = offline(EXTRACT, EXTRACT_DOCS, CONTEXT)  # while the queue runs the batch
        ok, err = results(client, batch_id)
    assert err == []
    assert [x["custom_id"] for x in ok] == [f"doc-{i}" for i in range(200)]
    validator = Draft202012Validator(SCHEMA)
    for x in ok:
        choice = x["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop"
        validator.validate(json.loads(choice["text"]))
    assert texts_of(ok) == expected


def test_every_classification_is_one_of_the_labels(celery, tmp_path, tiny_model, offline):
    assert 3 <= long_docs(CLASSIFY, CLASSIFY_DOCS, tiny_model, CLASSIFY_CONTEXT) < 20
    with Client(celery.url) as client:
        batch_id = submit(client, tmp_path, CLASSIFY, CLASSIFY_DOCS, tiny_model, CLASSIFY_CONTEXT)
        expected = offline(CLASSIFY, CLASSIFY_DOCS, CLASSIFY_CONTEXT)
        ok, err = results(client, batch_id)
    assert err == []
    got = texts_of(ok)
    assert set(got) <= set(CLASSIFY.labels)
    assert got == expected


def test_outputs_that_cannot_be_successes_become_error_lines(celery, tmp_path, tiny_model):
    texts = ["the river", "old stone city", "a letter"]
    cut = plan.Task("extract", max_tokens=12, schema=EXTRACT.schema)
    with Client(celery.url) as client:
        ok, err = results(client, submit(client, tmp_path, cut, texts, tiny_model, CONTEXT))
    assert ok == []
    assert [x["custom_id"] for x in err] == ["doc-0", "doc-1", "doc-2"]
    assert {x["error"]["code"] for x in err} == {plan.INVALID_OUTPUT}
    words = "raise max_tokens (--max-tokens, now 12)"
    assert all(words in x["error"]["message"] for x in err), err[0]
