"""The HTTP gateway against the SDK straight to Redis, on the same workers in one run:
short streaming jobs from concurrent clients, once through the gateway with the official
`openai` client and once through producer.aio's AsyncClient. Jobs/s and TTFT p50/p99 of
each (TTFT: from the request's start to its first text), and the gateway's CPU time per
request, from which its own request rate follows (what one gateway process could serve if
the workers were never the limit).

    python bench/gateway.py [--jobs 1000] [--clients 64] [--max-tokens 8] [--workers 1] [--smoke]

The last line is one JSON object of measured figures and ratios. --smoke: a few jobs of 4
tokens from two clients, one round, on the smoke runs' tiny model: a check that the bench
runs, not a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.workload import add_smoke_arg, cpu_isa, json_line, smoke_model  # noqa: E402
from plurai.broker_config.embedded import EmbeddedRedis, free_port  # noqa: E402
from plurai.broker_config.stats import serving_workers  # noqa: E402
from plurai.producer.aio import AsyncClient  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompts(n: int) -> list[str]:
    return [f"request {i}: say something short" for i in range(n)]


async def through_gateway(
    base: str, model: str, a: argparse.Namespace
) -> tuple[float, list[float]]:
    import openai

    api = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    todo = iter(prompts(a.jobs))
    ttfts: list[float] = []

    async def client() -> None:
        for p in todo:
            t = time.perf_counter()
            first = None
            stream = await api.completions.create(
                model=model, prompt=p, max_tokens=a.max_tokens, temperature=0, stream=True
            )
            async for c in stream:
                if first is None and c.choices and c.choices[0].text:
                    first = time.perf_counter() - t
            ttfts.append(first if first is not None else time.perf_counter() - t)

    t = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(a.clients)))
    dt = time.perf_counter() - t
    await api.close()
    return dt, ttfts


async def raw_http(base: str, model: str, a: argparse.Namespace) -> tuple[float, list[float]]:
    """The gateway with a bare HTTP client (httpx): what the gateway adds, apart from the
    `openai` library's own time."""
    import httpx

    todo = iter(prompts(a.jobs))
    ttfts: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:

        async def client() -> None:
            for p in todo:
                body = {"model": model, "prompt": p, "max_tokens": a.max_tokens}
                t = time.perf_counter()
                first = None
                body |= {"temperature": 0, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter() - t
                ttfts.append(first if first is not None else time.perf_counter() - t)

        t = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(a.clients)))
        return time.perf_counter() - t, ttfts


async def direct(url: str, a: argparse.Namespace) -> tuple[float, list[float]]:
    todo = iter(prompts(a.jobs))
    ttfts: list[float] = []
    async with AsyncClient(url) as sdk:

        async def client() -> None:
            for p in todo:
                t = time.perf_counter()
                first = None
                job = await sdk.submit(p, max_tokens=a.max_tokens, temperature=0)
                async for text in job.stream():
                    if first is None and text:
                        first = time.perf_counter() - t
                ttfts.append(first if first is not None else time.perf_counter() - t)

        t = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(a.clients)))
        return time.perf_counter() - t, ttfts


