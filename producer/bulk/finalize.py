"""The OpenAI Batch output format, and finalizing a batch into its two JSONL files.

Output file: one line per successful custom_id, in input order:
  {"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}
Error file: one line per failed custom_id (and per line that had none), in input order:
  {"id", "custom_id", "response": null, "error": {"code", "message"}}
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import redis

from plurai.broker_config import keys
from plurai.broker_config.text import text
from plurai.producer.bulk import store
from plurai.results.records import Choice


def _id(batch_id: str, index: int) -> str:
    return (
        "batch_req_" + hashlib.blake2b(f"{batch_id}:{index}".encode(), digest_size=12).hexdigest()
    )


def _dump(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def ok_line(
    batch_id: str,
    index: int,
    request: dict[str, Any],
    *,
    choices: list[Choice],
    usage: tuple[int, int],
    request_id: str,
    created_s: int,
) -> str:
    """The output line of a request that completed: its body has a choice per `choices`
    (one, unless the request asked for n > 1)."""
    chat = request["kind"] == "chat"
    usage_obj = {
        "prompt_tokens": usage[0],
        "completion_tokens": usage[1],
        "total_tokens": usage[0] + usage[1],
    }
    listed = []
    for c in choices:
        reason = c.finish_reason or "stop"
        if chat:
            message = {"role": "assistant", "content": c.text}
            listed.append({"index": c.index, "message": message, "finish_reason": reason})
        else:
            listed.append(
                {"index": c.index, "text": c.text, "finish_reason": reason, "logprobs": None}
            )
    prefix = "chatcmpl-" if chat else "cmpl-"
    body = {
        "id": prefix + request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created_s,
        "model": request.get("model") or "",
        "choices": listed,
        "usage": usage_obj,
    }
    return _dump(
        {
            "id": _id(batch_id, index),
            "custom_id": request["custom_id"],
            "response": {"status_code": 200, "request_id": request_id, "body": body},
            "error": None,
        }
    )


def error_line(batch_id: str, index: int, custom_id: str | None, code: str, message: str) -> str:
    return _dump(
        {
            "id": _id(batch_id, index),
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
    )


def is_error(line: str) -> bool:
    return json.loads(line)["error"] is not None


def finalize(r: redis.Redis, batch_id: str, total: int, ttl_s: int) -> tuple[int, int]:
    """Write the output and error files (whole, so a repeated finalize writes the same)."""
    out: list[str] = []
    err: list[str] = []
    names = list(range(total))
    for start in range(0, total, 5000):
        part = names[start : start + 5000]
        for line in r.hmget(keys.batch_lines(batch_id), part) if part else []:
            if line is None:
                continue
            line = text(line)
            (err if is_error(line) else out).append(line)
    pipe = r.pipeline(transaction=True)
    pipe.set(keys.batch_output(batch_id), "".join(x + "\n" for x in out))
    pipe.set(keys.batch_errors(batch_id), "".join(x + "\n" for x in err))
    pipe.execute()
    store.expire(r, batch_id, ttl_s)
    return len(out), len(err)
