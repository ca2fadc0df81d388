"""A zygote for the tests' worker processes: one process that has imported torch and
transformers forks each `python -m <module> <args>` the tests start, so that a worker is
ready in about a second rather than after ~4 s of imports (the imports were most of the
integration suite's CPU). A child runs as a fresh interpreter would: its own working
directory, environment, log file and signal handlers, the project's modules imported
anew (only third-party modules, which read no per-test setting, are shared), and its exit
status reported as Popen reports one. What the C runtimes read once at load (OpenMP's
OMP_NUM_THREADS) is the zygote's: workers set their threads through `--engine threads=N`.

Protocol, one Unix-socket connection a child: the test sends one JSON line (`argv`: the
module and its arguments, `cwd`, `env`, `log`), the zygote answers `{"pid": ...}` and,
when the child ends, `{"code": ...}` (negative: the signal that ended it)."""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path

PRELOAD = ["torch", "transformers", "safetensors", "tokenizers", "numpy", "redis", "msgpack",
           "pydantic", "prometheus_client", "starlette"]  # fmt: skip


def preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import transformers

    # the lazy attributes an engine resolves at its import (most of its import's cost)
    transformers.AutoTokenizer, transformers.AutoConfig, transformers.PreTrainedTokenizerFast  # noqa: B018


def child(request: dict, closing: list[socket.socket]) -> None:
    """Become the process the request asks for; never returns."""
    code = 1
    try:
        for s in closing:
            s.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        module, *args = request["argv"]
        sys.argv = [module, *args]
        sys.path[0] = request["cwd"]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        # what an interpreter does at exit: wait for its threads, run atexit, flush
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code if 0 <= code < 256 else 1)


def serve(path: str) -> None:
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    conns: dict[socket.socket, bytes] = {}  # a connection and what it has sent so far
    children: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, *conns], [], [], 0.02)
        for s in readable:
            if s is listener:
                conns[listener.accept()[0]] = b""
                continue
            data = s.recv(65536)
            if not data:  # the test went away first: its child runs on, unreported
                conns.pop(s)
                s.close()
                continue
            conns[s] += data
            if b"\n" in conns[s]:
                request = json.loads(conns.pop(s).split(b"\n", 1)[0])
                pid = os.fork()
                if pid == 0:
                    child(request, [listener, s, *conns, *children.values()])
                children[pid] = s
                s.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            s = children.pop(pid, None)
            if s is not None:
                try:
                    code = os.waitstatus_to_exitcode(status)
                    s.sendall(json.dumps({"code": code}).encode() + b"\n")
                except OSError:
                    pass
                s.close()


class Child:
    """A zygote's child, as much of `subprocess.Popen` as the tests use."""

    def __init__(self, sock: socket.socket, args: list[str]) -> None:
        self.sock, self.args = sock, args
        self.returncode: int | None = None
        self.buf = b""
        self.pid: int = self.read(None)["pid"]

    def read(self, timeout: float | None) -> dict:
        while b"\n" not in self.buf:
            if not select.select([self.sock], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            data = self.sock.recv(4096)
            if not data:
                raise RuntimeError("the test zygote went away")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = int(self.read(timeout)["code"])
            self.sock.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The zygote process, started once for a test session."""

    def __init__(self, folder: Path) -> None:
        self.path = str(folder / "zygote.sock")
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.zygote", self.path],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=open(folder / "zygote.log", "wb"),  # noqa: SIM115
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the test zygote did not start; see {folder / 'zygote.log'}")

    def start(self, argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> Child:
        """`argv`: `[python, "-m", module, *args]`, as Popen would take it."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.path)
        request = {"argv": argv[2:], "cwd": str(cwd), "env": env, "log": str(log)}
        sock.sendall(json.dumps(request).encode() + b"\n")
        return Child(sock, argv)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


if __name__ == "__main__":
    serve(sys.argv[1])
