"""Structured bulk tasks without Redis: what extract and classify requests carry at every
level, the check of a line's final output, and schemas refused when the task is built."""

from __future__ import annotations

import json
import random

import pytest

from plurai.producer.bulk import plan

WORDS = "the a river stone light north quiet letter garden winter paper machine city old".split()
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["report", "note"]},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "tags": {"type": "array", "items": {"enum": ["river", "city"]}, "maxItems": 2},
    },
    "required": ["kind", "year"],
    "additionalProperties": False,
}
EXTRACT = plan.Task("extract", max_tokens=32, schema=plan.schema_text(SCHEMA))
CLASSIFY = plan.Task("classify", max_tokens=4, labels=("river", "old city"))


def text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_extract_and_classify_requests_carry_their_constraint():
    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    rf = EXTRACT.sampling()["response_format"]
    assert rf == {"type": "json_schema", "json_schema": {"name": "extract", "schema": SCHEMA}}
    # the schema's property order is the output's: kept from the text the task holds
    assert list(rf["json_schema"]["schema"]["properties"]) == ["kind", "year", "tags"]
    assert CLASSIFY.sampling() == {
        "max_tokens": 4,
        "temperature": 0.0,
        "choice": ["river", "old city"],
    }
    for task in (plan.Task("summarize"), plan.Task("custom", template="{text}")):
        assert task.sampling() == {"max_tokens": 64, "temperature": 0.0}
    for task in (EXTRACT, CLASSIFY):  # the engine takes them as they are
        assert SamplingParams(**task.sampling()).constrained


@pytest.mark.parametrize(
    "task, context", [(EXTRACT, 512), (CLASSIFY, 128)], ids=["extract", "classify"]
)
def test_the_offline_plan_constrains_map_and_reduce_alike(tiny_model, task, context):
    from plurai.producer.bulk.drive import tokenizer

    levels: list[dict] = []

    def generate(prompts: list[str], sampling: dict) -> list[str]:
        levels.append(sampling)
        return ['{"kind":"note","year":1999}' if task is EXTRACT else "river"] * len(prompts)

    out = plan.run_offline(
        task, [text(600, 1), text(5, 2)], tokenizer(str(tiny_model)), context, generate
    )
    assert len(levels) >= 2  # the long document was reduced
    assert all(s == task.sampling() for s in levels)
    assert all(task.check(o, "stop") is None for o in out)


@pytest.mark.parametrize(
    "task, output, reason, expect",
    [
        (EXTRACT, '{"kind":"note","year":1999,"tags":["city"]}', "stop", None),
        (EXTRACT, '{"kind":"note","year":1999}', "length", None),  # it closed on the last token
        (EXTRACT, '{"kind":"note","year":19', "length", "raise max_tokens (--max-tokens, now 32)"),
        (EXTRACT, '{"kind":"note","year":1899}', "stop", "at year: 1899 is less than the minimum"),
        (EXTRACT, '{"kind":"memo","year":1999}', "stop", "at kind: 'memo' is not one of"),
        (EXTRACT, '{"year":1999}', "stop", "at the top level: 'kind' is a required property"),
        (EXTRACT, '{"kind":"note","year":1999,"x":1}', "stop", "('x' was unexpected)"),
        (EXTRACT, '{"kind":"note","year":1999,"tags":["a"]}', "stop", "at tags/0:"),
        (EXTRACT, "the river", "stop", "the output is not JSON"),
        (CLASSIFY, "old city", "stop", None),
        (CLASSIFY, "old", "length", "was cut off at max_tokens: raise max_tokens"),
        (CLASSIFY, "stone", "stop", "'stone' is not one of the labels ['river', 'old city']"),
        (CLASSIFY, "river ", "stop", "is not one of the labels"),
        (plan.Task("summarize"), "{cut", "length", None),  # free text: nothing to check
    ],
)
def test_a_final_output_is_checked_before_it_is_a_success(task, output, reason, expect):
    problem = task.check(output, reason)
    if expect is None:
        assert problem is None
    else:
        assert problem is not None and expect in problem


