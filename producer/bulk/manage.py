"""What `plurai batch` does: create a batch from a file or folder (or from lines, as the
gateway's Batches API does), cancel it, read it."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plurai.broker_config import keys
from plurai.broker_config.settings import BulkSettings
from plurai.broker_config.text import text, valid_text
from plurai.producer.bulk import finalize, store
from plurai.producer.bulk.inputs import URLS
from plurai.producer.client import Client

if TYPE_CHECKING:  # (the plan needs the bulk extra; `plurai status` and the client do not)
    from plurai.producer.bulk.plan import Task


class UnknownBatch(KeyError):
    """No batch has that id (never created, or expired)."""


def read_input(path: Path, documents: bool) -> list[str]:
    """Input lines: a JSONL file's non-empty lines, or (documents) one line per file of a
    folder, custom_id = the file's path inside the folder."""
    if path.is_dir():
        if not documents:
            raise ValueError(f"{path} is a folder: give --task to process its files as documents")
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        return [
            json.dumps(
                {"custom_id": str(p.relative_to(path)), "text": p.read_text(errors="replace")}
            )
            for p in files
        ]
    with open(path, encoding="utf-8", errors="replace") as f:
        return list(lines_of(f))


def lines_of(f: Iterable[str]) -> Iterator[str]:
    """The non-empty lines of a text stream, without their line ends: the input lines of a
    JSONL file (open it with newline=None, as read_input does, so that \\r\\n ends a line)."""
    return (line.rstrip("\n") for line in f if line.strip())


def model_context(model_dir: str) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or 2048)


def create(
    client: Client,
    bs: BulkSettings,
    source: Path | Iterable[str],
    *,
    task: Task | None = None,
    model_dir: str | None = None,
    max_model_len: int | None = None,
    metadata: dict[str, Any] | None = None,
    endpoint: str | None = None,
    fields: Mapping[str, str] | None = None,
) -> str:
    """Upload the input, create the batch record (validating) and start it; returns its id.

    `source`: a file or folder (read_input), or the input lines themselves (read once, a
    thousand at a time). Documents (a task given) need the model directory, for its
    tokenizer, and its constraint must fit the client's settings (max_grammar_bytes).
    `endpoint`: the one url the OpenAI lines may name (the Batches API's rule); a
    line naming the other one gets an error line (invalid_url). `fields`: more fields of
    the batch record (BatchRecord's: the gateway's tenant, input file id); they cannot
    replace its own."""
    from plurai.producer.bulk.tasks import kick

    batch_id = "batch_" + secrets.token_hex(12)
    rec = store.BatchRecord(batch_id, store.VALIDATING, **(fields or {}))
    if task is not None:  # before anything is written
        if not model_dir:
            raise ValueError("documents need the model directory: --model DIR (PLURAI_MODEL_DIR)")
        rec.task = json.dumps(task.fits(client.settings.max_grammar_bytes).to_dict())
        rec.model_dir = str(Path(model_dir).resolve())
        rec.max_model_len = max_model_len or model_context(model_dir)
    r = client.redis
    lines = read_input(source, task is not None) if isinstance(source, Path) else source
    total = 0
    wrong: dict[str, str] = {}  # line index -> its error line
    it = iter(lines)
    try:
        while chunk := list(islice(it, 1000)):
            pipe = r.pipeline(transaction=False)
            pipe.rpush(keys.batch_input(batch_id), *chunk)
            pipe.expire(keys.batch_input(batch_id), bs.running_ttl_s)
            pipe.execute()
            if endpoint is not None:
                for i, line in enumerate(chunk, total):
                    err = _other_endpoint(line, i + 1, endpoint, bs.max_line_bytes)
                    if err is not None:
                        wrong[str(i)] = finalize.error_line(batch_id, i, *err)
            total += len(chunk)
    except BaseException:  # the source failed midway: no batch, and no lines kept for it
        r.delete(keys.batch_input(batch_id))
        raise
    now = store.now_ms()
    rec.created_ms, rec.expires_ms = now, now + bs.completion_window_s * 1000
    rec.total, rec.failed = total, len(wrong)
    if isinstance(source, Path):
        rec.input = str(source)
    if metadata:
        rec.metadata = json.dumps(metadata)
    # one transaction: the batch is never seen (resumed, validated) without its error lines
    pipe = r.pipeline(transaction=True)
    if wrong:
        # the lines' one result each, written before validation: the driver skips lines
        # that have one, and a later record_line of the same line changes nothing
        pipe.hset(keys.batch_lines(batch_id), mapping=wrong)
    pipe.hset(keys.batch(batch_id), mapping=rec.to_hash())
    pipe.zadd(keys.BATCHES, {batch_id: now})
    store.expire_pipe(pipe, batch_id, bs.running_ttl_s)
    pipe.execute()
    kick(client, batch_id)
    return batch_id


