"""Turn a submit call into the request entry (wire protocol v2) and its Submission."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from plurai.broker_config import keys, protocol, tracing
from plurai.broker_config.routes import Routes
from plurai.broker_config.settings import Settings
from plurai.producer.errors import UnknownModel
from plurai.results import jobs, webhook_http

SUBMIT_OPTIONS = frozenset(
    {
        "prompt",
        "messages",
        "token_ids",
        "priority",
        "lane",
        "metadata",
        "idempotency_key",
        "deadline",
        "max_retries",
        "not_before",
        "retry_backoff",
        "model",
        "stream",
        "content_type",
        "cache_salt",
        "special_tokens",
        "webhook",
        "tenant",
    }
)
_SAMPLING = frozenset(protocol.SAMPLING_FIELDS)
# a Submission's scripts (jobs.Submission)
SCRIPTS = ("ENQUEUE", "QUEUED", "SUBMIT", "ENQUEUE_LATER", "DEFER")
MAX_DELAY_S = 30 * 86400  # how far ahead `not_before` may be


def response_format(model: type) -> dict[str, Any]:
    """A pydantic model class as a `response_format` (its JSON schema): the output then
    parses with `model.model_validate_json(result.text)`."""
    schema = getattr(model, "model_json_schema", None)
    if schema is None:
        raise TypeError(
            "response_format takes a dict or a pydantic model class, "
            f"got the class {model.__name__}"
        )
    return {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": schema()}}


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def prepare(settings: Settings, routes: Routes | None = None, **options: Any) -> jobs.Submission:
    """The Submission (results.jobs.submit) that queues the request: `check`, then
    Checked.submission. Its `job_id`, `lane` and `model` say which job, lane and model."""
    return check(settings, routes, **options).submission()


@dataclass(slots=True)
class Checked:
    """A request that passed every check of `check`, its entry encoded but for its job id:
    `submission()` cannot fail. submit_many checks every request before it queues any,
    then builds the submissions while Redis runs the first ones."""

    settings: Settings
    lane: str
    model: str
    shards: int
    priority: int
    fields: list[Any]  # the entry's field/value pairs; the job id's place is empty
    metadata_json: str | None
    idempotency_key: str | None
    not_before_ms: int = 0  # a delayed job's time (unix ms); 0: at once
    webhook: str = ""  # the URL told of the job's end (results/webhooks.py); "": none

    def submission(self) -> jobs.Submission:
        """A new job (its own id) of this request."""
        s, job_id = self.settings, protocol.new_job_id()
        fields = self.fields.copy()
        fields[_ID] = job_id
        shard = keys.shard_of(self.idempotency_key or job_id, self.shards)
        span = None
        if tracing.ON:  # the job's trace starts here; its workers' spans are children
            span = self._span(job_id, shard)
            context = tracing.traceparent(span)
            if context is not None:
                fields += [tracing.TRACEPARENT, context]
        sub = jobs.submit(
            lane=self.lane,
            model=self.model,
            shard=shard,
            job_id=job_id,
            fields=fields,
            created_ms=int(time.time() * 1000),
            priority=self.priority,
            metadata_json=self.metadata_json,
            idempotency_key=self.idempotency_key,
            stream_maxlen=s.stream_maxlen,
            queued_ttl_s=s.queued_ttl_s,
            idempotency_ttl_s=s.idempotency_ttl_s,
            max_queued=s.max_queued_per_lane,
            not_before_ms=self.not_before_ms,
        )
        sub.span, sub.webhook = span, self.webhook
        return sub

    def _span(self, job_id: str, shard: int) -> Any:
        """The submit's span, a child of the current context (the caller's span, the
        gateway's request), ended by producer.submit once Redis has replied."""
        attrs = {
            "plurai.job_id": job_id,
            "plurai.lane": self.lane,
            "plurai.priority": self.priority,
            "plurai.model": self.model,
            "gen_ai.request.model": self.model,
            "messaging.system": "redis",
            "messaging.destination.name": keys.request_stream(self.lane, self.model, shard),
        }
        return tracing.span("submit", attributes=attrs, kind="producer")


_ID = 3  # the job id's place in Checked.fields


def _check_unix_time(name: str, t: Any) -> None:
    """A time option (`deadline`, `not_before`): None, or unix seconds the wire can carry."""
    if t is not None and (
        not isinstance(t, (int, float))
        or isinstance(t, bool)
        or not math.isfinite(t)
        or not 0 <= t * 1000 < protocol.INT64
    ):
        raise ValueError(
            f"{name} must be a unix time in seconds (e.g. time.time() + 60), got {_short(t)}"
        )


