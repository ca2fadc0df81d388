"""The embedded redis-server: 127.0.0.1 only, a random password, its URL file 0600."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest
import redis

from plurai.broker_config.embedded import EmbeddedRedis, running_url

from .conftest import ROOT


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def server(tmp_path: Path):
    old = os.umask(0)  # the files' mode must not depend on the umask
    try:
        s = EmbeddedRedis(tmp_path / "data" / "redis")
        url = s.start()
    finally:
        os.umask(old)
    yield s, url
    s.stop()


def test_a_connection_without_the_password_is_refused(server):
    s, url = server
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname == "127.0.0.1" and parts.password and len(parts.password) >= 24
    with redis.Redis(host="127.0.0.1", port=parts.port) as anonymous:
        with pytest.raises(redis.AuthenticationError):
            anonymous.set("k", "v")
    with socket.create_connection(("127.0.0.1", parts.port), timeout=5) as raw:
        raw.sendall(b"SET k v\r\n")
        assert raw.recv(200).startswith(b"-NOAUTH")
    with redis.Redis(host="127.0.0.1", port=parts.port, password="guess") as wrong:
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
    with redis.Redis.from_url(url) as r:
        assert r.ping() and r.set("k", "v")
        assert r.config_get("bind")["bind"] == "127.0.0.1"
        assert r.config_get("protected-mode")["protected-mode"] == "yes"


def test_the_url_file_is_private_and_running_url_reads_it(server, tmp_path):
    s, url = server
    url_file = s.data_dir / "url"
    assert url_file.read_text().strip() == url
    assert mode(url_file) == 0o600 and mode(s.data_dir / "redis.conf") == 0o600
    assert mode(s.data_dir) == 0o700
    assert running_url(tmp_path / "data") == url
    # the password is not on the server's command line, where any local user could read it
    assert s.proc is not None
    cmdline = Path(f"/proc/{s.proc.pid}/cmdline").read_bytes().decode()
    assert s.password not in cmdline and "requirepass" not in cmdline


def test_a_restart_keeps_the_url_and_a_new_server_gets_a_new_password(tmp_path):
    a = EmbeddedRedis(tmp_path / "redis")
    url = a.start()
    assert a.proc is not None
    a.proc.kill()
    a.proc.wait()
    assert a.start() == url  # clients holding the URL reconnect after a restart
    a.stop()
    assert not (tmp_path / "redis" / "url").exists()
    b = EmbeddedRedis(tmp_path / "redis")
    other = b.start()
    try:
        assert b.password != a.password and other != url
        with redis.Redis.from_url(other) as r:
            assert r.ping()
        port = urllib.parse.urlsplit(other).port
        with redis.Redis(host="127.0.0.1", port=port, password=a.password) as old:
            with pytest.raises(redis.AuthenticationError):
                old.ping()
    finally:
        b.stop()


@pytest.mark.parametrize("command", [["status", "--json"], ["status", "--once"], ["get", "x"]])
def test_a_wrong_password_is_refused_without_printing_it(server, command):
    _, url = server
    port = urllib.parse.urlsplit(url).port
    wrong = f"redis://default:s3cret@127.0.0.1:{port}/0"
    run = subprocess.run(
        [sys.executable, "-m", "plurai.cli", *command, "--url", wrong],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1 and run.stdout == ""
    assert "s3cret" not in run.stderr and "plurai: " in run.stderr
    assert "password" in run.stderr  # redis: "invalid username-password pair"
