"""SDK and CLI input checks that need no Redis: submit options, settings, CLI arguments."""

from __future__ import annotations

import math
from typing import Any

import pydantic
import pytest

from broker_config.settings import Settings
from cli.main import main
from producer.request import prepare


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


@pytest.mark.parametrize(
    "name", ["PLURAI_QUEUED_TTL_S", "PLURAI_RESULT_TTL_S", "PLURAI_IDEMPOTENCY_TTL_S"]
)
def test_a_ttl_of_zero_is_refused(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # EXPIRE 0 deletes the key: a queued job's record would vanish as it is written
    monkeypatch.setenv(name, "0")
    with pytest.raises(pydantic.ValidationError, match=name.removeprefix("PLURAI_").lower()):
        Settings()


def test_a_stream_maxlen_of_zero_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLURAI_STREAM_MAXLEN", "0")
    with pytest.raises(pydantic.ValidationError, match="stream_maxlen"):
        Settings()


URL = ["--url", "redis://127.0.0.1:1/0"]  # nothing is read from it


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["submit", "hi", "--param", "top_k"], "--param takes NAME=JSON"),
        (["submit", "hi", "--param", "temperature=hot"], "--param temperature: not JSON"),
        (["submit", "not json", "--messages"], "--messages: not JSON"),
        (["submit", "hi", "--metadata", "{bad"], "--metadata: not JSON"),
    ],
)
def test_cli_bad_submit_arguments_get_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv + URL) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


@pytest.mark.parametrize("wait", ["nan", "-1"])
def test_cli_refuses_a_wait_that_is_no_number_of_seconds(
    wait: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["get", "somejob1234", "--wait", wait, *URL])
    assert e.value.code == 2
    assert "expected a number of seconds >= 0" in capsys.readouterr().err


def test_cli_names_a_bad_setting_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PLURAI_MAX_QUEUED_PER_LANE", "lots")
    assert main(["get", "somejob1234", *URL]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plurai: bad setting: PLURAI_MAX_QUEUED_PER_LANE:") and "'lots'" in err
    assert err.count("\n") == 1


def test_cli_says_when_the_config_file_is_missing(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PLURAI_CONFIG", str(tmp_path / "none.toml"))
    assert main(["get", "somejob1234", *URL]) == 2
    assert "none.toml: no such file" in capsys.readouterr().err


def test_cli_an_unreachable_cluster_is_one_line_without_its_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["get", "somejob1234", "--url", "redis+cluster://u:sekret@127.0.0.1:1/"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("plurai: Redis error:") and "sekret" not in err


def test_cli_ctrl_c_while_watching_ends_quietly(monkeypatch, capsys) -> None:
    """Ctrl-C during `plurai watch` (or `submit --stream`): exit 130, no traceback."""
    import cli.main

    def interrupted(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.main, "cmd_watch", interrupted)
    assert main(["watch", "somejob01"]) == 130
    assert "Traceback" not in capsys.readouterr().err
