"""docs/settings.md, written from `Settings` and `BulkSettings`: each setting's variable,
default, range and description (its attribute docstring), and which processes read it.

    python -m plurai.broker_config.settings_doc            # rewrite docs/settings.md
    python -m plurai.broker_config.settings_doc --check    # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from annotated_types import Ge, Gt, Le, Lt
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from plurai.broker_config.settings import CONFIG_ENV, BulkSettings, Settings

DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"

# Which processes read each setting. Clients: the SDK, the CLI and the gateway, which
# submit jobs and read results; a setting read by workers only is the workers' own.
READ_BY: dict[str, str] = {
    "every process": "redis_url data_dir lanes default_model block_ms log_level log_format",
    "clients": "default_lane submit_replicas submit_replicas_timeout_ms queued_ttl_s "
    "idempotency_ttl_s max_queued_per_lane queue_full_retry_s unserved",
    "clients and workers": "stream_maxlen result_ttl_s output_ttl_s max_tokens_limit "
    "max_grammar_bytes",
    "workers": "output_maxlen stream_flush_tokens stream_flush_ms dead_letter_maxlen "
    "recent_jobs_maxlen max_body_bytes max_prompt_chars max_messages max_stop "
    "max_stop_chars max_stop_token_ids max_metadata_bytes max_logprobs max_n poll_ms "
    "balance_ms grace_period_s heartbeat_interval_s reclaim_interval_s max_deliveries "
    "redis_retry_s redis_wait_s fair_every top_lane_reserve preempt top_lane_slowdown "
    "top_lane_tpot_ms top_lane_wait_ms prefill_backlog_tokens takes_per_step served_model "
    "shards kv_redis_url kv_secret kernels kernel_isa kernels_dir kernels_build_timeout_s "
    "vllm_kv_share vllm_engine_process worker_id metrics_port metrics_host",
    "workers and Celery's maintenance": "reclaim_idle_ms",
    "workers, the bulk Celery worker and `plurai batch`": "model_dir",
    "clients and `plurai webhooks`": "webhook_hosts",
    "`plurai webhooks`": "webhook_secret webhook_private webhook_attempts webhook_retry_s "
    "webhook_timeout_s webhook_max_bytes webhook_concurrency webhook_poll_s",
    "the gateway": "gateway_host gateway_port gateway_max_request_bytes "
    "gateway_default_max_tokens gateway_max_connections gateway_header_timeout_s "
    "gateway_body_timeout_s gateway_keepalive_s gateway_max_header_bytes "
    "gateway_stream_stall_s gateway_max_streams_per_key",
    "the gateway and `plurai dashboard`": "dashboard dashboard_port dashboard_history_s "
    "dashboard_sample_s dashboard_refresh_s",
    "Celery's batch workers and the batch clients": "window max_line_bytes pass_s poll_s "
    "look_s completion_window_s ttl_s running_ttl_s max_step_failures stale_s "
    "maintain_interval_s visibility_timeout_s",
}


def readers() -> dict[str, str]:
    """Setting name -> who reads it (BulkSettings' names are prefixed `batch.`)."""
    out: dict[str, str] = {}
    for who, names in READ_BY.items():
        for name in names.split():
            key = f"batch.{name}" if name in BulkSettings.model_fields else name
            if key in out:
                raise ValueError(f"{name} is in READ_BY twice")
            out[key] = who
    return out


def _default(f: FieldInfo) -> str:
    value = f.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return json.dumps(value)
    if isinstance(value, int) and value >= 10_000:
        return f"{value:_}"
    return str(value)


def _range(f: FieldInfo) -> str:
    signs = {Ge: (">=", "ge"), Gt: (">", "gt"), Le: ("<=", "le"), Lt: ("<", "lt")}
    parts = []
    for m in f.metadata:
        if type(m) in signs:
            sign, attr = signs[type(m)]
            bound = getattr(m, attr)
            parts.append(f"{sign} {bound:_}" if isinstance(bound, int) else f"{sign} {bound}")
    args = getattr(f.annotation, "__args__", ())
    if args and all(isinstance(a, str) for a in args):  # Literal
        parts.append(" or ".join(args))
    return ", ".join(parts)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(cls: type[BaseSettings], who: dict[str, str], key: str) -> list[str]:
    lines = ["| variable | default | range | read by | what it does |", "|---|---|---|---|---|"]
    for name, f in cls.model_fields.items():
        var = cls.model_config["env_prefix"] + name.upper()
        lines.append(
            f"| `{var}` | `{_default(f)}` | {_range(f)} | {who[key + name]} "
            f"| {_cell(f.description or '')} |"
        )
    return lines


def render() -> str:
    who = readers()
    head = [
        "# Settings",
        "",
        "<!-- Written by `python -m plurai.broker_config.settings_doc` from broker_config/settings.py;"
        " edit the settings' docstrings there, not this page. -->",
        "",
        "Every process reads its settings from, highest first: command-line options where it"
        " has them (`plurai worker --model`, `--engine`, ...), the environment variables"
        f" below, the TOML file named by `{CONFIG_ENV}` (its keys are the names after the"
        " prefix, in lower case; the batch settings in its table `[batch]`), then the"
        " defaults. A bad value stops the process at start with the variable named.",
        "",
        "```toml",
        "# PLURAI_CONFIG=/etc/plurai.toml",
        'redis_url = "rediss://worker:secret@redis.internal:6380/0"',
        "top_lane_tpot_ms = 60",
        "[batch]",
        "window = 512",
        "```",
        "",
        "Clients are the SDK (`producer/`), the CLI and the gateway; a setting the clients"
        " read must agree across them and the workers where both read it.",
        "",
        "## Queue, workers, gateway",
        "",
    ]
    bulk = [
        "",
        "## Bulk batches",
        "",
        "Celery's batch workers (`producer/bulk`) and the clients that create batches.",
        "",
    ]
    lines = head + _table(Settings, who, "") + bulk + _table(BulkSettings, who, "batch.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/settings.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(
                f"{DOC} is stale: run python -m plurai.broker_config.settings_doc", file=sys.stderr
            )
            return 1
        return 0
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
