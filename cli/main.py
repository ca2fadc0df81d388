"""The `plurai` command.

plurai worker --model models/tiny-llama      serve the queue (embedded Redis if no URL)
plurai submit "Summarize: ..." --stream      queue a job; print its id, or stream it
plurai get JOB_ID [--wait 30]                print a job record as JSON
plurai watch JOB_ID                          stream a job's text as it is generated
plurai status [--json]                       lanes, workers, KV use and throughput (live)
plurai webhooks                              send the webhooks of ended jobs
plurai make-model models/tiny-llama          write a random-weight test model
plurai quantize SRC DST --scheme w4a16       write a quantized copy of a float model
plurai batch submit FILE|DIR [--task ...]    run an OpenAI Batch JSONL, or documents, in bulk
plurai batch status|cancel|results ID        watch, stop, or fetch the output of a batch

One file, though long: every subcommand's arguments, each handler a few lines calling
into its package.
"""

# Also `python -m plurai.cli ...`. The client commands use producer/ (the SDK); `worker`,
# `make-model` and `quantize` dispatch to gpu_workers, imported only when used.

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable
from typing import Any


def _client(args: argparse.Namespace) -> Any:
    from plurai.producer.client import Client

    return Client(args.url)


def _json(option: str, value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError as e:
        raise ValueError(f"{option}: not JSON ({e}): {value[:60]!r}") from None


def cmd_submit(args: argparse.Namespace) -> int:
    from plurai.producer.errors import JobCancelled, JobFailed, JobRestarted

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    options: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "priority": args.priority,
        "lane": args.lane,
        "idempotency_key": args.idempotency_key,
        "model": args.model,
        "webhook": args.webhook,
        "tenant": args.tenant,
    }
    if args.messages:
        options["messages"] = _json("--messages", prompt)
        prompt = None
    if args.metadata:
        options["metadata"] = _json("--metadata", args.metadata)
    if args.param:
        for kv in args.param:
            name, eq, value = kv.partition("=")
            if not name or not eq:
                raise ValueError(f"--param takes NAME=JSON, e.g. top_k=20; got {kv[:60]!r}")
            options[name] = _json(f"--param {name}", value)
    with _client(args) as client:
        job = client.submit(prompt, **{k: v for k, v in options.items() if v is not None})
        print(job.id, file=sys.stderr if args.stream or args.wait is not None else sys.stdout)
        try:
            if args.stream:
                for text in job.stream():
                    sys.stdout.write(text)
                    sys.stdout.flush()
                sys.stdout.write("\n")
            elif args.wait is not None:
                print(job.result(timeout=args.wait).text)
        except (JobFailed, JobCancelled, JobRestarted, TimeoutError) as e:
            print(f"plurai: {e}", file=sys.stderr)
            return 1
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    from plurai.results import records, wait

    with _client(args) as client:
        if args.wait is not None:
            rec = wait.wait(client.redis, args.job_id, args.wait)
        else:
            rec = records.get(client.redis, args.job_id)
    print(json.dumps(rec.to_dict(), indent=2, ensure_ascii=False))
    return 0 if rec.state != records.UNKNOWN else 1


