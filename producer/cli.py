"""The `plurai` command.

plurai worker --model models/tiny-llama      serve the queue (embedded Redis if no URL)
plurai submit "Summarize: ..." --stream      queue a job; print its id, or stream it
plurai get JOB_ID [--wait 30]                print a job record as JSON
plurai watch JOB_ID                          stream a job's text as it is generated
plurai make-model models/tiny-llama          write a random-weight test model
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _client(args: argparse.Namespace) -> Any:
    from producer.client import Client

    return Client(args.url)


def cmd_submit(args: argparse.Namespace) -> int:
    from producer.errors import JobCancelled, JobFailed

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    options: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "priority": args.priority,
        "lane": args.lane,
        "idempotency_key": args.idempotency_key,
        "model": args.model,
    }
    if args.messages:
        options["messages"] = json.loads(prompt)
        prompt = None
    if args.metadata:
        options["metadata"] = json.loads(args.metadata)
    if args.param:
        for kv in args.param:
            name, _, value = kv.partition("=")
            options[name] = json.loads(value)
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
        except (JobFailed, JobCancelled, TimeoutError) as e:
            print(f"plurai: {e}", file=sys.stderr)
            return 1
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    from results import records, wait

    with _client(args) as client:
        if args.wait is not None:
            rec = wait.wait(client.redis, args.job_id, args.wait)
        else:
            rec = records.get(client.redis, args.job_id)
    print(json.dumps(rec.to_dict(), indent=2, ensure_ascii=False))
    return 0 if rec.state != "unknown" else 1


def cmd_watch(args: argparse.Namespace) -> int:
    from producer.errors import JobCancelled, JobFailed

    with _client(args) as client:
        try:
            for text in client.job(args.job_id).stream():
                sys.stdout.write(text)
                sys.stdout.flush()
        except (JobFailed, JobCancelled) as e:
            print(f"\nplurai: {e}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    return 0


def cmd_worker(rest: list[str]) -> int:
    from gpu_workers import worker

    return worker.main(rest)


def cmd_make_model(rest: list[str]) -> int:
    from gpu_workers.models import factory

    p = argparse.ArgumentParser(prog="plurai make-model", description="write a random-weight model")
    factory.add_arguments(p)
    return factory.cli(p.parse_args(rest))


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
    s.add_argument(
        "--param", action="append", metavar="NAME=JSON", help="any sampling field, e.g. top_k=20"
    )
    s.add_argument("--stream", action="store_true", help="print the text as it is generated")
    s.add_argument("--wait", type=float, metavar="SECONDS", help="wait for and print the result")
    s.set_defaults(func=cmd_submit)

    g = sub.add_parser("get", help="print a job record as JSON")
    g.add_argument("job_id")
    g.add_argument("--wait", type=float, metavar="SECONDS", help="wait until the job ends")
    g.set_defaults(func=cmd_get)

    w = sub.add_parser("watch", help="stream a job's text")
    w.add_argument("job_id")
    w.set_defaults(func=cmd_watch)

    for name in ("submit", "get", "watch"):
        sub.choices[name].add_argument(
            "--url", help="Redis URL (default: PLURAI_REDIS_URL or the embedded one)"
        )
    # These two parse their own arguments, so their heavy imports happen only when used.
    sub.add_parser(
        "worker", help="serve the queue with an engine (plurai worker --help)", add_help=False
    )
    sub.add_parser(
        "make-model", help="write a random-weight model (plurai make-model --help)", add_help=False
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return cmd_worker(argv[1:])
    if argv and argv[0] == "make-model":
        return cmd_make_model(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as e:  # no URL, unknown lane, bad JSON in an option
        print(f"plurai: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