async def _instant(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An HTTP/1.1 server that answers every POST at once with a two-chunk SSE completion
    stream, as the gateway's shape: what a client library costs with no server work."""
    chunk = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m"}
    first = dict(
        chunk, choices=[{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]
    )
    last = dict(
        chunk, choices=[{"index": 0, "text": "b", "logprobs": None, "finish_reason": "length"}]
    )
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )

    def part(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    one = part(b"data: " + json.dumps(first).encode() + b"\n\n")
    end = part(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n") + b"0\r\n\r\n"
    try:
        while True:
            data = await reader.readuntil(b"\r\n\r\n")
            size = next(
                int(line.split(b":")[1])
                for line in data.lower().split(b"\r\n")
                if line.startswith(b"content-length:")
            )
            await reader.readexactly(size)
            writer.write(head + one)
            await writer.drain()
            writer.write(end)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


def _serve_instant(port: int) -> None:
    async def serve() -> None:
        server = await asyncio.start_server(_instant, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


def client_floor(model: str, a: argparse.Namespace) -> dict[str, float]:
    """TTFT p50 (ms) of the openai client and a bare httpx client, one request at a time,
    against a server that answers at once: the part of the gateway path's TTFT that is the
    client library's own, which no gateway can take away."""
    import multiprocessing

    port = free_port()
    server = multiprocessing.get_context("fork").Process(target=_serve_instant, args=(port,))
    server.start()
    try:
        import httpx

        base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.post(base + "/v1/completions", json={}, timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise RuntimeError("the instant server did not start")
        one = argparse.Namespace(**{**vars(a), "jobs": a.unloaded, "clients": 1})
        out = {"openai": [], "http": []}
        for _ in range(a.rounds):
            out["openai"] += asyncio.run(through_gateway(base, model, one))[1]
            out["http"] += asyncio.run(raw_http(base, model, one))[1]
        return {k: 1000 * statistics.median(v) for k, v in out.items()}
    finally:
        server.terminate()
        server.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="each path this many times, alternating")
    ap.add_argument("--unloaded", type=int, default=200, help="jobs from one client, each path")
    add_smoke_arg(ap)
    a = ap.parse_args()
    warm = 64  # jobs each path, unmeasured
    if a.smoke:
        a.model = str(smoke_model())
        a.jobs, a.clients, a.max_tokens, a.rounds, a.unloaded, warm = 8, 2, 4, 1, 3, 4
    if not (Path(a.model) / "config.json").exists():
        from plurai.gpu_workers.models.factory import make_model

        make_model(a.model, family="llama")
    model = Path(a.model).name
    env = {**os.environ, "PLURAI_HEARTBEAT_INTERVAL_S": "1", "PLURAI_LOG_LEVEL": "WARNING"}
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis(Path(d) / "redis") as url:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "plurai.cli", "worker", "--model", a.model, "--url", url]
                + ["--metrics-port", "-1", "--engine", "threads=1"],
                cwd=ROOT,
                env=env,
            )
            for _ in range(a.workers)
        ]
        port = free_port()
        gw = subprocess.Popen(
            [sys.executable, "-m", "plurai.cli", "gateway", "--url", url, "--port", str(port)],
            cwd=ROOT,
            env=env,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            import httpx
            import redis

            r = redis.Redis.from_url(url)
            while serving_workers(r) < a.workers:
                if any(p.poll() is not None for p in procs):
                    raise SystemExit("a worker exited during its start")
                time.sleep(0.2)
            while True:
                try:
                    httpx.get(base + "/health", timeout=1)
                    break
                except httpx.HTTPError:
                    if gw.poll() is not None:
                        raise SystemExit("the gateway exited during its start") from None
                    time.sleep(0.1)
            asyncio.run(direct(url, argparse.Namespace(**{**vars(a), "jobs": warm})))  # warm up
            asyncio.run(
                through_gateway(base, model, argparse.Namespace(**{**vars(a), "jobs": warm}))
            )
            # one client at a time: the latency the gateway adds, with nothing queued
            one = argparse.Namespace(**{**vars(a), "jobs": a.unloaded, "clients": 1})
            idle = {"gateway": [], "direct": [], "http": []}
            for _ in range(a.rounds):
                idle["gateway"] += asyncio.run(through_gateway(base, model, one))[1]
                idle["http"] += asyncio.run(raw_http(base, model, one))[1]
                idle["direct"] += asyncio.run(direct(url, one))[1]
            runs: dict[str, list] = {"gateway": [], "direct": []}
            gw_cpu = 0.0
            client_cpu = {"gateway": 0.0, "direct": 0.0}
            for _ in range(a.rounds):
                c0, p0 = cpu_s(gw.pid), time.process_time()
                runs["gateway"].append(asyncio.run(through_gateway(base, model, a)))
                gw_cpu += cpu_s(gw.pid) - c0
                client_cpu["gateway"] += time.process_time() - p0
                p0 = time.process_time()
                runs["direct"].append(asyncio.run(direct(url, a)))
                client_cpu["direct"] += time.process_time() - p0
        finally:
            gw.terminate()
            for p in procs:
                p.terminate()
            for p in [gw, *procs]:
                p.wait(timeout=60)
    res: dict[str, dict] = {}
    for name, rs in runs.items():
        rates = [a.jobs / dt for dt, _ in rs]
        ttfts = [x for _, t in rs for x in t]
        res[name] = {
            "jobs_per_s": statistics.median(rates),
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p99_ms": 1000 * pct(ttfts, 0.99),
        }
        print(
            f"{name:8s} {res[name]['jobs_per_s']:.1f} jobs/s (runs {[round(x, 1) for x in rates]}), "
            f"TTFT p50 {res[name]['ttft_p50_ms']:.2f} ms p99 {res[name]['ttft_p99_ms']:.2f} ms"
        )
    idle_ms = {k: 1000 * statistics.median(v) for k, v in idle.items()}
    floor = client_floor(model, a)
    print(
        f"client libraries alone (a server that answers at once): TTFT p50 openai "
        f"{floor['openai']:.2f} ms, bare httpx {floor['http']:.2f} ms"
    )
    print(
        f"one client: TTFT p50 gateway {idle_ms['gateway']:.2f} ms (bare HTTP client "
        f"{idle_ms['http']:.2f} ms), direct {idle_ms['direct']:.2f} ms "
        f"(added {idle_ms['gateway'] - idle_ms['direct']:.2f} ms)"
    )
    cpu_ms = 1000 * gw_cpu / (a.jobs * a.rounds)
    client_ms = {k: 1000 * v / (a.jobs * a.rounds) for k, v in client_cpu.items()}
    print(f"gateway CPU {cpu_ms:.3f} ms per request: {1000 / cpu_ms:.0f} requests/s per process")
    print(
        f"client CPU per job: openai {client_ms['gateway']:.3f} ms, SDK {client_ms['direct']:.3f} ms"
    )
    out = {
        "jobs": a.jobs,
        "clients": a.clients,
        "max_tokens": a.max_tokens,
        "workers": a.workers,
        "cpus": os.cpu_count(),
        "isa": cpu_isa(),
        "gateway_jobs_per_s": round(res["gateway"]["jobs_per_s"], 1),
        "direct_jobs_per_s": round(res["direct"]["jobs_per_s"], 1),
        "gateway_vs_direct": round(res["gateway"]["jobs_per_s"] / res["direct"]["jobs_per_s"], 3),
        "gateway_ttft_p50_ms": round(res["gateway"]["ttft_p50_ms"], 2),
        "gateway_ttft_p99_ms": round(res["gateway"]["ttft_p99_ms"], 2),
        "direct_ttft_p50_ms": round(res["direct"]["ttft_p50_ms"], 2),
        "direct_ttft_p99_ms": round(res["direct"]["ttft_p99_ms"], 2),
        "added_ttft_p50_ms_loaded": round(
            res["gateway"]["ttft_p50_ms"] - res["direct"]["ttft_p50_ms"], 2
        ),
        "unloaded_gateway_ttft_p50_ms": round(idle_ms["gateway"], 2),
        "unloaded_direct_ttft_p50_ms": round(idle_ms["direct"], 2),
        "added_ttft_p50_ms": round(idle_ms["gateway"] - idle_ms["direct"], 2),
        "unloaded_bare_http_ttft_p50_ms": round(idle_ms["http"], 2),
        "added_ttft_p50_ms_bare_http": round(idle_ms["http"] - idle_ms["direct"], 2),
        "instant_server_ttft_p50_ms_openai": round(floor["openai"], 2),
        "instant_server_ttft_p50_ms_bare_http": round(floor["http"], 2),
        "gateway_cpu_ms_per_request": round(cpu_ms, 3),
        "gateway_requests_per_s_per_process": round(1000 / cpu_ms),
        "openai_client_cpu_ms_per_job": round(client_ms["gateway"], 3),
        "sdk_client_cpu_ms_per_job": round(client_ms["direct"], 3),
    }
    json_line(out, a.smoke)


if __name__ == "__main__":
    main()