def cmd_watch(args: argparse.Namespace) -> int:
    from plurai.producer.errors import JobCancelled, JobFailed, JobRestarted

    with _client(args) as client:
        try:
            for text in client.job(args.job_id).stream():
                sys.stdout.write(text)
                sys.stdout.flush()
        except (JobFailed, JobCancelled, JobRestarted) as e:
            print(f"\nplurai: {e}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    return 0


def _with_redis(handler: Callable[[argparse.Namespace, Any], int]) -> Callable[..., int]:
    """A command handler given a connection to the Redis of `--url` (else PLURAI_REDIS_URL,
    else the embedded one), closed after it."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        from plurai.broker_config.connection import connect, resolve_url

        r = connect(resolve_url(args.url))
        try:
            return handler(args, r)
        finally:
            r.close()

    return run


def cmd_status(args: argparse.Namespace) -> int:
    import redis

    from plurai.broker_config.connection import connect, redact, resolve_url
    from plurai.broker_config.settings import Settings
    from plurai.producer import status

    url = resolve_url(args.url)
    r = connect(url)
    try:
        settings = Settings()
        return status.show(
            r,
            settings.lanes,
            settings.default_model,
            as_json=args.json,
            once=args.once,
            every=args.interval,
        )
    except redis.RedisError as e:
        print(f"plurai: cannot read Redis at {redact(url)}: {redact(str(e))}", file=sys.stderr)
        return 1
    finally:
        r.close()


@_with_redis
def cmd_dead_letters(args: argparse.Namespace, r: Any) -> int:
    """`plurai dead-letters list|requeue|drop`: entries no worker could finish."""
    from plurai.broker_config.settings import Settings
    from plurai.producer import dead_letters as dead

    if args.action == "list":
        found = dead.list_dead(r, args.count)
        if args.json:
            for d in found:
                print(json.dumps({**vars(d), "at_ms": d.at_ms}))
            return 0
        for d in found:
            again = "requeueable" if d.requeueable else "not requeueable"
            print(f"{d.id}  {d.lane}  job {d.job_id or '(none)'}  {again}  {d.error}")
        print(f"{len(found)} dead letter(s)", file=sys.stderr)
        return 0
    ids = args.ids or ([d.id for d in dead.list_dead(r, dead.MAX_LIST)] if args.all else [])
    if not ids:
        raise ValueError("name dead letters by id (`plurai dead-letters list`), or --all")
    if args.action == "drop":
        print(f"dropped {dead.drop(r, ids)} dead letter(s)")
        return 0
    failed = 0
    settings = Settings()
    routes = dead.read_routes(r, settings)
    for dead_id in ids:
        try:
            print(f"{dead_id}  requeued job {dead.requeue(r, dead_id, settings, routes)}")
        except dead.DeadLetterError as e:
            print(f"{dead_id}  {e.code}: {e.message}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


@_with_redis
def cmd_lane(args: argparse.Namespace, r: Any) -> int:
    """`plurai lane list|pause|resume|purge`: an operator's controls of a lane."""
    from plurai.broker_config.settings import Settings
    from plurai.producer import lanes

    if args.action == "list":
        for model, lane in lanes.paused(r):
            print(f"{model}  {lane}  paused")
        return 0
    if args.lane is None:
        raise ValueError(f"`plurai lane {args.action}` needs a lane")
    settings, model = Settings(), args.model
    if args.action == "pause":
        was = not lanes.pause(r, args.lane, model, settings)
        print(f"{args.lane}: paused" + (" (already)" if was else ""))
    elif args.action == "resume":
        was = not lanes.resume(r, args.lane, model, settings)
        print(f"{args.lane}: resumed" + (" (it was not paused)" if was else ""))
    else:
        print(f"{args.lane}: {lanes.purge(r, args.lane, model, settings)} job(s) cancelled")
    return 0


def cmd_webhooks(args: argparse.Namespace) -> int:
    """`plurai webhooks`: send the webhooks of ended jobs until SIGTERM or Ctrl-C."""
    import signal
    import threading

    from plurai.broker_config import logs
    from plurai.broker_config.connection import connect, redact, resolve_url
    from plurai.broker_config.settings import Settings
    from plurai.results.webhooks import Notifier

    settings = Settings()
    logs.setup(settings.log_level, settings.log_format)
    url = resolve_url(args.url, settings)
    notifier = Notifier(connect(url), settings)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    hosts = ", ".join(settings.webhook_hosts) or "none (PLURAI_WEBHOOK_HOSTS)"
    print(f"plurai webhooks: {redact(url)}; allowed hosts: {hosts}", file=sys.stderr)
    notifier.run(stop)
    return 0


def _batch_client(args: argparse.Namespace) -> Any:
    from plurai.broker_config.celery_app import app, configure
    from plurai.broker_config.connection import resolve_url

    url = resolve_url(args.url)
    configure(app, url)
    return _client(argparse.Namespace(url=url))


def cmd_batch_submit(args: argparse.Namespace) -> int:
    from pathlib import Path

    from plurai.producer.bulk import manage, progress
    from plurai.producer.bulk.plan import Task, schema_of, schema_text

    task = None
    if args.task:
        schema = args.schema
        if schema and schema.startswith("@"):
            try:
                schema = Path(schema[1:]).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read the schema file {schema[1:]}: {e}") from None
        task = Task(
            name=args.task,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            schema=schema_text(schema_of(schema)) if schema else None,
            labels=tuple(x.strip() for x in args.labels.split(",") if x.strip())
            if args.labels
            else (),
            template=args.template,
            reduce_template=args.reduce_template,
        )
    model = args.model
    if task is not None and not model:
        from plurai.broker_config.settings import Settings

        model = Settings().model_dir
    with _batch_client(args) as client:
        from plurai.broker_config.settings import BulkSettings

        batch_id = manage.create(
            client,
            BulkSettings(),
            Path(args.input),
            task=task,
            model_dir=model,
            max_model_len=args.max_model_len,
        )
        print(batch_id)
        if args.watch:
            progress.watch(client, batch_id)
    return 0


def cmd_batch_status(args: argparse.Namespace) -> int:
    from plurai.producer.bulk import manage, progress

    with _batch_client(args) as client:
        if args.json:
            print(json.dumps(manage.info(client, args.batch_id), indent=2))
        else:
            progress.watch(client, args.batch_id)
    return 0


def cmd_batch_cancel(args: argparse.Namespace) -> int:
    from plurai.producer.bulk import manage

    with _batch_client(args) as client:
        print(manage.cancel(client, args.batch_id))
    return 0


def cmd_batch_results(args: argparse.Namespace) -> int:
    from pathlib import Path

    from plurai.producer.bulk import manage, store

    # the id names the files: one that is not a plain name (`..`, a separator, an absolute
    # path) is refused before anything is read or written
    store.check_id(args.batch_id)
    with _batch_client(args) as client:
        try:
            out, err = manage.results(client, args.batch_id)
        except ValueError as e:  # not finished yet
            print(f"plurai: {e.args[0]}", file=sys.stderr)
            return 1
    if args.print:
        sys.stdout.write(out)
        sys.stderr.write(err)
        return 0
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("output", out), ("errors", err)):
        path = folder / f"{args.batch_id}_{name}.jsonl"
        if path.parent != folder or path.is_symlink():
            raise ValueError(f"refusing to write {path}: not a plain file in {folder}")
        path.write_text(text, encoding="utf-8")
        print(f"{path}  {text.count(chr(10))} lines")
    return 0


