"""Consumer-group bootstrap for the request streams."""

from __future__ import annotations

import redis

from broker_config import keys


def ensure_groups(r: redis.Redis, lanes: list[str]) -> None:
    """Create the `workers` group on every lane stream, creating the stream too.

    The group starts at id 0 so entries added before any worker existed are delivered.
    Idempotent: an existing group (BUSYGROUP) is left as it is.
    """
    for lane in lanes:
        try:
            r.xgroup_create(keys.request_stream(lane), keys.GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
