"""Structured output in the native engine, on a random-weight factory model (which never
writes valid JSON by chance): every constrained output parses and validates, greedy and
sampled, beside unconstrained requests whose tokens do not change; a cut-off output says
length; preemption keeps the grammar's state; bad constraints are refused before any KV
block is taken."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plurai.gpu_workers.backend import AddRequest
from plurai.gpu_workers.engine.errors import ErrorCode, RequestError
from plurai.gpu_workers.engine.grammar import check_limits, spec
from plurai.gpu_workers.engine.sampling_params import SamplingParams

# strings get a bound, an enum or a pattern: a random model rarely closes a free string
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "owner": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 10},
                    "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.org$"},
                },
                "required": ["name"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "owner"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["x", "y", "z"]},
                "minItems": 2,
                "maxItems": 4,
            },
            "points": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "maxItems": 3,
            },
        },
        "required": ["tags", "points"],
        "additionalProperties": False,
    },
    "enums_numbers": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "ok": {"type": "boolean"},
            "note": {"type": ["string", "null"], "maxLength": 6},
        },
        "required": ["color", "score", "level"],
        "additionalProperties": False,
    },
    "optional_refs": {
        "type": "object",
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "properties": {
            "a": {"$ref": "#/$defs/pt"},
            "b": {"anyOf": [{"$ref": "#/$defs/pt"}, {"type": "null"}]},
            "c": {"const": "fixed"},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
}


def rf(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def engine(tiny_model):
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(model=str(tiny_model), dtype="fp32", kv_cache_bytes=16 << 20))


def test_every_schema_validates_greedy_and_sampled_beside_unconstrained(engine) -> None:
    free = [SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=0.9, seed=7)]
    ps = prompts(2 + 2 * len(SCHEMAS), seed=1)
    alone = [c.token_ids for c in engine.generate(ps[:2], free)]
    params = list(free)
    for i, schema in enumerate(SCHEMAS.values()):
        params.append(SamplingParams(max_tokens=300, response_format=rf(schema)))
        params.append(
            SamplingParams(
                max_tokens=300, temperature=1.0, top_p=0.95, seed=i, response_format=rf(schema)
            )
        )
    out = engine.generate(ps, params)
    # the unconstrained rows are untouched by the masks of their neighbours
    assert [c.token_ids for c in out[:2]] == alone
    for c, p in zip(out[2:], params[2:], strict=True):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), p.response_format["json_schema"]["schema"])
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_regex_choice_and_json_object(engine) -> None:
    pattern = r"[A-Z]{2}-[0-9]{3}( ok)?"
    choices = ["yes", "no", "yes, but", "n/a (see \\ note)"]
    params = [
        SamplingParams(max_tokens=20, regex=pattern),
        SamplingParams(max_tokens=20, regex=pattern, temperature=1.5, seed=3),
        SamplingParams(max_tokens=20, choice=choices),
        SamplingParams(max_tokens=20, choice=choices, temperature=2.0, seed=4),
        SamplingParams(
            max_tokens=400, response_format={"type": "json_object"}, temperature=0.7, seed=1
        ),
    ]
    out = engine.generate(prompts(5, seed=2), params)
    for c in out[:2]:
        assert re.fullmatch(pattern, c.text) and c.finish_reason == "stop", c.text
    for c in out[2:4]:
        assert c.text in choices and c.finish_reason == "stop", c.text
    if out[4].finish_reason == "stop":
        assert isinstance(json.loads(out[4].text), dict)
    else:
        assert out[4].finish_reason == "length"


def test_sampled_constrained_output_is_seeded(engine) -> None:
    p = SamplingParams(
        max_tokens=300, temperature=1.0, seed=11, response_format=rf(SCHEMAS["arrays"])
    )
    ps = prompts(1, seed=5)
    first = engine.generate(ps, p)[0]
    mixed = engine.generate(ps + prompts(3, seed=6), [p] + [SamplingParams(max_tokens=30)] * 3)[0]
    assert first.token_ids == mixed.token_ids


def test_cut_off_output_says_length_and_stop_strings_still_apply(engine) -> None:
    schema = SCHEMAS["nested"]
    ps = prompts(1, seed=3)
    whole = engine.generate(ps, SamplingParams(max_tokens=300, response_format=rf(schema)))[0]
    cut = engine.generate(ps, SamplingParams(max_tokens=5, response_format=rf(schema)))[0]
    assert cut.finish_reason == "length" and cut.token_ids == whole.token_ids[:5]
    stopped = engine.generate(
        ps, SamplingParams(max_tokens=300, response_format=rf(schema), stop=['"owner"'])
    )[0]
    assert stopped.finish_reason == "stop" and stopped.text == whole.text.split('"owner"')[0]


def unbounded(schema: dict) -> dict:
    """`schema` with a required number and a required string, neither bounded: a random
    model writes digits and characters until max_tokens unless steered to close them."""
    out = json.loads(json.dumps(schema))
    out["properties"] = {**out["properties"], "n": {"type": "number"}, "t": {"type": "string"}}
    out["required"] = [*out["required"], "n", "t"]
    return out


def test_outputs_are_steered_to_end_within_max_tokens(engine) -> None:
    schemas = [unbounded(s) for s in SCHEMAS.values()]
    params = []
    for i, schema in enumerate(schemas):
        params.append(SamplingParams(max_tokens=200, response_format=rf(schema)))
        params.append(
            SamplingParams(max_tokens=200, temperature=1.0, seed=i, response_format=rf(schema))
        )
    out = engine.generate(prompts(len(params), seed=8), params)
    for c, p in zip(out, params, strict=True):
        assert c.finish_reason == "stop" and len(c.token_ids) <= 200, c.text
        jsonschema.validate(json.loads(c.text), p.response_format["json_schema"]["schema"])
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_steering_acts_near_max_tokens_only(engine) -> None:
    schema = unbounded(SCHEMAS["nested"])
    ps = prompts(1, seed=9)
    start = engine.grammars.matcher(SamplingParams(response_format=rf(schema)))
    shortest = engine.grammars.finish(start, 1000)
    assert shortest is not None
    # exactly enough tokens for the completion found from the start
    tight = engine.generate(
        ps, SamplingParams(max_tokens=len(shortest), response_format=rf(schema))
    )[0]
    assert tight.finish_reason == "stop" and len(tight.token_ids) <= len(shortest)
    jsonschema.validate(json.loads(tight.text), schema)
    # one token fewer: no completion fits, and the output is the unsteered one, cut
    long = engine.generate(ps, SamplingParams(max_tokens=400, response_format=rf(schema)))[0]
    cut = engine.generate(
        ps, SamplingParams(max_tokens=len(shortest) - 1, response_format=rf(schema))
    )[0]
    assert cut.finish_reason == "length" and cut.token_ids == long.token_ids[: len(cut.token_ids)]
    # an output that ends well before max_tokens is not steered: a longer budget ends the same
    bounded = [
        engine.generate(ps, SamplingParams(max_tokens=n, response_format=rf(SCHEMAS["nested"])))[0]
        for n in (300, 900)
    ]
    assert bounded[0].finish_reason == "stop" and len(bounded[0].token_ids) < 300 - 16
    assert bounded[0].token_ids == bounded[1].token_ids


def test_preempted_constrained_requests_resume_their_grammar(tiny_model, engine_factory) -> None:
    schemas = list(SCHEMAS.values())
    params = [
        SamplingParams(
            max_tokens=300, response_format=rf(schemas[i % len(schemas)]), temperature=i % 2, seed=i
        )
        for i in range(6)
    ]
    ps = prompts(6, seed=8)
    roomy = engine_factory(tiny_model).generate(ps, params)
    tight = engine_factory(tiny_model, num_kv_blocks=14, max_num_batched_tokens=64)
    out = tight.generate(ps, params)
    assert tight.scheduler.num_preemptions > 0
    assert [c.token_ids for c in out] == [c.token_ids for c in roomy]
    for c, p in zip(out, params, strict=True):
        jsonschema.validate(json.loads(c.text), p.response_format["json_schema"]["schema"])


BAD = [
    (dict(response_format=rf({"type": "objekt"})), "Invalid type"),
    (dict(response_format=rf({"type": "object", "not": {"required": ["a"]}})), "not"),
    (dict(response_format=rf({"type": "array", "uniqueItems": True})), "uniqueItems"),
    (dict(response_format=rf({"if": {"type": "string"}, "then": {"maxLength": 3}})), "if"),
    (dict(response_format=rf({"type": "integer", "minimum": 5, "maximum": 1})), "minimum"),
    (dict(response_format=rf({"$ref": "#/$defs/missing"})), "missing"),
    (dict(regex="(unclosed"), "unclosed"),
    (dict(regex="a(?=b)"), "look-around"),
    (dict(response_format=rf({"enum": []})), "nsatisfiable"),
    (dict(regex="[a&&b]"), "no token"),  # compiles, but matches nothing
    # over MAX_REPEAT: llguidance compiles these, then failed them mid-output
    (dict(regex="a{1000000}"), "runs of up to 1000000"),
    (dict(regex="(a{1000}){1000}"), "runs of up to 1000000"),
    (dict(regex="x(ab{3,20000})"), "runs of up to 20000"),
    (
        dict(
            response_format=rf({"properties": {"s": {"type": "string", "pattern": "^a{99999}$"}}})
        ),
        "/properties/s/pattern",
    ),
    (dict(response_format=rf({"patternProperties": {"^k{20000}$": {}}})), "patternProperties"),
]


@pytest.mark.parametrize(("fields", "reason"), BAD, ids=[b[1] for b in BAD])
def test_bad_constraints_are_refused_before_any_block(engine, fields, reason) -> None:
    with pytest.raises(RequestError) as e:
        engine.add(AddRequest("bad", prompt="hello", params=SamplingParams(**fields)))
    assert e.value.code == ErrorCode.INVALID_PARAMS and reason in str(e.value)
    assert "bad" not in engine.seqs and engine.blocks.num_free == engine.blocks.num_blocks


def test_repetition_limits_count_nested_groups_and_skip_literal_braces() -> None:
    ok = [
        r"\d{3}-\d{4}",
        r"(\d{1,3}\.){3}\d{1,3}",
        "(a{100}){100}",  # 10,000: the limit itself
        "a{2,}b*c+",  # unbounded runs cost nothing
        r"\{99999}",  # an escaped brace is a literal
        "[{]99999}",
        r"\x{41}{5}",
        "[]{]{9999}",  # ] first in a class is a literal
        "(?i)(a|b){10000}",
    ]
    for pattern in ok:
        assert check_limits("regex", pattern) is None, pattern
    assert "10100" in check_limits("regex", "((a{10}){10}){101}")
    assert "10001" in check_limits("regex", "x|[^]a]{10001}")
    assert "1000000000" in check_limits("regex", "a{" + "9" * 5000 + "}")  # no int() error
    # a "pattern" that is data (const, enum, default, examples) is no regex
    schema = {
        "type": "object",
        "default": {"pattern": "a{99999}"},
        "enum": [{"pattern": "b{99999}"}],
    }
    assert check_limits("json", json.dumps(schema)) is None
    assert check_limits("json", json.dumps({"anyOf": [{"pattern": "a{99999}"}]})) is not None


def test_a_regex_at_the_repetition_limit_is_served(engine) -> None:
    before = engine.grammars.compiled
    outs = engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=8, regex="(a{100}){100}", temperature=0.0)
    )
    assert re.fullmatch("a*", outs[0].text) and len(outs[0].token_ids) == 8
    assert engine.grammars.compiled == before + 1


SHAPES = [
    dict(response_format={"type": "xml"}),
    dict(response_format={"type": "json_schema"}),
    dict(response_format={"type": "json_schema", "json_schema": {"schema": "{}"}}),
    dict(response_format={"type": "json_object", "json_schema": {"schema": {}}}),
    dict(response_format={"type": "json_object", "strict": True}),
    dict(response_format="json"),
    dict(regex=""),
    dict(regex=5),
    dict(choice=[]),
    dict(choice=["a", ""]),
    dict(choice="a"),
    dict(regex="a", choice=["a"]),
    dict(response_format={"type": "json_object"}, regex="a"),
]


@pytest.mark.parametrize("fields", SHAPES, ids=[str(s)[:50] for s in SHAPES])
def test_malformed_constraint_fields_are_invalid_params(fields) -> None:
    with pytest.raises(RequestError) as e:
        SamplingParams(**fields)
    assert e.value.code == ErrorCode.INVALID_PARAMS


def test_text_format_is_no_constraint_and_choices_are_literal() -> None:
    assert SamplingParams(response_format={"type": "text"}).response_format is None
    assert spec(SamplingParams()) is None
    kind, pattern = spec(SamplingParams(choice=["a.b", "c|d", "(e)*", " x\ty"]))
    assert kind == "regex"
    # the escaped alternation matches each choice as written, and nothing looser
    for c in ["a.b", "c|d", "(e)*", " x\ty"]:
        assert re.fullmatch(pattern, c)
    assert not re.fullmatch(pattern, "axb") and not re.fullmatch(pattern, "c")


def test_compiled_grammars_are_cached_by_spec(engine) -> None:
    before = engine.grammars.compiled
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    for i in range(3):
        engine.add(
            AddRequest(
                f"c{i}",
                prompt="x",
                params=SamplingParams(max_tokens=20, response_format=rf(schema)),
            )
        )
    assert engine.grammars.compiled == before + 1
    while engine.has_unfinished():
        engine.step()


def test_a_matcher_failing_mid_output_fails_only_its_request(engine) -> None:
    engine.add(AddRequest("fine", token_ids=[5, 6, 7], params=SamplingParams(max_tokens=8)))
    engine.add(
        AddRequest(
            "broken", token_ids=[5, 6, 7], params=SamplingParams(max_tokens=8, choice=["ab"])
        )
    )
    engine.seqs["broken"].matcher.consume_token(0)  # not allowed: the matcher is now in error
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs["broken"].finish_reason == "error" and "GrammarError" in outs["broken"].error
    assert outs["fine"].finish_reason == "length"
    assert engine.blocks.num_free == engine.blocks.num_blocks


REGEX_PARTS = st.sampled_from(
    ["a", "b", "0", "[a-c]", "[^x]", "(", ")", "|", "*", "+", "?", "{2}", "{1,3}", ".", "\\d", "\\"]
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(parts=st.lists(REGEX_PARTS, min_size=1, max_size=8))
def test_any_regex_is_served_or_refused_never_crashes(engine, parts) -> None:
    pattern = "".join(parts)
    try:
        engine.add(
            AddRequest(
                "fuzz", token_ids=[5, 6, 7], params=SamplingParams(max_tokens=6, regex=pattern)
            )
        )
    except RequestError as e:
        assert e.code == ErrorCode.INVALID_PARAMS and "regex" in str(e)
        return
    finished = None
    while engine.has_unfinished():
        finished = [o for o in engine.step() if o.finished] or finished
    assert finished and finished[0].finish_reason in ("stop", "length")
    assert engine.blocks.num_free == engine.blocks.num_blocks