def add_batch_parser(sub: Any) -> None:
    b = sub.add_parser("batch", help="bulk offline processing (plurai batch -h)")
    bsub = b.add_subparsers(dest="batch_command", required=True)
    s = bsub.add_parser(
        "submit", help="submit an OpenAI Batch JSONL, or documents (a folder or JSONL) with --task"
    )
    s.add_argument("input", help="JSONL file, or a folder of documents")
    s.add_argument("--task", choices=["summarize", "extract", "classify", "custom"])
    s.add_argument(
        "--schema", help="extract: a JSON schema, or @FILE; every output is JSON that validates"
    )
    s.add_argument("--labels", help="classify: comma-separated labels; every output is one")
    s.add_argument("--template", help="custom: a prompt template containing {text}")
    s.add_argument("--reduce-template", help="custom: template that merges chunk outputs")
    s.add_argument("--max-tokens", type=int, default=64, help="per request of a task")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--model", help="model directory, for its tokenizer (PLURAI_MODEL_DIR)")
    s.add_argument("--max-model-len", type=int, help="the workers' context (default: the model's)")
    s.add_argument("--watch", action="store_true", help="show progress until it ends")
    s.set_defaults(func=cmd_batch_submit)
    st = bsub.add_parser("status", help="live progress (done/total, tokens/s, ETA)")
    st.add_argument("batch_id")
    st.add_argument("--json", action="store_true", help="print the batch record once, as JSON")
    st.set_defaults(func=cmd_batch_status)
    c = bsub.add_parser("cancel", help="cancel a batch; finished lines are kept")
    c.add_argument("batch_id")
    c.set_defaults(func=cmd_batch_cancel)
    r = bsub.add_parser("results", help="write ID_output.jsonl and ID_errors.jsonl")
    r.add_argument("batch_id")
    r.add_argument("--dir", default=".", help="folder for the two files (default: here)")
    r.add_argument("--print", action="store_true", help="output lines to stdout, errors to stderr")
    r.set_defaults(func=cmd_batch_results)
    for p in (s, st, c, r):
        p.add_argument("--url", help="Redis URL (default: PLURAI_REDIS_URL or the embedded one)")


def cmd_worker(rest: list[str]) -> int:
    from plurai.gpu_workers import serve as worker

    return worker.main(rest)


