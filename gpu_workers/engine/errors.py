"""Request errors with stable codes.

Every way a single request can be refused maps to one code of `ErrorCode`, defined once
in broker_config/errors.py (the wire parser uses the same strings) and re-exported here.
The engine raises `RequestError` for that request only and keeps serving the others; the
worker turns it into a terminal error result carrying the same code (docs/protocol.md
lists them).
"""

from __future__ import annotations

from plurai.broker_config.errors import ErrorCode, valid_messages
from plurai.gpu_workers.backend import RequestError

__all__ = ["ErrorCode", "RequestError", "valid_messages"]
