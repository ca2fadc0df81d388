"""Logging set-up for Plurai processes: plain text, or one JSON object per line.

    PLURAI_LOG_FORMAT=json PLURAI_LOG_LEVEL=DEBUG plurai worker --model m/

A JSON line holds `ts` (ISO 8601, UTC), `level`, `logger`, `message`, the fields passed
with `extra=` (`job_id`, `worker`, `lane`, `code`, ...) and `exc` for a traceback:

    {"ts": "2026-11-29T20:31:07.412Z", "level": "INFO", "logger": "plurai.worker",
     "message": "job refused", "job_id": "4f1c...", "code": "prompt_too_long", ...}

Text lines append the same extra fields as `key=value`.

Both formats pass every line through broker_config.connection.redact, so a Redis URL
logged with its password shows `redis://***@host:port/db` instead.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from plurai.broker_config.connection import redact

FORMATS = ("text", "json")
OWN_LOGGERS = ("plurai", "broker_config", "gpu_workers", "kv_store", "producer", "results")

# LogRecord's own attributes; anything else on a record came in through `extra=`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _extra(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _iso(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_extra(record),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        safe = {k: redact(v) if isinstance(v, str) else v for k, v in line.items()}
        return redact(json.dumps(safe, default=str, ensure_ascii=False))


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extra = _extra(record)
        if extra:
            text += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        return redact(text)


def setup(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger once, for a process entry point."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {', '.join(FORMATS)}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r}: use DEBUG, INFO, WARNING or ERROR")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    # DEBUG is for Plurai's own loggers; libraries (redis, transformers) stay at INFO or above.
    logging.basicConfig(level=max(numeric, logging.INFO), handlers=[handler], force=True)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(numeric)