def cmd_gateway(rest: list[str], dashboard: bool = False) -> int:
    from plurai.gateway import serve as gateway

    return gateway.main(rest, dashboard=dashboard)


def cmd_make_model(rest: list[str]) -> int:
    from plurai.gpu_workers.models import factory

    p = argparse.ArgumentParser(prog="plurai make-model", description="write a random-weight model")
    factory.add_arguments(p)
    return factory.cli(p.parse_args(rest))


def cmd_quantize(rest: list[str]) -> int:
    from plurai.gpu_workers.models import quantize as q

    p = argparse.ArgumentParser(
        prog="plurai quantize",
        description="write a quantized copy of a float model (compressed-tensors format, "
        "round to nearest, no calibration data)",
    )
    p.add_argument("src", help="the float model folder (config.json, safetensors, tokenizer)")
    p.add_argument("dst", help="folder to write the quantized model into (new or empty)")
    p.add_argument(
        "--scheme",
        required=True,
        choices=q.SCHEMES,
        help="w8a16: int8 weights per channel; w8a8: the same and int8 activations per token; "
        "w4a16: int4 weights per group",
    )
    p.add_argument(
        "--group-size",
        type=int,
        metavar="N",
        help=f"w4a16: input columns a scale covers; must divide every layer's input size "
        f"(default {q.DEFAULT_GROUP_SIZE})",
    )
    args = p.parse_args(rest)
    try:
        q.quantize(args.src, args.dst, args.scheme, args.group_size)
    except (ValueError, FileNotFoundError) as e:  # what SRC, DST or an option is
        print(f"plurai quantize: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # reading or writing failed: a full disk, no permission
        print(f"plurai quantize: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.src} quantized {args.scheme} to {args.dst}")
    return 0


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _wait_s(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plurai", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("submit", help="queue a job")
    s.add_argument("prompt", help="prompt text, or - to read it from stdin")
    s.add_argument(
        "--messages", action="store_true", help="the prompt is a JSON list of chat messages"
    )
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float)
    s.add_argument("--priority", type=int, help="lower runs first inside the engine (default 0)")
    s.add_argument("--lane", help="interactive | standard | batch (or as configured)")
    s.add_argument("--model")
    s.add_argument("--metadata", help="a JSON object stored with the job")
    s.add_argument("--idempotency-key")
    s.add_argument("--webhook", metavar="URL", help="POSTed the job, signed, once it ends")
    s.add_argument("--tenant", help="whose job it is (default: the tenant 'default')")
    s.add_argument(
        "--param", action="append", metavar="NAME=JSON", help="any sampling field, e.g. top_k=20"
    )
    s.add_argument("--stream", action="store_true", help="print the text as it is generated")
    s.add_argument("--wait", type=_wait_s, metavar="SECONDS", help="wait for and print the result")
    s.set_defaults(func=cmd_submit)

    g = sub.add_parser("get", help="print a job record as JSON")
    g.add_argument("job_id")
    g.add_argument("--wait", type=_wait_s, metavar="SECONDS", help="wait until the job ends")
    g.set_defaults(func=cmd_get)

    w = sub.add_parser("watch", help="stream a job's text")
    w.add_argument("job_id")
    w.set_defaults(func=cmd_watch)

    st = sub.add_parser("status", help="lanes, workers, KV use and throughput (live view)")
    st.add_argument("--json", action="store_true", help="print one reading as JSON")
    st.add_argument("--once", action="store_true", help="print one view and exit")
    st.add_argument(
        "--interval", type=_positive, default=1.0, help="seconds between refreshes (default 1)"
    )
    st.set_defaults(func=cmd_status)

    d = sub.add_parser(
        "dead-letters", help="entries no worker could finish: list, requeue or drop them"
    )
    d.add_argument("action", choices=["list", "requeue", "drop"])
    d.add_argument("ids", nargs="*", help="dead letter ids (as `list` prints them)")
    d.add_argument("--all", action="store_true", help="requeue or drop every dead letter")
    d.add_argument("--count", type=int, default=100, help="list: how many, newest first")
    d.add_argument("--json", action="store_true", help="list: one JSON object per line")
    d.set_defaults(func=cmd_dead_letters)

    ln = sub.add_parser("lane", help="pause, resume or purge a lane (list: the paused lanes)")
    ln.add_argument("action", choices=["list", "pause", "resume", "purge"])
    ln.add_argument("lane", nargs="?", help="a lane (PLURAI_LANES)")
    ln.add_argument("--model", help="the model whose lane it is (default: PLURAI_DEFAULT_MODEL)")
    ln.set_defaults(func=cmd_lane)

    wh = sub.add_parser(
        "webhooks", help="send the webhooks of ended jobs (PLURAI_WEBHOOK_*), until stopped"
    )
    wh.set_defaults(func=cmd_webhooks)

    for name in ("submit", "get", "watch", "status", "dead-letters", "lane", "webhooks"):
        sub.choices[name].add_argument(
            "--url", help="Redis URL (default: PLURAI_REDIS_URL or the embedded one)"
        )
    add_batch_parser(sub)
    from plurai.gateway import keys_cli

    k = sub.add_parser("keys", help="the gateway's API keys (create, list, revoke)")
    keys_cli.add_arguments(k)
    k.set_defaults(func=keys_cli.main)
    # These parse their own arguments, so their heavy imports happen only when used.
    sub.add_parser(
        "worker", help="serve the queue with an engine (plurai worker --help)", add_help=False
    )
    sub.add_parser(
        "gateway", help="the OpenAI-compatible HTTP API (plurai gateway --help)", add_help=False
    )
    sub.add_parser(
        "dashboard",
        help="the web dashboard on its own, without a gateway (plurai dashboard --help)",
        add_help=False,
    )
    sub.add_parser(
        "make-model", help="write a random-weight model (plurai make-model --help)", add_help=False
    )
    sub.add_parser(
        "quantize",
        help="write a quantized copy of a float model (plurai quantize --help)",
        add_help=False,
    )
    return p


# What `pip install plurai` (the client) leaves out: the extra each command needs, and for
# the client's own commands, the extra that installs a module they may reach
COMMAND_EXTRAS = {
    "worker": "worker", "make-model": "worker", "quantize": "worker",
    "gateway": "gateway", "dashboard": "gateway", "batch": "bulk",
}  # fmt: skip
MODULE_EXTRAS = {"celery": "bulk", "kombu": "bulk", "jsonschema": "bulk", "llguidance": "bulk"}
CLIENT_MODULES = {"redis", "hiredis", "msgpack", "pydantic", "pydantic_settings", "rich"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(argv)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        command = argv[0] if argv else ""
        extra = COMMAND_EXTRAS.get(command) or MODULE_EXTRAS.get(top)
        if not extra or top in CLIENT_MODULES:
            raise
        print(
            f"plurai: `plurai {command}` needs {top}, which `pip install plurai` (the client) "
            f"leaves out: pip install 'plurai[{extra}]'",
            file=sys.stderr,
        )
        return 2


def run(argv: list[str]) -> int:
    if argv and argv[0] == "worker":
        return cmd_worker(argv[1:])
    if argv and argv[0] == "gateway":
        return cmd_gateway(argv[1:])
    if argv and argv[0] == "dashboard":
        return cmd_gateway(argv[1:], dashboard=True)
    if argv and argv[0] == "make-model":
        return cmd_make_model(argv[1:])
    if argv and argv[0] == "quantize":
        return cmd_quantize(argv[1:])
    args = build_parser().parse_args(argv)
    import pydantic
    import redis

    from plurai.broker_config.connection import redact
    from plurai.broker_config.settings import explain
    from plurai.producer.bulk.manage import UnknownBatch

    try:
        return int(args.func(args))
    except UnknownBatch as e:
        print(f"plurai: {e.args[0]}", file=sys.stderr)
        return 1
    # unreachable, wrong password, ...; no node of a cluster reachable
    except (redis.RedisError, redis.RedisClusterException) as e:
        print(f"plurai: Redis error: {redact(str(e))}", file=sys.stderr)
        return 1
    except pydantic.ValidationError as e:  # a PLURAI_* setting or the PLURAI_CONFIG file
        print(f"plurai: {redact(explain(e))}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:  # PLURAI_CONFIG names no file
        print(f"plurai: {redact(str(e))}", file=sys.stderr)
        return 2
    except ValueError as e:  # no URL, unknown lane, bad JSON in an option
        print(f"plurai: {redact(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C in watch or submit --stream: the job runs on
        print("", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
