"""Celery tasks of bulk batches.

`plurai.bulk.step(batch_id, gen)` does one pass of the batch (drive.step) and queues
itself again until the batch is terminal. The tasks are the entry points of the bulk
driver: they read the settings (Settings through their Client, BulkSettings) and pass
them down. `gen` is the batch's generation: kicking a batch
(submit, worker start, maintenance) bumps it and sends a new step, and a step of an older
generation ends at once, so one chain of steps drives a batch however often it is kicked.
Steps are idempotent, so a step that runs twice (redelivered after a crash) is harmless.

`plurai.bulk.maintain` (celery beat): re-kicks running batches whose driver went silent,
expires batches past their completion window, forgets batches whose keys expired.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import redis
from celery import signals

from plurai.broker_config import keys
from plurai.broker_config.celery_app import app
from plurai.broker_config.connection import resolve_url
from plurai.broker_config.groups import forget_dead_consumers, forget_dead_workers
from plurai.broker_config.settings import BulkSettings, Settings
from plurai.broker_config.text import text
from plurai.producer.bulk import drive, store
from plurai.producer.client import Client
from plurai.results.records import BadRecord

log = logging.getLogger(__name__)
STEP = "plurai.bulk.step"


def _client() -> Client:
    return _client_for(resolve_url(app.conf.get("plurai_redis_url") or app.conf.broker_url))


@functools.lru_cache(maxsize=4)
def _client_for(url: str) -> Client:
    return Client(url)


def kick(client: Client, batch_id: str) -> int | None:
    """Start a new chain of steps for the batch; returns its generation (None: no such
    batch, nothing sent). The Celery app must point at the client's Redis
    (broker_config.celery_app.configure)."""
    if not app.conf.broker_url:
        raise ValueError("the Celery app has no broker: call celery_app.configure(app, url)")
    gen = store.bump_gen(client.redis, store.check_id(batch_id))
    if gen is not None:
        app.send_task(STEP, args=[batch_id, gen])
    return gen


@app.task(name=STEP, acks_late=True)
def step(batch_id: str, gen: int) -> str:
    try:
        store.check_id(batch_id)
    except store.InvalidBatchId as e:  # a message no Plurai client sends
        log.warning("%s; step ignored", e)
        return "invalid"
    client = _client()
    current = client.redis.hget(keys.batch(batch_id), "gen")
    if current is None or text(current) != str(gen):
        return "superseded"  # a kick started a newer chain (or the record is damaged)
    bs = BulkSettings()
    try:
        status = drive.step(client, batch_id, bs)
    except Exception as e:  # a damaged record or a bug: counted, then the batch fails
        return _failed(client.redis, batch_id, e, bs)
    client.redis.hdel(keys.batch(batch_id), "step_failures")  # they count in a row
    if status not in store.TERMINAL:
        app.send_task(STEP, args=[batch_id, gen])
    return status


def _failed(r: redis.Redis, batch_id: str, e: Exception, bs: BulkSettings) -> str:
    """A step that raised: raised again (maintenance kicks the batch after stale_s) until
    max_step_failures in a row, when the batch fails rather than failing for ever."""
    try:
        n = r.hincrby(keys.batch(batch_id), "step_failures", 1)
    except redis.RedisError:
        raise e from None  # Redis itself: nothing to count on
    if n < bs.max_step_failures:
        raise e
    log.error("batch %s: %d steps failed in a row; the batch fails", batch_id, n, exc_info=e)
    return drive.give_up(r, batch_id, f"its driver failed {n} times: {type(e).__name__}: {e}", bs)


@app.task(name="plurai.bulk.maintain", acks_late=True)
def maintain() -> dict[str, Any]:
    client = _client()
    r = client.redis
    bs = BulkSettings()
    now = store.now_ms()
    kicked, expired = [], []
    for batch_id in store.unfinished(r):
        try:
            rec = store.get(r, batch_id)
        except BadRecord as e:  # its steps fail the same way, until the batch gives up
            log.warning("%s", e)
            rec = None
        created = rec.created_ms or now if rec is not None else now
        if (
            now - created > bs.completion_window_s * 1000
            and rec is not None
            and rec.status
            in (
                store.VALIDATING,
                store.IN_PROGRESS,
            )
        ):
            pipe = r.pipeline(transaction=False)
            pipe.hset(keys.batch(batch_id), "stop_reason", "expired")
            pipe.expire(keys.batch(batch_id), bs.running_ttl_s)  # even if it just expired
            pipe.execute()
            store.move(r, batch_id, store.CANCELLING, store.VALIDATING, store.IN_PROGRESS)
            expired.append(batch_id)
        beat = rec.beat_ms or created if rec is not None else 0
        if batch_id in expired or now - beat > bs.stale_s * 1000:
            try:
                kick(client, batch_id)
            except redis.ResponseError as e:  # e.g. a gen that is not a number
                log.warning("batch %s not kicked, its record is damaged: %s", batch_id, e)
                continue
            kicked.append(batch_id)
    # stranded entries are reclaimed by the live GPU workers themselves (XCLAIM); what
    # the dead ones leave behind is their name in the consumer group
    settings = client.settings
    forgotten = forget_dead_consumers(r, settings.lanes, 10 * settings.reclaim_idle_ms)
    return {
        "kicked": kicked,
        "expired": expired,
        "forgotten_consumers": forgotten,
        "forgotten_workers": forget_dead_workers(r),
    }


def check_model_dir(settings: Settings) -> str | None:
    """Why this driver cannot split documents (None: it can), said once at its start rather
    than only in every document's error line: PLURAI_MODEL_DIR unset, or no tokenizer
    there."""
    model_dir = settings.model_dir
    if not model_dir:
        return (
            "PLURAI_MODEL_DIR is not set: every document batch (plurai batch submit --task) "
            "fails with model_unavailable; set it to the model folder the GPU workers serve "
            "(OpenAI Batch files run without it)"
        )
    try:
        drive.tokenizer(model_dir)  # loaded once here, not on the first batch
    except Exception as e:  # transformers raises many kinds; each says why
        return (
            f"PLURAI_MODEL_DIR={model_dir}: its tokenizer cannot be loaded "
            f"({type(e).__name__}: {e}); document batches will fail"[:500]
        )
    return None


@signals.worker_ready.connect
def _resume(**_: Any) -> None:
    """A (re)started Celery worker picks up every unfinished batch at once, rather than
    waiting for the broker's visibility timeout to redeliver a step lost in a crash."""
    client = _client()
    problem = check_model_dir(client.settings)
    if problem is not None:
        log.warning("%s", problem)
    for batch_id in store.unfinished(client.redis):
        log.info("resuming batch %s", batch_id)
        try:
            kick(client, batch_id)
        except redis.ResponseError as e:
            log.warning("batch %s not resumed, its record is damaged: %s", batch_id, e)
