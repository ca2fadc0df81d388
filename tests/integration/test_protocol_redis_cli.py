"""The wire protocol needs no Python: submit, read the token stream and read the result
with redis-cli alone (commands as in docs/protocol.md)."""

from __future__ import annotations

import ast
import re
import subprocess

from plurai.broker_config.embedded import find_binary

ENTRY_ID = re.compile(r"\d+-\d+")
TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"')


def cli(url: str, *args: str) -> list[str]:
    """Run redis-cli; its --csv reply, flattened into strings."""
    out = subprocess.run(
        [find_binary("redis-cli"), "-u", url, "--csv", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [ast.literal_eval('b"' + t + '"').decode() for t in TOKEN.findall(out)]


def pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def test_redis_cli_client(redis_url, workers):
    workers.start(1)
    job = "cli-job-0123456789"
    body = '{"prompt": "hello from a shell", "temperature": 0, "metadata": {"from": "cli"}}'
    # the model's shard count (nil: 1 shard), then the XADD to its shard 0 (docs/protocol.md)
    assert cli(redis_url, "HGET", "plurai:models", "default")[0].startswith('{"shards":1,')
    reply = cli(
        redis_url,
        "XADD",
        "plurai:{default}:req:interactive",
        "*",
        "v",
        "2",
        "id",
        job,
        "model",
        "default",
        "prompt_tokens",
        "5",
        "max_tokens",
        "6",
        "content_type",
        "application/json",
        "body",
        body,
    )
    assert len(reply) == 1 and "-" in reply[0]  # the entry id

    # Follow the token stream until its end entry.
    last, events = "0-0", []
    while not events or events[-1]["type"] != "end":
        flat = cli(
            redis_url,
            "XREAD",
            "BLOCK",
            "30000",
            "COUNT",
            "100",
            "STREAMS",
            f"plurai:out:{{{job}}}",
            last,
        )
        assert flat, "no token stream entry within 30 s"
        # the stream name, then per entry: its id, field, value, field, value, ...
        rest = flat[1:]
        while rest:
            last, rest = rest[0], rest[1:]
            n = 0  # field names sit at even offsets; the next entry id ends this entry
            while n < len(rest) and not ENTRY_ID.fullmatch(rest[n]):
                n += 2
            events.append(pairs(rest[:n]))
            rest = rest[n:]
    assert [e["type"] for e in events][0] == "start"
    assert events[-1] == {"type": "end", "state": "completed", "finish_reason": "length"}
    text = "".join(e["text"] for e in events if e["type"] == "delta")

    record = pairs(cli(redis_url, "HGETALL", f"plurai:job:{{{job}}}"))
    assert record["state"] == "completed"
    assert record["text"] == text
    assert record["output_tokens"] == "6"
    assert record["metadata"] == '{"from": "cli"}'
    ttl = subprocess.run(
        [find_binary("redis-cli"), "-u", redis_url, "TTL", f"plurai:job:{{{job}}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert int(ttl) > 0  # records expire
