"""The OpenAI file and batch objects of the Files and Batches APIs (gateway/batches.py),
built from the stored records, and the checks of the batch fields a client sends.

A batch's object comes from its store.BatchRecord (parsed and checked where it is read);
its status is OpenAI's, but for a batch that is past its window and stopping (cancelling
with stop_reason "expired"): OpenAI has no such state, and it is writing its files.
"""

from __future__ import annotations

import json
import re
from typing import Any

from plurai.producer.bulk import store
from plurai.producer.bulk.store import BatchRecord
from plurai.producer.openai_body import BadRequest

COMPLETION_WINDOW = "24h"
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
RESULT_FILE_ID = re.compile(r"file-(?P<batch>[A-Za-z0-9_-]{1,64})-(?P<kind>output|errors)")
DIGITS = re.compile(r"[0-9]{1,15}")

_STATUSES = frozenset(
    {
        store.VALIDATING,
        store.IN_PROGRESS,
        store.FINALIZING,
        store.COMPLETED,
        store.FAILED,
        store.CANCELLING,
        store.CANCELLED,
        store.EXPIRED,
    }
)
_ENDED_AT = {
    store.COMPLETED: "completed_at",
    store.FAILED: "failed_at",
    store.CANCELLED: "cancelled_at",
    store.EXPIRED: "expired_at",
}


def _int(meta: dict[str, str], name: str) -> int:
    """A count or unix-s field of a file's record; 0 when it is missing or not one."""
    v = meta.get(name, "")
    return int(v) if DIGITS.fullmatch(v) else 0


def _seconds(ms: int | None) -> int | None:
    return ms // 1000 if ms else None


def file_object(file_id: str, meta: dict[str, str]) -> dict[str, Any]:
    return {
        "id": file_id,
        "object": "file",
        "bytes": _int(meta, "bytes"),
        "created_at": _int(meta, "created_at"),
        "expires_at": _int(meta, "expires_at") or None,
        "filename": meta.get("filename", ""),
        "purpose": "batch",
        "status": "processed",
        "status_details": None,
    }


def result_file_object(rec: BatchRecord, kind: str, size: int) -> dict:
    return {
        "id": f"file-{rec.id}-{kind}",
        "object": "file",
        "bytes": size,
        "created_at": (rec.finished_ms or rec.created_ms or 0) // 1000,
        "expires_at": None,
        "filename": f"{rec.id}_{kind}.jsonl",
        "purpose": "batch_output",
        "status": "processed",
        "status_details": None,
    }


def status_of(rec: BatchRecord) -> str:
    if rec.status == store.CANCELLING and rec.stop_reason == "expired":
        return store.FINALIZING
    return rec.status if rec.status in _STATUSES else store.FAILED


def metadata_of(rec: BatchRecord) -> dict[str, str] | None:
    """The batch's metadata, when it is OpenAI's (string values; the CLI takes any)."""
    try:
        value = json.loads(rec.metadata or "null")
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        return None
    return value


def batch_object(rec: BatchRecord) -> dict[str, Any]:
    """The OpenAI batch object of a bulk batch record."""
    batch_id, status, counts = rec.id, status_of(rec), rec.counts
    ended = rec.status in store.TERMINAL
    prompt, output = rec.prompt_tokens or 0, rec.output_tokens or 0
    obj: dict[str, Any] = {
        "id": batch_id,
        "object": "batch",
        "endpoint": rec.endpoint or None,
        "errors": None,
        "input_file_id": rec.input_file_id or None,
        "completion_window": rec.completion_window or COMPLETION_WINDOW,
        "status": status,
        "output_file_id": f"file-{batch_id}-output" if ended and counts["completed"] else None,
        "error_file_id": f"file-{batch_id}-errors" if ended and counts["failed"] else None,
        "created_at": (rec.created_ms or 0) // 1000,
        "in_progress_at": _seconds(rec.started_ms) if status != store.VALIDATING else None,
        "expires_at": _seconds(rec.expires_ms),
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": _seconds(rec.cancelling_ms),
        "cancelled_at": None,
        "request_counts": counts,
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output,
        },
        "metadata": metadata_of(rec),
    }
    if status in _ENDED_AT:
        obj[_ENDED_AT[status]] = _seconds(rec.finished_ms)
    if rec.error_code:
        error = {"code": rec.error_code, "message": rec.error or "", "param": None, "line": None}
        obj["errors"] = {"object": "list", "data": [error]}
    return obj


def check_metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string pairs, keys to 64 and values to 512 chars."""
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > METADATA_PAIRS
        or not all(
            isinstance(k, str)
            and isinstance(v, str)
            and len(k) <= METADATA_KEY_CHARS
            and len(v) <= METADATA_VALUE_CHARS
            for k, v in value.items()
        )
    ):
        raise BadRequest(
            f"metadata: an object of at most {METADATA_PAIRS} string pairs, keys of at most "
            f"{METADATA_KEY_CHARS} characters, values of at most {METADATA_VALUE_CHARS}",
            param="metadata",
        )
    return value
