"""A request's hold on its key's limits: its quota lease (admission, the concurrency slot
renewed while it runs, the unused tokens given back once it ends) and the streams each key
has open on this gateway process."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis
import redis.asyncio

from plurai.broker_config import keys, protocol
from plurai.gateway import quota
from plurai.gateway.apikeys import Key
from plurai.gateway.errors import ApiError

log = logging.getLogger("plurai.gateway")

FINAL_POLL_S = 1.0  # how often a background job's record is read for its end


def max_output(options: dict[str, Any]) -> int:
    """The most output tokens a request can make: max_tokens for each of its n choices."""
    return options["max_tokens"] * options.get("n", 1)


def request_tokens(options: dict[str, Any]) -> int:
    """What a request counts against a tokens/min quota: its prompt estimate (the same as
    the queue's length metadata) plus its output tokens at most."""
    if "token_ids" in options:
        prompt = len(options["token_ids"])
    else:
        prompt = protocol.estimate_prompt_tokens(
            {k: options[k] for k in ("prompt", "messages") if k in options}
        )
    return prompt + max_output(options)


class StreamSlot:
    """One open stream of a key, counted until `release` (once)."""

    def __init__(self, owner: OpenStreams, name: str) -> None:
        self.owner, self.name = owner, name
        self.passed = False  # its release is up to the stream's close
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.owner.release(self.name)


class OpenStreams:
    """The streams each API key has open on this gateway process, up to `cap` (0: no cap);
    an open gateway's requests (no key) share one count."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.count: dict[str, int] = {}

    def take(self, key: Key | None) -> StreamSlot | None:
        name = key.id if key is not None else ""
        n = self.count.get(name, 0)
        if self.cap and n >= self.cap:
            return None
        self.count[name] = n + 1
        return StreamSlot(self, name)

    def release(self, name: str) -> None:
        n = self.count.get(name, 0) - 1
        if n > 0:
            self.count[name] = n
        else:
            self.count.pop(name, None)


class Lease:
    """A request's quota: admitted (counted) before its job is queued, its concurrency slot
    renewed while the response is open and released when it ends, and the tokens its job
    did not generate given back to the key's tokens per minute once it has ended."""

    def __init__(self, r: redis.asyncio.Redis, key: Key | None, job_id: str) -> None:
        self.r, self.key, self.job_id = r, key, job_id
        self.passed = False  # its close is up to a stream or a background task
        self.held = False  # whether it may hold a concurrency slot, for `close` to release
        self.renewing: asyncio.Task | None = None
        self.counted = 0  # tokens counted against tpm at admission (0: none)
        self.max_tokens = 0
        self.admitted_at = 0.0

    async def admit(self, tokens_: int, max_tokens: int = 0) -> None:
        """Count the request against its key's quotas; an ApiError (429) when refused.
        `max_tokens`: of `tokens_`, what `settle` may give back (0: nothing)."""
        if self.key is None or not self.key.limited:
            return
        # from the call on: an error may come after the script took the slot
        self.held = bool(self.key.concurrent)
        verdict = await quota.admit(self.r, self.key, tokens_, self.job_id)
        if not verdict.admitted:
            self.held = False
            raise ApiError(
                429,
                verdict.message or f"over the key's {verdict.limit} limit",
                "rate_limit_exceeded",
                param=verdict.limit,
                retry_after=verdict.retry_after,
                kind="rate_limit_error",
            )
        if self.key.tpm and max_tokens > 0:
            self.counted, self.max_tokens = tokens_, max_tokens
            self.admitted_at = time.monotonic()
        if self.key.concurrent:
            self.renewing = asyncio.ensure_future(self._renew())

    async def _renew(self) -> None:
        assert self.key is not None
        while True:
            await asyncio.sleep(quota.LEASE_S / 3)
            try:
                await quota.renew(self.r, self.key, self.job_id)
            except redis.RedisError:  # a blip: the lease outlasts two more tries
                log.warning("could not renew a concurrency slot; trying again")

    async def close_when_final(self) -> None:
        """Close once the job has ended: for a `background` job whose client left, so that
        running jobs count against the key's limit whether anyone reads them or not."""
        try:
            while self.held:
                state, final = await self.r.hmget(keys.job(self.job_id), "state", "final")
                if state is None or final is not None:  # ended (or its record expired)
                    break
                await asyncio.sleep(FINAL_POLL_S)
        except redis.RedisError:
            pass  # released below if Redis takes it; else the slot's lease runs out
        finally:
            await self.close()
        await self.settle()

    async def settle(self, output_tokens: int | None = None) -> None:
        """Give back the tokens the job did not generate (max_tokens less its output) to
        the key's tokens per minute, once it has ended (`output_tokens`: known already;
        else its record is read until it is final, while the admission is still in the
        minute window). Once per request."""
        counted, self.counted = self.counted, 0
        if not counted or self.key is None:
            return
        window_end = self.admitted_at + quota.WINDOW_MS / 1000
        try:
            while output_tokens is None:
                state, final, out = await self.r.hmget(
                    keys.job(self.job_id), "state", "final", "output_tokens"
                )
                if state is None or final is not None:
                    output_tokens = _count(out)
                elif time.monotonic() > window_end:
                    return  # the admission has left the window: nothing to give back
                else:
                    await asyncio.sleep(FINAL_POLL_S)
            await quota.refund(
                self.r, self.key, self.job_id, counted, self.max_tokens - output_tokens
            )
        except redis.RedisError as e:  # the tokens stay counted until the window passes
            log.warning("could not give back a job's unused tokens: %s", e)

    async def close(self) -> None:
        if self.renewing is not None:
            self.renewing.cancel()
            self.renewing = None
        if not self.held:
            return
        self.held = False
        assert self.key is not None
        try:
            await quota.release(self.r, self.key, self.job_id)
        except redis.RedisError:  # the slot's lease runs out instead
            log.warning("could not release a concurrency slot; it expires")


def _count(v: str | None) -> int:
    """A record's count field (read on the gateway's decoding connection); 0 when absent
    or not a count."""
    return int(v) if v is not None and v.isascii() and v.isdigit() else 0
