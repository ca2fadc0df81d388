"""Bulk input lines (producer/bulk/inputs.py, manage's endpoint check) that cannot be
encoded or name the other endpoint, checked without Redis."""

from __future__ import annotations

import json

import pytest

from plurai.producer.bulk import manage
from plurai.producer.bulk.inputs import LineError, parse_line

LIMITS = {"max_line_bytes": 10_000, "max_tokens_limit": 100, "default_max_tokens": 8}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TAIL = '"url": "/v1/completions", "body": {"prompt": "the river"}}'


def error(raw: str, documents: bool = False) -> LineError:
    with pytest.raises(LineError) as e:
        parse_line(raw, 3, documents=documents, **LIMITS)
    return e.value


@pytest.mark.parametrize(
    ("head", "what"),
    [
        ('{"custom_id": "\\ud800", ', "not valid Unicode"),
        ('{"custom_id": "ok\\udfffok", ', "not valid Unicode"),
        ('{"custom_id": 17, ', "it is a int"),
        ('{"custom_id": {"a": 1}, ', "it is a dict"),
        ('{"custom_id": "", ', "it is empty"),
    ],
)
def test_a_custom_id_that_cannot_be_encoded_is_an_error_without_it(head, what):
    e = error(head + TAIL)
    assert e.code == "invalid_custom_id" and e.custom_id is None
    assert what in e.message and e.message.startswith("line 3: ")
    e.message.encode("utf-8")  # the error line itself can be stored


def test_a_document_id_is_checked_the_same_way():
    e = error('{"id": "\\ud83d", "text": "x"}', documents=True)
    assert e.code == "invalid_custom_id" and e.custom_id is None


def test_any_other_string_that_cannot_be_encoded_is_an_error_with_the_id():
    for raw in (
        '{"custom_id": "p", "url": "/v1/completions", "body": {"prompt": "a\\ud800"}}',
        '{"custom_id": "k", "url": "/v1/completions", "body": {"prompt": "a", "\\udc80": 1}}',
        '{"custom_id": "m", "url": "/v1/chat/completions", "body": {"messages": '
        '[{"role": "user", "content": "\\udbff"}]}}',
    ):
        e = error(raw)
        assert e.code == "invalid_request" and e.custom_id in ("p", "k", "m")
    e = error('{"id": "d", "text": "\\udfff"}', documents=True)
    assert e.code == "invalid_request" and e.custom_id == "d"
    # a valid pair of surrogate escapes is one character, and fine
    ok = parse_line('{"custom_id": "\\ud83d\\ude00", ' + TAIL, 1, documents=False, **LIMITS)
    assert ok["custom_id"] == "\N{GRINNING FACE}"


def test_lines_naming_the_other_endpoint():
    def line(url, cid="x"):
        return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {}})

    check = manage._other_endpoint
    assert check(line(CHAT), 1, CHAT, 4096) is None
    cid, code, message = check(line(COMPLETIONS), 7, CHAT, 4096)
    assert (cid, code) == ("x", "invalid_url") and message.startswith("line 7: ")
    # what parse_line refuses for another reason is left to it
    for other in (
        line("/v1/embeddings"),
        line(COMPLETIONS, cid=""),
        line(COMPLETIONS, cid=5),
        "{not json",
        "[" * 4000,  # nested past the parser's recursion limit
        "[]",
        line(COMPLETIONS, cid="y" * 5000),
    ):
        assert check(other, 1, CHAT, 4096) is None
