"""The Celery app of bulk batches (producer/bulk/tasks.py).

    celery -A plurai.broker_config.celery_app worker --pool solo -c 1     the batch driver
    celery -A plurai.broker_config.celery_app beat                        periodic maintenance

The broker is the Plurai Redis (PLURAI_REDIS_URL), under the key prefix
keys.CELERY_PREFIX. No result backend: the tasks' results are never read (the batch
record holds the progress), so none are stored. JSON only: no pickle is accepted anywhere,
and beat keeps its schedule in memory (the default scheduler stores it with shelve, which
pickles). The URL may hold a password: Celery shows it masked, and nothing here logs it.
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import quote

from celery import Celery

from plurai.broker_config import keys
from plurai.broker_config.connection import SentinelURL, parse_sentinel, resolve_url
from plurai.broker_config.settings import BulkSettings

app = Celery("plurai", include=["plurai.producer.bulk.tasks"])


def configure(celery: Celery, url: str | None = None) -> Celery:
    """Point `celery` at the Redis of `url` (else PLURAI_REDIS_URL / the embedded one)."""
    bs = BulkSettings()
    try:
        url = resolve_url(url)
    except ValueError:
        url = None  # no Redis known yet: configure() again before sending or consuming
    if celery.conf.get("plurai_redis_url") and celery.conf.plurai_redis_url != url:
        # pooled connections of an app that has sent before still lead to the old Redis
        celery._pool = None
        celery.amqp._producer_pool = None
    transport: dict[str, Any] = {
        "global_keyprefix": keys.CELERY_PREFIX,
        "visibility_timeout": bs.visibility_timeout_s,
    }
    broker = url
    sentinel = parse_sentinel(url) if url else None
    if sentinel is not None:
        broker, more = kombu_sentinel(sentinel)
        transport.update(more)
        if sentinel.tls:  # rediss+sentinel: TLS to the primary, certificate verified
            celery.conf.broker_use_ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    celery.conf.update(
        plurai_redis_url=url,  # the tasks' own client connects with it
        broker_url=broker,
        result_backend=None,
        broker_transport_options=transport,
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        beat_scheduler="celery.beat:Scheduler",
        beat_schedule={
            "plurai-bulk-maintain": {
                "task": "plurai.bulk.maintain",
                "schedule": bs.maintain_interval_s,
            }
        },
    )
    return celery


def kombu_sentinel(s: SentinelURL) -> tuple[str, dict[str, Any]]:
    """A sentinel URL as Celery's Redis transport takes it: one sentinel:// URL per sentinel
    (joined by ';', the primary's credentials in each) and transport options."""
    auth = ""
    if s.username or s.password:
        auth = f"{quote(s.username or '', safe='')}:{quote(s.password or '', safe='')}@"
    urls = ";".join(f"sentinel://{auth}{h}:{p}/{s.db}" for h, p in s.hosts)
    options: dict[str, Any] = {"master_name": s.service}
    kw = {k: v for k, v in s.sentinel_kwargs.items() if v is not None and "timeout" not in k}
    if kw:
        options["sentinel_kwargs"] = kw
    return urls, options


configure(app)
