"""producer.request: the submit options checked before anything is queued (no Redis)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from plurai.broker_config.settings import Settings
from plurai.producer.request import prepare


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"priority": True}, "priority"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"deadline": "soon"}, "deadline"),
        ({"deadline": math.nan}, "deadline"),
        ({"deadline": math.inf}, "deadline"),
        ({"deadline": 1e30}, "deadline"),
        ({"idempotency_key": ""}, "idempotency_key"),
        ({"idempotency_key": 5}, "idempotency_key"),
        ({"metadata": [1]}, "metadata"),
        ({"stream": "no"}, "stream"),
        ({"special_tokens": 1}, "special_tokens"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"content_type": "text/plain"}, "content_type"),
    ],
)
def test_a_bad_submit_option_is_refused_naming_it(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named} must be"):
        prepare(Settings(), prompt="hi", **options)


def test_good_options_pass() -> None:
    sub = prepare(
        Settings(),
        prompt="hi",
        max_tokens=8,
        priority=-3,
        deadline=1767225600.5,
        idempotency_key="k",
        metadata={"a": 1},
        stream=False,
        cache_salt="t",
    )
    assert sub.job_id and sub.lane == "standard"
