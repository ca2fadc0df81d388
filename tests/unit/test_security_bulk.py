"""Bulk input lines that cannot be encoded, and batch ids, checked without Redis."""

from __future__ import annotations

import pytest

from broker_config.settings import BulkSettings
from producer.bulk import store
from producer.bulk.inputs import LineError, parse_line

LIMITS = {"max_line_bytes": 10_000, "max_tokens_limit": 100, "default_max_tokens": 8}
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


@pytest.mark.parametrize(
    "bad", ["", "..", "../x", "a/b", "/abs", "a\\b", "x:lines", "a b", "é", "x" * 65, "a\n"]
)
def test_batch_ids_that_could_name_other_keys_or_paths_are_refused(bad):
    with pytest.raises(store.InvalidBatchId, match="invalid batch id"):
        store.check_id(bad)


def test_well_formed_batch_ids_pass():
    for good in ("batch_0123456789abcdef01234567", "batch_nosuch", "A-b_9"):
        assert store.check_id(good) == good


def test_running_batches_keep_their_keys_longer_than_the_window():
    bs = BulkSettings()
    assert bs.running_ttl_s > bs.completion_window_s and bs.running_ttl_s >= bs.ttl_s
