"""Bulk batches without Redis: input validation, token-bounded chunks, the reduce plan."""

from __future__ import annotations

import json
import random

import pytest

from plurai.producer.bulk import finalize, plan
from plurai.producer.bulk.inputs import LineError, parse_line
from plurai.results.records import Choice

WORDS = "the a river stone light north quiet letter garden winter paper machine city old".split()


@pytest.fixture(scope="module")
def tok(tiny_model):
    from plurai.producer.bulk.drive import tokenizer

    return tokenizer(str(tiny_model))


def text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.mark.parametrize("name", ["summarize", "extract", "classify", "custom"])
def test_chunks_fit_the_context_and_keep_every_character(tok, name):
    task = plan.Task(
        name,
        max_tokens=8,
        schema='{"type":"object"}',
        labels=("a", "b"),
        template="Read: {text}\nAnswer:",
    )
    doc = text(400)
    prompts = plan.split(task, doc, 0, tok, 128)
    assert len(prompts) > 3
    assert all(len(tok(p).input_ids) <= 128 - 8 for p in prompts)
    prefix, suffix = task.render("\0", 0).split("\0")
    assert "".join(p[len(prefix) : len(p) - len(suffix)] for p in prompts) == doc
    assert plan.split(task, text(5), 0, tok, 128) == [task.render(text(5), 0)]


def test_reduce_runs_level_by_level_until_one_prompt(tok):
    task = plan.Task("summarize", max_tokens=8)
    seen: list[int] = []

    def generate(prompts: list[str], sampling: dict) -> list[str]:
        assert sampling == task.sampling()
        seen.append(len(prompts))
        return [p.split()[-2] for p in prompts]  # a short output per prompt

    docs = [text(600, 1), text(10, 2)]
    out = plan.run_offline(task, docs, tok, 128, generate)
    assert len(out) == 2 and all(out)
    assert len(seen) >= 2 and seen[-1] == 1  # the long document needed reduce levels


def test_context_too_small_for_the_task_is_an_error(tok):
    with pytest.raises(ValueError, match="too few to split"):
        plan.split(plan.Task("summarize", max_tokens=60), text(300), 0, tok, 80)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": "translate"}, "unknown task"),
        ({"name": "extract"}, "schema"),
        ({"name": "classify"}, "labels"),
        ({"name": "custom", "template": "no placeholder"}, "{text}"),
    ],
)
def test_task_options_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan.Task(**kwargs)


def parse(obj: object, documents: bool = False, **kw) -> dict:
    raw = obj if isinstance(obj, str) else json.dumps(obj)
    opts = {"max_line_bytes": 1000, "max_tokens_limit": 100, "default_max_tokens": 20} | kw
    return parse_line(raw, 7, documents=documents, **opts)


def test_openai_lines_become_submit_options():
    chat = parse(
        {
            "custom_id": "x",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 5,
                "stop": "\n",
                "temperature": 0.5,
            },
        }
    )
    assert chat["kind"] == "chat" and chat["model"] == "m"
    assert chat["options"] == {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "stop": ["\n"],
        "temperature": 0.5,
    }
    comp = parse({"custom_id": "y", "url": "/v1/completions", "body": {"prompt": "p"}})
    # OpenAI's defaults (temperature 1, 16 tokens for a completion), as the body sent live gets
    assert comp["options"] == {"prompt": "p", "max_tokens": 16, "temperature": 1.0}
    assert parse({"id": "d", "text": "words"}, documents=True)["kind"] == "doc"


@pytest.mark.parametrize(
    "line, code",
    [
        ("{oops", "invalid_json"),
        ("[1, 2]", "invalid_request"),
        ({"url": "/v1/completions", "body": {"prompt": "p"}}, "missing_custom_id"),
        ({"custom_id": "a", "url": "/v1/embeddings", "body": {}}, "invalid_url"),
        ({"custom_id": "a", "method": "GET", "url": "/v1/completions"}, "invalid_method"),
        ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": ""}}, "invalid_body"),
        (
            {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "p", "tools": []}},
            "invalid_body",
        ),
        (
            {
                "custom_id": "a",
                "url": "/v1/completions",
                "body": {"prompt": "p", "max_tokens": 101},
            },
            "max_tokens_over_limit",
        ),
        (
            {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x" * 2000}},
            "line_too_large",
        ),
    ],
)
def test_bad_lines_are_refused_with_a_code_and_the_line_number(line, code):
    with pytest.raises(LineError) as e:
        parse(line)
    assert e.value.code == code
    assert "line 7" in e.value.message


def test_output_and_error_lines_have_the_openai_shape():
    req = {"custom_id": "c1", "kind": "chat", "model": "m"}
    ok = json.loads(
        finalize.ok_line(
            "b",
            0,
            req,
            choices=[Choice(0, "hi", [7], "stop")],
            usage=(3, 1),
            request_id="J",
            created_s=5,
        )
    )
    assert ok["custom_id"] == "c1" and ok["error"] is None
    assert ok["response"]["status_code"] == 200
    body = ok["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    err = json.loads(finalize.error_line("b", 1, None, "invalid_json", "line 2: bad"))
    assert err["response"] is None and err["error"]["code"] == "invalid_json"
    assert ok["id"] != err["id"] and ok["id"].startswith("batch_req_")
    two = [Choice(0, "a", [1], "stop"), Choice(1, "b", [2, 3], "length")]
    line = finalize.ok_line(
        "b",
        2,
        {**req, "kind": "completion"},
        choices=two,
        usage=(3, 3),
        request_id="K",
        created_s=5,
    )
    body = json.loads(line)["response"]["body"]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "a", "stop"),
        (1, "b", "length"),
    ]