def check(
    settings: Settings,
    routes: Routes | None = None,
    *,
    prompt: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    token_ids: list[int] | None = None,
    max_tokens: int = 16,
    priority: int = 0,
    lane: str | None = None,
    metadata: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    deadline: float | None = None,
    max_retries: int | None = None,
    not_before: float | None = None,
    retry_backoff: float | None = None,
    model: str | None = None,
    stream: bool = True,
    content_type: str = protocol.MSGPACK,
    cache_salt: str | None = None,
    special_tokens: bool = False,
    webhook: str | None = None,
    tenant: str | None = None,
    **sampling: Any,
) -> Checked:
    """Check a request and encode its entry (see Checked); raises for what cannot be
    queued. `model` (default: PLURAI_DEFAULT_MODEL)
    picks the queue; `routes` (fresh enough, see Routes.stale) gives its shard count and
    refuses a model no worker serves when the deployment says so (UnknownModel).

    `deadline` is an absolute unix time in seconds (e.g. time.time() + 60); the job fails
    with deadline_exceeded if no worker starts it before then. `max_retries`: how many
    times the job is run again after its processing failed (a worker died on it, the engine
    raised) before it fails with too_many_deliveries; at most PLURAI_MAX_DELIVERIES - 1,
    which is also the default; `retry_backoff` (seconds) makes each run again wait that
    long, doubled at each failure (at most an hour), where it would run again at once.
    `not_before` (unix time in seconds) delays the job: no
    worker starts it before then (its record says when, `not_before_ms`); a time past
    queues it at once. `webhook` (an http(s) URL on the deployment's PLURAI_WEBHOOK_HOSTS)
    is POSTed the job, signed, once it ends (`plurai webhooks` sends it: results/webhooks.py).
    `tenant` names whose job it is (default: the tenant `default`), on its entry and its
    spans; through the gateway, the API key's tenant is set.
    Sampling parameters are
    checked by the worker; only their names are checked here. `response_format` may be a
    pydantic model class (its JSON schema).
    """
    if not _SAMPLING.issuperset(sampling):
        raise TypeError(f"unknown submit option(s) {sorted(set(sampling) - _SAMPLING)}")
    if (prompt is not None) + (messages is not None) + (token_ids is not None) != 1:
        raise ValueError("give exactly one of prompt, messages, token_ids")
    lane = settings.lane_or_default(lane)
    if not _integer(priority) or abs(priority) > protocol.MAX_PRIORITY:
        raise ValueError(
            f"priority must be an integer from -{protocol.MAX_PRIORITY} to "
            f"{protocol.MAX_PRIORITY}, got {_short(priority)}"
        )
    # the worker checks max_tokens against its limit; a value the wire cannot carry as an
    # integer is refused here, before anything is queued
    if not _integer(max_tokens) or not 1 <= max_tokens < protocol.INT64:
        raise ValueError(f"max_tokens must be a positive integer, got {_short(max_tokens)}")
    _check_unix_time("deadline", deadline)
    not_before_ms = 0
    if not_before is not None:
        _check_unix_time("not_before", not_before)
        if not_before - time.time() > MAX_DELAY_S:
            raise ValueError(f"not_before is more than {MAX_DELAY_S // 86400} days ahead")
        if not_before > time.time():
            not_before_ms = int(not_before * 1000)
    if retry_backoff is not None and (
        not isinstance(retry_backoff, (int, float))
        or isinstance(retry_backoff, bool)
        or not math.isfinite(retry_backoff)
        or not 0 <= retry_backoff * 1000 <= protocol.MAX_BACKOFF_MS
    ):
        raise ValueError(
            f"retry_backoff must be seconds from 0 to {protocol.MAX_BACKOFF_MS // 1000}, "
            f"got {_short(retry_backoff)}"
        )
    if max_retries is not None and (
        not _integer(max_retries) or not 0 <= max_retries <= protocol.MAX_RETRIES
    ):
        raise ValueError(
            f"max_retries must be an integer from 0 to {protocol.MAX_RETRIES}, "
            f"got {_short(max_retries)}"
        )
    if idempotency_key is not None and (
        not isinstance(idempotency_key, str) or not idempotency_key
    ):
        # an empty key would pick its shard by the job id: a repeat would queue again
        raise ValueError(
            f"idempotency_key must be a non-empty string, got {_short(idempotency_key)}"
        )
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
    for name, flag in (("stream", stream), ("special_tokens", special_tokens)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {_short(flag)}")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {_short(cache_salt)}")
    if webhook is not None:
        webhook_http.check_url(webhook, settings.webhook_hosts)
    if tenant is not None:
        protocol.tenant_name(tenant)
    if content_type not in protocol.CONTENT_TYPES:
        raise ValueError(
            f"content_type must be one of {list(protocol.CONTENT_TYPES)}, got {_short(content_type)}"
        )
    body: dict[str, Any] = sampling  # a dict of its own (**sampling)
    if isinstance(body.get("response_format"), type):
        body["response_format"] = response_format(body["response_format"])
    if prompt is not None:
        body["prompt"] = prompt
        n = protocol.estimate_prompt_tokens(body)
    elif messages is not None:
        body["messages"] = messages
        n = protocol.estimate_prompt_tokens(body)
    else:
        body["token_ids"] = token_ids
        n = len(token_ids or ())
    model = protocol.model_name(model) if model is not None else settings.default_model
    if routes is not None and routes.refused(model):
        raise UnknownModel(model, routes.live())
    if metadata is not None:
        body["metadata"] = metadata
    if not stream:
        body["stream"] = False
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if special_tokens:
        body["special_tokens"] = True
    fields: list[Any] = [
        "v",
        protocol.VERSION,
        "id",
        "",
        "priority",
        priority,
        "lane",
        lane,
        "model",
        model,
        "prompt_tokens",
        n,
        "max_tokens",
        max_tokens,
        "content_type",
        content_type,
        "body",
        protocol.encode_body(body, content_type),
    ]
    if deadline is not None:
        fields += ["deadline", int(deadline * 1000)]
    if max_retries is not None:
        fields += ["max_retries", max_retries]
    if retry_backoff:
        fields += ["retry_backoff_ms", round(retry_backoff * 1000)]
    if idempotency_key is not None:
        fields += ["idem", idempotency_key]
    if tenant is not None:
        fields += ["tenant", tenant]
    return Checked(
        settings,
        lane,
        model,
        routes.shards(model) if routes is not None else 1,
        priority,
        fields,
        json.dumps(metadata, separators=(",", ":")) if metadata is not None else None,
        idempotency_key,
        not_before_ms,
        webhook or "",
    )