@pytest.mark.parametrize(
    "schema, match",
    [
        ("{oops", "is not valid JSON"),
        ("[1, 2]", "must be a JSON object, not list"),
        ("true", "must be a JSON object, not bool"),
        ('{"type": "objekt"}', "not a valid JSON schema at type: 'objekt' is not valid"),
        (
            '{"type": "object", "properties": {"a": {"maxLength": -1}}}',
            "not a valid JSON schema at properties/a/maxLength",
        ),
        (
            '{"$schema": "http://json-schema.org/draft-07/schema#", "required": "a"}',
            "not a valid JSON schema at required",
        ),
        ('{"$schema": "https://example.com/my-draft", "type": "object"}', "names no JSON schema"),
        ('{"$schema": 7, "type": "object"}', "names no JSON schema"),
        # valid JSON schemas whose keywords the workers cannot enforce
        ('{"type": "array", "uniqueItems": true}', "cannot be enforced: .*uniqueItems"),
        ('{"type": "object", "not": {"required": ["a"]}}', 'cannot be enforced: .*"not"'),
        (
            '{"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}',
            "cannot be enforced",
        ),
    ],
)
def test_a_bad_schema_is_refused_when_the_task_is_built(schema, match):
    with pytest.raises(ValueError, match=match):
        plan.Task("extract", schema=schema)


def test_schemas_of_other_drafts_are_checked_by_their_own_rules():
    draft7 = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"y": {"type": "integer"}},
        "type": "object",
        "properties": {"year": {"$ref": "#/definitions/y"}},
    }
    task = plan.Task("extract", schema=plan.schema_text(draft7))
    assert task.check('{"year":3}', "stop") is None
    assert "at year" in (task.check('{"year":"3"}', "stop") or "")


def test_a_constraint_over_the_wire_limit_is_refused():
    big = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(20)}}
    task = plan.Task("extract", schema=plan.schema_text(big))
    assert task.fits(1000) is task
    with pytest.raises(ValueError, match="PLURAI_MAX_GRAMMAR_BYTES"):
        task.fits(200)
    with pytest.raises(ValueError, match="labels"):
        plan.Task("classify", labels=tuple(f"label-{i}" for i in range(40))).fits(200)


def test_a_stored_task_that_is_no_longer_valid_fails_the_batch():
    from plurai.broker_config.settings import Settings
    from plurai.producer.bulk.store import BatchRecord
    from plurai.producer.bulk.validate import configured_model

    def problem_of(task: str) -> tuple[str, str] | None:
        return configured_model(BatchRecord("b", "validating", task=task), Settings())[1]

    task = plan.Task("extract", schema='{"type": "object"}').to_dict()
    task["schema"] = '{"type": "array", "uniqueItems": true}'  # as if written before the rule
    problem = problem_of(json.dumps(task))
    assert problem is not None and problem[0] == "invalid_task" and "uniqueItems" in problem[1]
    problem = problem_of('{"name": 5}')
    assert problem is not None and problem[0] == "invalid_task"
    big = plan.Task("classify", labels=tuple(f"label-{i}" for i in range(40))).to_dict()
    problem = configured_model(
        BatchRecord("b", "validating", task=json.dumps(big)), Settings(max_grammar_bytes=200)
    )[1]
    assert problem is not None and "PLURAI_MAX_GRAMMAR_BYTES" in problem[1]


def test_labels_must_be_non_empty_strings():
    with pytest.raises(ValueError, match="labels must be non-empty strings"):
        plan.Task("classify", labels=("river", ""))


def test_placeholders_inside_a_document_are_left_alone():
    doc = "keep {schema} and {labels} and {text} as written"
    for task in (EXTRACT, CLASSIFY):
        prompt = task.render(doc, 0)
        assert doc in prompt
        assert plan.Task.from_dict(json.loads(json.dumps(task.to_dict()))) == task


@pytest.mark.parametrize(
    "schema, match",
    [
        ("{oops", "plurai: the schema (--schema) is not valid JSON"),
        ('{"type": 5}', "plurai: the schema (--schema) is not a valid JSON schema at type"),
        ("@/nonexistent/schema.json", "plurai: cannot read the schema file /nonexistent"),
    ],
)
def test_the_cli_refuses_a_bad_schema_before_anything_is_sent(tmp_path, capsys, schema, match):
    from plurai.cli import main as cli

    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"id": "a", "text": "the river"}\n')
    argv = ["batch", "submit", str(docs), "--task", "extract", "--schema", schema]
    # an address nothing listens on: the schema is refused before any connection
    assert cli.main([*argv, "--model", str(tmp_path), "--url", "redis://127.0.0.1:9"]) == 2
    assert match in capsys.readouterr().err
