"""A batch's first step: its input lines parsed, once, into validated requests or error
lines; and whether this driver can run it at all (its task, its model).

Documents are split with the tokenizer of the model directory this driver is configured
with (Settings.model_dir, PLURAI_MODEL_DIR), never of a path read from the batch record,
which any client can write: the record's `model_dir` only says which model the client
meant, and a batch whose model is not the configured one (another folder name) fails with
`model_mismatch`.
"""

from __future__ import annotations

import json
from pathlib import PurePath

import redis
from redis.client import NEVER_DECODE

from plurai.broker_config import keys
from plurai.broker_config.settings import BulkSettings, Settings
from plurai.broker_config.text import text
from plurai.producer.bulk import finalize, plan, store
from plurai.producer.bulk.inputs import LineError, parse_line
from plurai.producer.bulk.store import BatchRecord


def configured_model(rec: BatchRecord, settings: Settings) -> tuple[str, tuple[str, str] | None]:
    """The model directory to split the batch's documents with (settings.model_dir; "" for
    a batch without a task, which needs none), and the error code and message that fail the
    batch when it cannot run with it, a task that is not valid included (None: it can)."""
    if not rec.task:
        return "", None
    try:  # a record written before a rule it breaks (or by hand) fails the batch cleanly
        plan.Task.from_dict(json.loads(rec.task)).fits(settings.max_grammar_bytes)
    except (ValueError, TypeError, AttributeError, RecursionError) as e:
        return "", ("invalid_task", f"the batch's task is not valid: {e}"[:500])
    mine = settings.model_dir or ""
    if not mine:
        return "", (
            "model_unavailable",
            "this batch driver has no model directory (set PLURAI_MODEL_DIR): "
            "documents are split with its tokenizer",
        )
    wanted = PurePath(rec.model_dir or "").name
    if wanted != PurePath(mine).name:
        return mine, (
            "model_mismatch",
            f"the batch was submitted for the model {wanted!r}; this batch driver serves "
            f"{PurePath(mine).name!r} (PLURAI_MODEL_DIR)",
        )
    return mine, None


def validate(r: redis.Redis, rec: BatchRecord, bs: BulkSettings, settings: Settings) -> str:
    """Parse the input lines (a body runs as it would through the gateway configured with
    `settings`); returns the status after it."""
    batch_id = rec.id
    if rec.valid is not None:  # parsed (its input is gone), then the driver died before
        return validated(r, batch_id, rec.valid > 0)  # moving on
    documents = bool(rec.task)
    _, problem = configured_model(rec, settings)
    if problem is not None:
        store.fail_reason(r, batch_id, problem)
    # read as bytes, whatever the connection decodes: bytes that are not UTF-8 become
    # U+FFFD, so such a line is an error line, never a crash of the whole batch
    lines = r.execute_command("LRANGE", keys.batch_input(batch_id), 0, -1, **{NEVER_DECODE: []})
    raw = [text(x) for x in lines]
    seen: dict[str, int] = {}
    valid = 0
    pipe = r.pipeline(transaction=True)
    for i, line in enumerate(raw):
        try:
            try:
                req = parse_line(
                    line,
                    i + 1,
                    documents=documents,
                    max_line_bytes=bs.max_line_bytes,
                    max_tokens_limit=settings.max_tokens_limit,
                    default_max_tokens=settings.gateway_default_max_tokens,
                )
            except LineError as e:
                if e.custom_id is not None:
                    seen.setdefault(e.custom_id, i + 1)
                raise
            first = seen.setdefault(req["custom_id"], i + 1)
            if first != i + 1:
                raise LineError(
                    "duplicate_custom_id",
                    f"line {i + 1}: custom_id {req['custom_id']!r} already used on line {first}",
                    req["custom_id"],
                )
            if problem is not None:
                raise LineError(*problem, req["custom_id"])
        except LineError as e:
            line_out = finalize.error_line(batch_id, i, e.custom_id, e.code, e.message)
            store.record_line(r, batch_id, i, line_out, False, (0, 0), bs.running_ttl_s)
            continue
        pipe.hset(keys.batch_requests(batch_id), str(i), json.dumps(req))
        valid += 1
    pipe.hset(
        keys.batch(batch_id),
        mapping={"total": len(raw), "valid": valid, "started_ms": store.now_ms()},
    )
    pipe.delete(keys.batch_input(batch_id))  # parsed; the requests hash replaces it
    store.expire_pipe(pipe, batch_id, bs.running_ttl_s)
    pipe.execute()
    return validated(r, batch_id, valid > 0)


def validated(r: redis.Redis, batch_id: str, any_valid: bool) -> str:
    """Move a parsed batch on: to in_progress, or (no valid line) to finalizing as failed."""
    if not any_valid:
        r.hset(keys.batch(batch_id), mapping={"end_status": store.FAILED})
        return store.move(r, batch_id, store.FINALIZING, store.VALIDATING) or store.FAILED
    return store.move(r, batch_id, store.IN_PROGRESS, store.VALIDATING) or store.FAILED