def _other_endpoint(
    line: str, number: int, endpoint: str, max_line_bytes: int
) -> tuple[str | None, str, str] | None:
    """(custom_id, code, message) of an OpenAI line whose url is the other supported
    endpoint; None for any other line (parse_line judges it)."""
    if len(line) > max_line_bytes:
        return None  # line_too_large, without parsing it here
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    url = obj.get("url")
    if url == endpoint or url not in URLS:
        return None
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or not valid_text(cid):
        return None  # its custom_id error comes first
    message = f"line {number}: url {url!r} is not the batch's endpoint {endpoint!r}"
    return cid, "invalid_url", message


def cancel(client: Client, batch_id: str) -> str:
    """Ask the driver to stop; returns the status now."""
    store.check_id(batch_id)
    status = store.move(
        client.redis, batch_id, store.CANCELLING, store.VALIDATING, store.IN_PROGRESS
    )
    if status is None:
        raise UnknownBatch(f"no batch {batch_id}")
    if status == store.CANCELLING:  # the batch runs (its record has its running TTL)
        client.redis.hsetnx(keys.batch(batch_id), "cancelling_ms", store.now_ms())
    return status


def read(client: Client, batch_id: str) -> store.BatchRecord:
    """The batch's record; UnknownBatch if it has none, BadRecord if it is damaged."""
    rec = store.get(client.redis, store.check_id(batch_id))
    if rec is None:
        raise UnknownBatch(f"no batch {batch_id} (unknown or expired)")
    return rec


def info(client: Client, batch_id: str) -> dict[str, Any]:
    """The batch as OpenAI shows one, plus progress: done, tokens/s, ETA seconds."""
    rec = read(client, batch_id)
    c = rec.counts
    done = c["completed"] + c["failed"]
    out_tokens = rec.output_tokens or 0
    started = rec.started_ms or 0
    end = rec.finished_ms or store.now_ms()
    elapsed = max(1e-3, (end - started) / 1000) if started else 0.0
    rate = done / elapsed if elapsed else 0.0
    left = c["total"] - done
    return {
        "id": batch_id,
        "object": "batch",
        "status": rec.status,
        "input": rec.input,
        "request_counts": c,
        "errors": (
            {"data": [{"code": rec.error_code, "message": rec.error or ""}]}
            if rec.error_code
            else None
        ),
        "created_at": (rec.created_ms or 0) // 1000,
        "expires_at": (rec.expires_ms or 0) // 1000,
        "completed_at": rec.finished_ms // 1000 if rec.finished_ms else None,
        "usage": {"prompt_tokens": rec.prompt_tokens or 0, "completion_tokens": out_tokens},
        "elapsed_s": round(elapsed, 3),
        "lines_per_s": round(rate, 3),
        "tokens_per_s": round(out_tokens / elapsed, 3) if elapsed else 0.0,
        "eta_s": round(left / rate, 1) if rate > 0 and left else (0.0 if not left else None),
    }


def results(client: Client, batch_id: str) -> tuple[str, str]:
    """The finished output and error JSONL texts; raises if the batch has not finished."""
    rec = read(client, batch_id)
    if rec.status not in store.TERMINAL:
        raise ValueError(f"batch {batch_id} is {rec.status}; results come when it ends")
    out, err = client.redis.mget(keys.batch_output(batch_id), keys.batch_errors(batch_id))
    return text(out or ""), text(err or "")
