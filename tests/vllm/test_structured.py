"""Structured output on the vLLM backend: response_format, regex and choice enforced by
vLLM's llguidance backend without JSON whitespace, in a batch with unconstrained requests;
every output also passes the native engine's grammar; bad constraints refused at `add`."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from plurai.gpu_workers.backend import AddRequest, RequestError
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from tests.vllm.test_backend import run

pytest.importorskip("vllm", reason="runs in vLLM's environment: make test-vllm")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,5}$"},
            "minItems": 1,
            "maxItems": 3,
        },
        "owner": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                "vip": {"type": "boolean"},
            },
            "required": ["id", "vip"],
            "additionalProperties": False,
        },
        "note": {"type": "string", "maxLength": 6},  # optional
    },
    "required": ["name", "age", "kind", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"(red|green|blue)-[0-9]{2,3}"
CHOICES = ["yes", "no", 'say "hi"', "a\\b", "two\nlines", "ünï", "a.b*"]
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "schema": {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
}
MAX_TOKENS = 200  # more than any output the schema allows takes, in this 2048-token vocab


def no_whitespace_outside_strings(text: str) -> bool:
    in_string = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif in_string:
            escaped = ch == "\\"
            in_string = ch != '"'
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            return False
    return True


def test_engine_compiles_with_llguidance_without_json_whitespace(backend) -> None:
    config = backend.engine.vllm_config.structured_outputs_config
    assert (config.backend, config.disable_any_whitespace) == ("guidance", True)


def test_constrained_and_free_requests_in_one_batch(backend) -> None:
    prompts = ["the quick brown fox", "a list of pets:", "tell me"]
    free = {"prompt": prompts[0], "params": {"max_tokens": 16, "ignore_eos": True}}
    alone = run(backend, {"free": free})["free"]
    requests: dict[str, dict] = {"free": free}
    requests["free-sampled"] = {
        "prompt": prompts[1],
        "params": {"max_tokens": 16, "temperature": 1.0, "seed": 3, "ignore_eos": True},
    }
    for kind, constraint in CONSTRAINTS.items():
        requests[f"{kind}-greedy"] = {
            "prompt": prompts[0],
            "params": {"max_tokens": MAX_TOKENS, **constraint},
        }
        for i, seed in enumerate((1, 2, 3)):
            requests[f"{kind}-seed{seed}"] = {
                "prompt": prompts[i],
                "params": {
                    "max_tokens": MAX_TOKENS,
                    "temperature": 1.0,
                    "seed": seed,
                    **constraint,
                },
            }
    # a finished grammar ends the output even where EOS is ignored, as in the native engine
    requests["choice-ignore-eos"] = {
        "prompt": prompts[2],
        "params": {"max_tokens": MAX_TOKENS, "ignore_eos": True, "choice": CHOICES},
    }
    outs = run(backend, requests)

    # the unconstrained rows are untouched by the masks of their neighbours
    assert [o.new_token_ids for o in outs["free"]] == [o.new_token_ids for o in alone]
    assert outs["free"][-1].finish_reason == "length"
    assert outs["free-sampled"][-1].num_output_tokens == 16

    eos = backend.prompts.tokenizer.eos_token_id
    texts: dict[str, set[str]] = {kind: set() for kind in CONSTRAINTS}
    for rid, req in requests.items():
        if rid.startswith("free"):
            continue
        kind = rid.split("-")[0]
        text = "".join(o.text_delta for o in outs[rid])
        ids = [t for o in outs[rid] for t in o.new_token_ids]
        assert outs[rid][-1].finish_reason == "stop", (rid, text)
        texts[kind].add(text)
        if kind == "schema":
            value = json.loads(text)
            jsonschema.validate(value, SCHEMA)
            assert no_whitespace_outside_strings(text), text
            assert list(value)[:3] == ["name", "age", "kind"]  # the schema's key order
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES
        # vLLM ends a complete output with EOS; the tokens before it pass the native grammar
        assert ids[-1] == eos
        matcher = backend.grammars.matcher(SamplingParams(**req["params"]))
        assert matcher.consume_tokens(ids[:-1]) and matcher.is_accepting(), (rid, text)
    # sampling explores the grammar rather than repeating one output
    assert all(len(t) >= 2 for t in texts.values()), texts


def test_json_object(backend) -> None:
    params = {"max_tokens": MAX_TOKENS, "response_format": {"type": "json_object"}}
    out = run(backend, {"obj": {"prompt": "a list of pets:", "params": params}})["obj"]
    text = "".join(o.text_delta for o in out)
    assert out[-1].finish_reason == "stop" and isinstance(json.loads(text), dict), text


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}


BAD = {
    "not": (
        {"response_format": schema_format({"not": {"type": "string"}})},
        r'invalid JSON schema: Unimplemented keys: \["not"\]$',
    ),
    "if/then": (
        {
            "response_format": schema_format(
                {
                    "type": "object",
                    "if": {"properties": {"a": {"const": 1}}},
                    "then": {"required": ["b"]},
                }
            )
        },
        r'invalid JSON schema: Unimplemented keys: \["if", "then"\]$',
    ),
    "uniqueItems": (
        {"response_format": schema_format({"type": "array", "uniqueItems": True})},
        r'invalid JSON schema: Unimplemented keys: \["uniqueItems"\]$',
    ),
    "unknown type": (
        {"response_format": schema_format({"type": "nope"})},
        "invalid JSON schema: Invalid type: nope$",
    ),
    "regex unclosed group": ({"regex": "a(b"}, "invalid regex: .*unclosed group"),
    "regex lookaround": ({"regex": r"\bword"}, "invalid regex: .*lookarounds not supported"),
    # vLLM's own check passes this one; its matcher then errs and ends the output empty
    "regex matching nothing": (
        {"regex": "[a&&b]"},
        "invalid regex: no token of this model's vocabulary can start an output it allows$",
    ),
    "two constraints": (
        {"regex": "a", "choice": ["a"]},
        r"give at most one of response_format, regex and choice; got \['regex', 'choice'\]$",
    ),
    "schema not an object": (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}},
        'response_format of type json_schema needs "json_schema"',
    ),
    "empty choice": ({"choice": []}, "choice must be a non-empty list of non-empty strings$"),
}


@pytest.mark.parametrize(("params", "reason"), list(BAD.values()), ids=list(BAD))
def test_bad_constraint_refused_at_add(backend, params: dict, reason: str) -> None:
    """`reason`: a pattern the message matches from its start."""
    with pytest.raises(RequestError) as e:
        backend.add(AddRequest("bad", prompt="hi", params={"max_tokens": 8, **params}))
    assert e.value.code == "invalid_params"
    assert re.match(reason, e.value.message) and "\n" not in e.value.message, e.value.message
    assert not backend.has_unfinished() and backend.engine.get_num_unfinished_requests() == 0
    # the engine serves on
    out = run(backend, {"after": {"prompt": "hi", "params": {"max_tokens": 2, "regex": "[0-9]+"}}})
    assert "".join(o.text_delta for o in out["after"]).isdigit()
