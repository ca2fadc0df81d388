"""The HTTP gateway with the official `openai` client: a real gateway process, a real
redis-server and real workers. Chat and completions, streamed and not, equal the same
request through the Python SDK; usage equals the job record; a client leaving mid-stream
cancels its job; a stream survives its worker's SIGKILL. Bad input:
tests/integration/test_gateway_errors.py.

The tests share one gateway process, its redis-server and workers (module fixtures).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from plurai.broker_config import keys
from plurai.broker_config.embedded import free_port
from plurai.producer.client import Client
from plurai.results import records, wait

from .conftest import ROOT
from .faults import FAST

MAX_MODEL_LEN = 256


class Gateway:
    def __init__(
        self, url: str, log: Path, env: dict[str, str] | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = ["gateway", "--url", url, "--host", host, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "plurai.cli", *cmd],
            cwd=ROOT,
            stdout=open(log, "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        give_up = time.monotonic() + 60
        while True:
            try:
                httpx.get(self.base + "/health", timeout=1)
                return
            except httpx.HTTPError:
                assert self.proc.poll() is None, log.read_text()
                assert time.monotonic() < give_up, "the gateway never answered"
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Stack:
    def __init__(self, url: str, gateway: Gateway, model: str, workers) -> None:
        self.url, self.gateway, self.model, self.workers = url, gateway, model, workers
        self.api = openai.OpenAI(base_url=gateway.base + "/v1", api_key="unused", max_retries=0)
        self.sdk = Client(url)
        self.r = redis.Redis.from_url(url)


@pytest.fixture(scope="module", name="stack")  # imported by test_gateway_errors.py
def stack_fixture(module_redis_url, tiny_model, tmp_path_factory, workers_class) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("logs")
    w = workers_class(module_redis_url, tiny_model, logs)
    w.start(2, "--engine", f"max_model_len={MAX_MODEL_LEN}", env=FAST)
    gw = Gateway(module_redis_url, logs / "gateway.log")
    yield Stack(module_redis_url, gw, tiny_model.name, w)
    gw.stop()
    w.stop()


def record(s: Stack, response_id: str) -> records.JobRecord:
    return records.get(s.r, response_id.split("-", 1)[1])


def test_models_lists_the_served_model(stack: Stack) -> None:
    models = stack.api.models.list().data
    assert [m.id for m in models] == [stack.model]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_chat_equals_the_sdk(stack: Stack) -> None:
    messages = [{"role": "user", "content": "Name three rivers."}]
    out = stack.api.chat.completions.create(
        model=stack.model, messages=messages, max_tokens=12, temperature=0
    )
    direct = stack.sdk.submit(messages=messages, max_tokens=12, temperature=0).result(timeout=60)
    assert out.choices[0].message.content == direct.text
    assert out.choices[0].finish_reason == direct.finish_reason
    rec = record(stack, out.id)
    assert out.usage.prompt_tokens == rec.prompt_tokens
    assert out.usage.completion_tokens == rec.output_tokens == 12
    assert out.usage.prompt_tokens_details.cached_tokens == rec.cached_tokens


def test_completion_stream_equals_the_sdk(stack: Stack) -> None:
    prompt = "Once upon a time"
    chunks = list(
        stack.api.completions.create(
            model=stack.model,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    direct = stack.sdk.submit(prompt, max_tokens=16, temperature=0).result(timeout=60)
    assert text == direct.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 16
    assert usage.prompt_tokens == record(stack, chunks[0].id).prompt_tokens


def test_chat_stream_and_logprobs(stack: Stack) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    stream = stack.api.chat.completions.create(
        model=stack.model, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    whole = stack.api.chat.completions.create(
        model=stack.model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        seed=3,
        stop=["\n\n\n"],
        presence_penalty=0.0,
    )
    assert whole.choices[0].message.content == text
    lps = whole.choices[0].logprobs.content
    assert len(lps) == 10 and all(len(t.top_logprobs) == 2 for t in lps)
    assert "".join(t.token for t in lps).startswith(text[:3])


def test_n_greedy_choices_are_equal(stack: Stack) -> None:
    messages = [{"role": "user", "content": "Name three rivers."}]
    out = stack.api.chat.completions.create(
        model=stack.model, messages=messages, max_tokens=10, temperature=0, n=3
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = {c.message.content for c in out.choices}
    one = stack.api.chat.completions.create(
        model=stack.model, messages=messages, max_tokens=10, temperature=0
    )
    assert texts == {one.choices[0].message.content}
    rec = record(stack, out.id)
    assert out.usage.prompt_tokens == one.usage.prompt_tokens == rec.prompt_tokens
    assert out.usage.completion_tokens == rec.output_tokens == 30
    assert out.usage.total_tokens == out.usage.prompt_tokens + 30


def test_n_seeded_choices_are_reproducible_and_streamed_the_same(stack: Stack) -> None:
    ask = dict(model=stack.model, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=3)
    first = stack.api.completions.create(**ask, seed=42)
    again = stack.api.completions.create(**ask, seed=42)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in again.choices] == texts
    assert len(set(texts)) > 1  # each choice samples with a seed of its own
    # choice i is the request of seed 42 + i
    alone = [stack.api.completions.create(**{**ask, "n": 1}, seed=42 + i) for i in range(3)]
    assert [a.choices[0].text for a in alone] == texts
    # streamed: each chunk names its choice, and the chunks of a choice spell its text
    chunks = list(
        stack.api.completions.create(
            **ask, seed=42, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed: dict[int, str] = {}
    ends: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
            if choice.finish_reason:
                ends[choice.index] = choice.finish_reason
    assert streamed == dict(enumerate(texts))
    assert ends == {c.index: c.finish_reason for c in first.choices}
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens
    # a chat streams its role once per choice
    chat = list(
        stack.api.chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            temperature=1.0,
            seed=1,
            n=2,
            stream=True,
        )
    )
    roles = [c.choices[0].index for c in chat if c.choices and c.choices[0].delta.role]
    assert sorted(roles) == [0, 1]
    # the SDK gives the same choices, and its first choice as the record's text
    rec = stack.sdk.submit("Once upon a time", max_tokens=12, temperature=1.0, seed=42, n=3)
    done = rec.result(timeout=60)
    assert [c.text for c in done.choices] == texts and done.text == texts[0]
    parts: dict[int, str] = {}
    for i, delta in rec.stream_choices():
        parts[i] = parts.get(i, "") + delta
    assert parts == dict(enumerate(texts))


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def test_structured_output_equals_the_sdk(stack: Stack) -> None:
    import jsonschema

    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    rf = _schema(PERSON)
    out = stack.api.chat.completions.create(
        model=stack.model, messages=messages, max_tokens=120, temperature=0, response_format=rf
    )
    content = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop", content
    jsonschema.validate(json.loads(content), PERSON)
    direct = stack.sdk.submit(
        messages=messages, max_tokens=120, temperature=0, response_format=rf
    ).result(timeout=60)
    assert direct.text == content
    # streamed, sampled: the deltas join into a valid document
    chunks = stack.api.chat.completions.create(
        model=stack.model,
        messages=messages,
        max_tokens=120,
        temperature=1.0,
        seed=5,
        response_format=rf,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(streamed), PERSON)
    # Plurai's choice and regex, as the openai client sends extra fields
    picked = stack.api.completions.create(
        model=stack.model,
        prompt="Is the sky green?",
        max_tokens=8,
        temperature=0,
        extra_body={"choice": ["yes", "no", "it depends"]},
    )
    assert picked.choices[0].text in ("yes", "no", "it depends")
    code = stack.api.completions.create(
        model=stack.model,
        prompt="A ticket code:",
        max_tokens=16,
        temperature=0,
        extra_body={"regex": "[A-Z]{3}-[0-9]{4}"},
    )
    assert re.fullmatch("[A-Z]{3}-[0-9]{4}", code.choices[0].text)
    assert code.choices[0].finish_reason == "stop"
    # the client's own parse() with a pydantic model (a strict json_schema)
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)
        member: bool

    parsed = stack.api.chat.completions.parse(
        model=stack.model, messages=messages, max_tokens=120, temperature=0, response_format=Person
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120
    # the SDK takes the model class itself
    direct = stack.sdk.submit(messages=messages, max_tokens=120, response_format=Person)
    assert 0 <= Person.model_validate_json(direct.result(timeout=60).text).age <= 120
    whole = stack.api.chat.completions.create(
        model=stack.model,
        messages=messages,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if whole.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(whole.choices[0].message.content), dict)
    else:  # a cut-off object says so
        assert whole.choices[0].finish_reason == "length"


def beats(r: redis.Redis) -> list[dict[bytes, bytes]]:
    return [r.hgetall(keys.worker(w.decode())) for w in r.smembers(keys.WORKERS)]


def test_leaving_mid_stream_cancels_the_job(stack: Stack) -> None:
    body = {
        "model": stack.model,
        "prompt": "a long one",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    with httpx.stream(
        "POST", stack.gateway.base + "/v1/completions", json=body, timeout=60
    ) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
    job_id = json.loads(first[6:])["id"].split("-", 1)[1]
    rec = wait.wait(stack.r, job_id, timeout=30)
    assert rec.state == records.CANCELLED and (rec.output_tokens or 0) < 200
    give_up = time.monotonic() + 15
    while any(b.get(b"kv_blocks_used", b"0") != b"0" for b in beats(stack.r)):
        assert time.monotonic() < give_up, "the cancelled job still holds KV blocks"
        time.sleep(0.1)


def test_whole_answers_wait_on_one_connection(stack: Stack) -> None:
    """60 requests waiting at once for whole answers share the gateway's one pub/sub
    connection (a connection each had been 60 handshakes and 60 Redis clients), and each
    gets its own job's answer; one that leaves cancels only its own job."""
    import asyncio

    def subscribers() -> int:
        return len(stack.r.execute_command("CLIENT LIST TYPE pubsub").splitlines())

    base = subscribers()  # the workers' cancel channel, and the gateway's once it waited
    seen: list[int] = []

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=80)) as c:
            sends = [
                c.post(
                    stack.gateway.base + "/v1/completions",
                    json={
                        "model": stack.model,
                        "prompt": f"wait {i}",
                        "max_tokens": 24,
                        "ignore_eos": True,
                        "temperature": 0,
                    },
                )
                for i in range(60)
            ]
            tasks = [asyncio.create_task(s) for s in sends]
            while not all(t.done() for t in tasks):
                seen.append(subscribers())
                await asyncio.sleep(0.05)
            return [t.result() for t in tasks]

    answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * 60
    for a in answers:
        rec = record(stack, a.json()["id"])
        assert rec.state == records.COMPLETED and a.json()["choices"][0]["text"] == rec.text
        assert a.json()["usage"]["completion_tokens"] == 24
    assert max(seen) <= base + 1, (base, max(seen))


def test_stream_survives_its_worker_sigkill(stack: Stack) -> None:
    """The job restarts on the other worker; greedy, so the new run repeats the text
    already sent and the stream goes on from there: one clean, complete answer."""
    body = {
        "model": stack.model,
        "prompt": "the survivor",
        "max_tokens": 240,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    pids = {p.pid: p for p in stack.workers.procs}
    text, killed, finish = "", False, None
    with httpx.stream(
        "POST", stack.gateway.base + "/v1/completions", json=body, timeout=120
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            finish = event["choices"][0]["finish_reason"] or finish
            if not killed:
                job_id = event["id"].split("-", 1)[1]
                owner = records.get(stack.r, job_id).worker or ""
                victim = next(p for pid, p in pids.items() if f"-{pid}-" in owner)
                victim.send_signal(signal.SIGKILL)
                killed = True
    assert killed and finish == "length"
    direct = stack.sdk.submit("the survivor", max_tokens=240, ignore_eos=True, temperature=0)
    assert text == direct.result(timeout=120).text
    rec = records.get(stack.r, job_id)
    assert rec.output_tokens == 240 and rec.worker != owner
