"""`plurai keys`: API keys of the HTTP gateway.

plurai keys create --tenant acme [--lanes interactive,standard] [--default-lane standard]
                   [--rpm 600] [--tpm 200000] [--concurrent 8] [--admin]
                                     print a new key's secret (once: only its hash is kept);
                                     --admin: it may also open the dashboard
plurai keys list [--json]            every key: id, tenant, lanes, limits (never a secret)
plurai keys revoke KEY_ID            delete a key; every gateway refuses it from then on
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import redis

from plurai.broker_config.connection import connect, redact, resolve_url
from plurai.broker_config.settings import Settings
from plurai.gateway import apikeys

URL_HELP = "Redis URL (default: PLURAI_REDIS_URL or the embedded one)"


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= apikeys.MAX_LIMIT:
        raise argparse.ArgumentTypeError(
            f"expected a whole number >= 0 (0: no limit), got {text!r}"
        )
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="keys_command", required=True)
    c = sub.add_parser("create", help="create a key; its secret is printed once")
    c.add_argument("--tenant", required=True, help="the tenant the key belongs to")
    c.add_argument("--lanes", help="comma-separated lanes it may use (default: all configured)")
    c.add_argument("--default-lane", help="lane of requests that name none")
    c.add_argument("--rpm", type=_count, default=0, help="requests per minute (0: no limit)")
    c.add_argument("--tpm", type=_count, default=0, help="tokens per minute (0: no limit)")
    c.add_argument("--concurrent", type=_count, default=0, help="jobs at once (0: no limit)")
    c.add_argument(
        "--admin",
        action="store_true",
        help="it may also read the dashboard: every tenant's jobs, the workers, the queue",
    )
    lst = sub.add_parser("list", help="list keys (ids, tenants, lanes, limits)")
    lst.add_argument("--json", action="store_true", help="one JSON array")
    v = sub.add_parser("revoke", help="delete a key at once")
    v.add_argument("key_id", help="the key's id, as `plurai keys list` shows it")
    for q in (c, lst, v):
        q.add_argument("--url", help=URL_HELP)


def _limit(n: int) -> str:
    return str(n) if n else "-"


def _created(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ms / 1000))


def _as_dict(key: apikeys.Key) -> dict[str, object]:
    return {
        "id": key.id,
        "tenant": key.tenant,
        "lanes": list(key.lanes),
        "default_lane": key.default_lane,
        "rpm": key.rpm,
        "tpm": key.tpm,
        "concurrent": key.concurrent,
        "created_ms": key.created_ms,
        "admin": key.admin,
    }


def _create(r: redis.Redis, args: argparse.Namespace) -> int:
    # an empty --lanes is refused (no lanes), never read as "every lane"
    lanes = None if args.lanes is None else [x.strip() for x in args.lanes.split(",") if x.strip()]
    secret, key = apikeys.create_key(
        r,
        args.tenant,
        lanes=lanes,
        default_lane=args.default_lane,
        rpm=args.rpm,
        tpm=args.tpm,
        concurrent=args.concurrent,
        admin=args.admin,
        settings=Settings(),
    )
    print(
        f"created key {key.id} for tenant {key.tenant}: lanes {','.join(key.lanes)} "
        f"(default {key.default_lane}), rpm {_limit(key.rpm)}, tpm {_limit(key.tpm)}, "
        f"concurrent {_limit(key.concurrent)}{', admin' if key.admin else ''}. "
        "Store the secret below now: it is not kept and cannot be shown again.",
        file=sys.stderr,
    )
    print(secret)
    return 0


def _list(r: redis.Redis, args: argparse.Namespace) -> int:
    found, broken = apikeys.list_keys(r)
    if args.json:
        print(json.dumps([_as_dict(k) for k in found], indent=2))
    else:
        rows = [
            ("ID", "TENANT", "LANES", "DEFAULT", "RPM", "TPM", "CONCURRENT", "ADMIN", "CREATED")
        ]
        for k in found:
            rows.append(
                (
                    k.id,
                    k.tenant,
                    ",".join(k.lanes),
                    k.default_lane,
                    _limit(k.rpm),
                    _limit(k.tpm),
                    _limit(k.concurrent),
                    "yes" if k.admin else "-",
                    _created(k.created_ms),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    for kid in broken:
        print(
            f"plurai keys: key {kid} has a damaged record (refused); `plurai keys revoke {kid}`",
            file=sys.stderr,
        )
    return 0


def _revoke(r: redis.Redis, args: argparse.Namespace) -> int:
    if not apikeys.revoke(r, args.key_id):
        print(f"plurai keys: no key {args.key_id!r}", file=sys.stderr)
        return 1
    print(f"revoked key {args.key_id}", file=sys.stderr)
    return 0


_COMMANDS = {"create": _create, "list": _list, "revoke": _revoke}


def main(args: argparse.Namespace) -> int:
    url = None
    try:
        url = resolve_url(args.url)
        r = connect(url)  # bytes: list_keys validates every reply itself
        try:
            return _COMMANDS[args.keys_command](r, args)
        finally:
            r.close()
    except redis.RedisError as e:
        where = f" at {redact(url)}" if url else ""
        print(f"plurai keys: Redis error{where}: {redact(str(e))}", file=sys.stderr)
        return 1
    except ValueError as e:  # no URL, bad tenant or lane, ...
        print(f"plurai keys: {redact(str(e))}", file=sys.stderr)
        return 2
