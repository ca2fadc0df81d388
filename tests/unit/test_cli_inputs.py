"""Settings and CLI arguments refused in one line before anything reaches Redis."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from plurai.broker_config.settings import Settings
from plurai.cli.main import main


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


@pytest.mark.parametrize("value", ["-5", "fast", "nan"])
@pytest.mark.parametrize("name", ["PLURAI_TOP_LANE_TPOT_MS", "PLURAI_TOP_LANE_WAIT_MS"])
def test_a_top_lane_time_that_is_no_time_is_refused(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(pydantic.ValidationError, match=name.removeprefix("PLURAI_").lower()):
        Settings()


def test_an_endless_top_lane_wait_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLURAI_TOP_LANE_WAIT_MS", "inf")  # 0 is "no bound"
    with pytest.raises(pydantic.ValidationError, match="top_lane_wait_ms"):
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
    from plurai.cli import main as cli_main

    def interrupted(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "cmd_watch", interrupted)
    assert main(["watch", "somejob01"]) == 130
    assert "Traceback" not in capsys.readouterr().err
