"""The gateway's Files and Batches APIs with the official `openai` client: a real gateway
process, a real Celery worker, a real GPU worker, a real redis-server. A 200-line batch
through /v1/files and /v1/batches gives the same answers as the same file through
`plurai batch submit`; bad lines land in the error file; a cancelled batch accounts for
every line; unknown ids are 404s, bad uploads 400s and 413s; tenants see only their own."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from plurai.broker_config import keys
from plurai.gateway import uploads
from plurai.producer.bulk import manage, store
from plurai.producer.client import Client

from .test_bulk import Celery
from .test_gateway import Gateway

CHAT = "/v1/chat/completions"
WORDS = "river stone light north quiet letter garden winter paper machine city".split()


class Stack:
    def __init__(self, url: str, gateway: Gateway) -> None:
        self.url, self.gateway = url, gateway
        self.api = openai.OpenAI(base_url=gateway.base + "/v1", api_key="unused", max_retries=0)
        self.r = redis.Redis.from_url(url)


@pytest.fixture(scope="module")
def stack(module_redis_url, tiny_model, tmp_path_factory, workers_class) -> Iterator[Stack]:
    from plurai.broker_config.celery_app import app, configure

    logs = tmp_path_factory.mktemp("logs")
    w = workers_class(module_redis_url, tiny_model, logs)
    w.start(1, "--engine", "max_model_len=256")
    configure(app, module_redis_url)  # the CLI path of this process sends its first step
    # a cancel is seen within 0.2 s, long before a batch of the cancel test ends
    celery = Celery(module_redis_url, logs, tiny_model, env={"PLURAI_BATCH_LOOK_S": "0.2"})
    celery.start()
    gw = Gateway(module_redis_url, logs / "gateway.log")
    yield Stack(module_redis_url, gw)
    gw.stop()
    celery.stop()
    w.stop()


def chat_line(i: int, max_tokens: int = 6, url: str = CHAT) -> dict:
    words = " ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 2 + i % 5))
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": url,
        "body": {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"Tell me about the {words}."}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    }


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def submit(s: Stack, path: Path, **extra) -> openai.types.Batch:
    with open(path, "rb") as f:
        uploaded = s.api.files.create(file=f, purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == path.stat().st_size
    return s.api.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h", **extra
    )


def wait_batch(s: Stack, batch_id: str, timeout: float = 120) -> openai.types.Batch:
    end = time.monotonic() + timeout
    while True:
        b = s.api.batches.retrieve(batch_id)
        if b.status in store.TERMINAL:
            return b
        assert time.monotonic() < end, f"batch {batch_id} still {b.status}"
        time.sleep(0.2)


def by_id(text: str) -> dict[str, dict]:
    return {x["custom_id"]: x for x in map(json.loads, text.splitlines())}


def answer(line: dict) -> tuple:
    body = line["response"]["body"]
    choice = body["choices"][0]
    return choice["message"]["content"], choice["finish_reason"], body["usage"]


def test_batch_of_200_equals_the_cli_path(stack: Stack, tmp_path: Path, capsys) -> None:
    from plurai.cli import main as cli

    path = write_jsonl(tmp_path / "in.jsonl", [chat_line(i) for i in range(200)])
    created = submit(stack, path, metadata={"run": "api"})
    # the answer reads the batch as it is by then: its Celery task may have started already
    assert created.status in ("validating", "in_progress") and created.endpoint == CHAT
    assert created.metadata == {"run": "api"} and created.request_counts.total == 200
    assert cli.main(["batch", "submit", str(path), "--url", stack.url]) == 0
    cli_id = capsys.readouterr().out.strip()

    b = wait_batch(stack, created.id)
    assert b.status == "completed" and b.error_file_id is None
    assert b.request_counts.model_dump() == {"total": 200, "completed": 200, "failed": 0}
    assert b.in_progress_at and b.completed_at and b.created_at <= b.completed_at
    assert b.usage.output_tokens > 0
    output = stack.api.files.content(b.output_file_id).text
    assert stack.api.files.retrieve(b.output_file_id).bytes == len(output.encode())
    assert stack.api.files.content(b.input_file_id).content == path.read_bytes()
    with Client(stack.url) as client:
        end = time.monotonic() + 120
        while manage.info(client, cli_id)["status"] not in store.TERMINAL:
            assert time.monotonic() < end, "the CLI batch did not finish"
            time.sleep(0.2)
        cli_out, cli_err = manage.results(client, cli_id)
    assert cli_err == ""
    got, want = by_id(output), by_id(cli_out)
    assert list(got) == [f"req-{i}" for i in range(200)]  # input order
    assert {k: answer(v) for k, v in got.items()} == {k: answer(v) for k, v in want.items()}
    line = got["req-0"]
    assert line["error"] is None and line["response"]["status_code"] == 200
    assert line["response"]["body"]["object"] == "chat.completion"
    assert sum(answer(x)[2]["completion_tokens"] for x in got.values()) == b.usage.output_tokens


def test_bad_lines_go_to_the_error_file(stack: Stack, tmp_path: Path) -> None:
    rows = [
        chat_line(0),
        "{not json",
        chat_line(1, url="/v1/completions"),  # not the batch's endpoint
        {k: v for k, v in chat_line(2).items() if k != "custom_id"},
        chat_line(3),
        chat_line(0),  # its custom_id again
        {**chat_line(4), "body": {**chat_line(4)["body"], "max_tokens": 10**9}},
        chat_line(5),
    ]
    b = wait_batch(stack, submit(stack, write_jsonl(tmp_path / "bad.jsonl", rows)).id)
    assert b.status == "completed"
    assert b.request_counts.model_dump() == {"total": 8, "completed": 3, "failed": 5}
    ok = by_id(stack.api.files.content(b.output_file_id).text)
    assert list(ok) == ["req-0", "req-3", "req-5"]
    errors = [json.loads(x) for x in stack.api.files.content(b.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        (None, "invalid_json"),
        ("req-1", "invalid_url"),
        (None, "missing_custom_id"),
        ("req-0", "duplicate_custom_id"),
        ("req-4", "max_tokens_over_limit"),
    ]
    assert all(e["response"] is None and e["id"].startswith("batch_req_") for e in errors)
    assert "line 3" in errors[1]["error"]["message"]
    f = stack.api.files.retrieve(b.error_file_id)
    assert f.purpose == "batch_output" and f.filename == f"{b.id}_errors.jsonl"


def test_structured_lines_parse(stack: Stack, tmp_path: Path) -> None:
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "city": {"enum": ["Oslo", "Lima", "Kyoto"]},
            "rank": {"type": "integer", "minimum": 1, "maximum": 5},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}

    def line(i: int, **extra) -> dict:
        row = chat_line(i, max_tokens=80)
        return {**row, "body": {**row["body"], **extra}}

    rows = [line(i, response_format=rf, temperature=i % 2) for i in range(12)]
    rows += [line(12, choice=["red", "green"]), line(13, regex="[0-9]{2}:[0-9]{2}")]
    rows += [line(14, response_format={**rf, "json_schema": {"schema": {"uniqueItems": True}}})]
    b = wait_batch(stack, submit(stack, write_jsonl(tmp_path / "structured.jsonl", rows)).id)
    assert b.request_counts.model_dump() == {"total": 15, "completed": 14, "failed": 1}
    got = by_id(stack.api.files.content(b.output_file_id).text)
    for i in range(12):
        content, reason, _ = answer(got[f"req-{i}"])
        assert reason == "stop", content
        jsonschema.validate(json.loads(content), schema)
    assert answer(got["req-12"])[0] in ("red", "green")
    assert re.fullmatch("[0-9]{2}:[0-9]{2}", answer(got["req-13"])[0])
    (error,) = [json.loads(x) for x in stack.api.files.content(b.error_file_id).text.splitlines()]
    assert error["custom_id"] == "req-14" and error["error"]["code"] == "invalid_params"
    assert "uniqueItems" in error["error"]["message"]


def test_lines_of_several_choices(stack: Stack, tmp_path: Path) -> None:
    def line(i: int, **extra) -> dict:
        row = chat_line(i, max_tokens=5)
        return {**row, "body": {**row["body"], **extra}}

    rows = [line(0, n=3), line(1, n=2, temperature=1.0, seed=4), line(2, n=17)]
    rows.append({**line(0), "custom_id": "req-3"})  # the first line's, of one choice
    b = wait_batch(stack, submit(stack, write_jsonl(tmp_path / "choices.jsonl", rows)).id)
    assert b.request_counts.model_dump() == {"total": 4, "completed": 3, "failed": 1}
    got = by_id(stack.api.files.content(b.output_file_id).text)
    greedy, seeded, one = (got[f"req-{i}"]["response"]["body"] for i in (0, 1, 3))
    assert [c["index"] for c in greedy["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in greedy["choices"]} == {answer(got["req-3"])[0]}
    assert [c["index"] for c in seeded["choices"]] == [0, 1] and len(one["choices"]) == 1
    # the prompt counted once, the output of every choice
    assert greedy["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert greedy["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    (error,) = [json.loads(x) for x in stack.api.files.content(b.error_file_id).text.splitlines()]
    assert error["custom_id"] == "req-2" and error["error"]["code"] == "n_over_limit"


def test_cancel_a_running_batch(stack: Stack, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "long.jsonl", [chat_line(i, max_tokens=96) for i in range(200)])
    b = submit(stack, path)
    end = time.monotonic() + 60
    while (b := stack.api.batches.retrieve(b.id)).request_counts.completed < 1:
        assert b.status in ("validating", "in_progress"), b.status
        assert time.monotonic() < end, "no line finished"
        time.sleep(0.05)
    cancelling = stack.api.batches.cancel(b.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    b = wait_batch(stack, b.id)
    assert b.status == "cancelled" and b.cancelled_at and b.cancelling_at
    counts = b.request_counts
    assert counts.total == 200 and counts.completed + counts.failed == 200
    assert 1 <= counts.completed < 200
    ok = stack.api.files.content(b.output_file_id).text.splitlines()
    errors = [json.loads(x) for x in stack.api.files.content(b.error_file_id).text.splitlines()]
    assert len(ok) == counts.completed and len(errors) == counts.failed
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    ids = sorted(json.loads(x)["custom_id"] for x in ok) + [e["custom_id"] for e in errors]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(200))
    assert stack.api.batches.cancel(b.id).status == "cancelled"  # again: no change


def test_unknown_ids_are_404(stack: Stack, tmp_path: Path) -> None:
    api = stack.api
    calls = [
        lambda: api.batches.retrieve("batch_nosuch"),
        lambda: api.batches.cancel("batch_nosuch"),
        lambda: api.batches.retrieve("no such!"),
        lambda: api.files.retrieve("file-" + "0" * 24),
        lambda: api.files.content("file-" + "0" * 24),
        lambda: api.files.content("file-batch_nosuch-output"),
        lambda: api.files.delete("file-nosuch"),
        lambda: api.batches.create(
            input_file_id="file-" + "0" * 24, endpoint=CHAT, completion_window="24h"
        ),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] in ("batch_not_found", "file_not_found")
    # a running batch has no output file yet
    stack.r.hset(keys.batch("batch_running"), mapping={"status": "in_progress", "total": 1})
    try:
        with pytest.raises(openai.NotFoundError):
            api.files.content("file-batch_running-output")
        assert api.batches.retrieve("batch_running").output_file_id is None
    finally:
        stack.r.delete(keys.batch("batch_running"))
    # a deleted file is gone
    f = api.files.create(file=("x.jsonl", json.dumps(chat_line(0)).encode()), purpose="batch")
    assert api.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        api.files.retrieve(f.id)
    assert not stack.r.exists(keys.file(f.id), keys.file_meta(f.id))


def test_a_large_file_round_trips(stack: Stack) -> None:
    rows = [{**chat_line(i), "pad": "é" * 2000} for i in range(500)]  # ~2 MiB
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    f = stack.api.files.create(
        file=("big.jsonl", data),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 7200},
    )
    assert f.bytes == len(data) > 2 * uploads.CHUNK
    assert f.expires_at == f.created_at + 7200
    assert 7000 < stack.r.ttl(keys.file(f.id)) <= 7200
    assert stack.api.files.content(f.id).content == data
    stack.api.files.delete(f.id)


def test_bad_requests_are_400(stack: Stack) -> None:
    api = stack.api
    line = (json.dumps(chat_line(0)) + "\n").encode()
    before = set(stack.r.keys(keys.file("*")))
    for content, purpose, code in [
        (line, "fine-tune", "bad_field"),
        (b"\xff\xfe{}\n", "batch", "invalid_utf8"),
        (b"caf\xc3", "batch", "invalid_utf8"),  # ends inside a character
        (b"", "batch", "bad_field"),
        (b"\n  \n", "batch", "bad_field"),
        (b"{}\n" * (uploads.MAX_FILE_LINES + 1), "batch", "too_many_lines"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            api.files.create(file=("in.jsonl", content), purpose=purpose)
        assert e.value.body["code"] == code, e.value.body
    assert set(stack.r.keys(keys.file("*"))) == before  # nothing of a refused upload left
    r = httpx.post(stack.gateway.base + "/v1/files", json={"purpose": "batch"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_body"

    f = api.files.create(file=("in.jsonl", line), purpose="batch")
    good = {"input_file_id": f.id, "endpoint": CHAT, "completion_window": "24h"}
    for fields, param in [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "48h"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": 5}}, "metadata"),
        ({"input_file_id": 7}, "input_file_id"),
        ({"input_file_id": "file-batch_x-output"}, "input_file_id"),
        ({"model": "tiny"}, "model"),
    ]:
        r = httpx.post(stack.gateway.base + "/v1/batches", json={**good, **fields}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(stack.gateway.base + "/v1/batches", content=b"[1]", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_body"


def test_oversized_upload_is_413(stack: Stack) -> None:
    before = set(stack.r.keys(keys.file("*")))
    limit, slack = uploads.MAX_FILE_BYTES, uploads.FORM_SLACK
    big = b"x" * (limit + slack + 1)
    with pytest.raises(openai.APIStatusError) as e:  # Content-Length says so: refused at once
        stack.api.files.create(file=("big.jsonl", big), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
    del big

    def chunked(size: int) -> Iterator[bytes]:  # no Content-Length
        yield b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="x"\r\n\r\n'
        for start in range(0, size, 1 << 20):
            yield b"x" * min(1 << 20, size - start)
        yield b"\r\n--b--\r\n"

    # the body over the limit while it comes; the form's file over it, the body not
    for size in (limit + slack + 1, limit + 1):
        r = httpx.post(
            stack.gateway.base + "/v1/files",
            content=chunked(size),
            headers={"content-type": "multipart/form-data; boundary=b"},
            timeout=60,
        )
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"
    assert set(stack.r.keys(keys.file("*"))) == before
    # the gateway still serves
    f = stack.api.files.create(file=("ok.jsonl", b"{}\n"), purpose="batch")
    assert stack.api.files.content(f.id).content == b"{}\n"


def test_tenants_see_only_their_own(redis_url: str, tmp_path: Path) -> None:
    from plurai.gateway import apikeys

    r = redis.Redis.from_url(redis_url)
    secrets = {t: apikeys.create_key(r, t)[0] for t in ("acme", "globex")}
    secrets["live"] = apikeys.create_key(r, "live", lanes=["interactive"])[0]
    gw = Gateway(redis_url, tmp_path / "gateway.log")
    try:
        acme, globex, live = (
            openai.OpenAI(base_url=gw.base + "/v1", api_key=secrets[t], max_retries=0)
            for t in ("acme", "globex", "live")
        )
        line = (json.dumps(chat_line(0)) + "\n").encode()
        f = acme.files.create(file=("in.jsonl", line), purpose="batch")
        b = acme.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        assert r.hget(keys.file_meta(f.id), "tenant") == b"acme"
        assert r.hget(keys.batch(b.id), "tenant") == b"acme"
        for call in (
            lambda: globex.files.retrieve(f.id),
            lambda: globex.files.content(f.id),
            lambda: globex.files.delete(f.id),
            lambda: globex.batches.retrieve(b.id),
            lambda: globex.batches.cancel(b.id),
            lambda: globex.batches.list(after=b.id),
            lambda: globex.batches.create(
                input_file_id=f.id, endpoint=CHAT, completion_window="24h"
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert acme.files.content(f.id).content == line
        mine = live.files.create(file=("in.jsonl", line), purpose="batch")
        with pytest.raises(openai.BadRequestError) as e:  # the key may not use the batch lane
            live.batches.create(input_file_id=mine.id, endpoint=CHAT, completion_window="24h")
        assert e.value.body["code"] == "lane_not_allowed"
        assert acme.batches.retrieve(b.id).input_file_id == f.id
        assert acme.batches.cancel(b.id).status == "cancelling"  # no Celery worker here
        anonymous = httpx.get(f"{gw.base}/v1/batches/{b.id}", timeout=30)
        assert anonymous.status_code == 401
        assert anonymous.json()["error"]["type"] == "authentication_error"
    finally:
        gw.stop()


def test_list_batches_newest_first_in_pages(stack: Stack, tmp_path: Path) -> None:
    made = []
    for i in range(3):
        made.append(submit(stack, write_jsonl(tmp_path / f"l{i}.jsonl", [chat_line(i)])).id)
        time.sleep(0.01)  # creation times order the list
    page = stack.api.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    rest = stack.api.batches.list(limit=2, after=page.data[-1].id)
    assert rest.data[0].id == made[0]
    for limit in ("0", "\u00b2", "1" * 5000):  # '²' passes str.isdigit, not int()
        r = httpx.get(stack.gateway.base + "/v1/batches", params={"limit": limit}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


def test_a_damaged_batch_record_is_a_bad_record_and_hides_no_other(
    stack: Stack, tmp_path: Path
) -> None:
    good = submit(stack, write_jsonl(tmp_path / "g.jsonl", [chat_line(0)])).id
    stack.r.hset(keys.batch("batch_damaged"), mapping={"status": "in_progress", "total": "two"})
    stack.r.zadd(keys.BATCHES, {"batch_damaged": time.time() * 1000 + 1})  # the newest
    try:
        r = httpx.get(stack.gateway.base + "/v1/batches/batch_damaged", timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "bad_record"
        assert "'total' is not a count" in r.json()["error"]["message"]
        assert stack.api.batches.list(limit=1).data[0].id == good
    finally:
        stack.r.delete(keys.batch("batch_damaged"))
        stack.r.zrem(keys.BATCHES, "batch_damaged")
