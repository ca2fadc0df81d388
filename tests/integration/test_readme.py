"""The README as a test: its usage blocks run as written, in order, in a fresh folder, and
then docs/guide.md's (the README's next steps) in the same folder.

Every ```sh, ```python and ```js block of README.md and docs/guide.md runs, unless the line before its fence is a
marker `<!-- readme-test: skip: <why> -->` (the set-up itself, vLLM's environment, GPUs).
A bare block whose lines start with `$ ` is a transcript: its commands run again and what
they print must match what it shows, numbers aside. Nothing else is changed: only the
PLACEHOLDERS (a job id, an API key, a batch id, the Redis URL, the gateway's port) are
replaced with real values, and the folder holds a link to this checkout's `.venv` and the
inputs a section presumes a user has (`reports/`, `requests.jsonl`).

Commands run without a shell. Those that run until stopped (a worker, the gateway, a line
ending in `&`) start in the background, and the processes of a `##` section are stopped
when it ends; `plurai status` (a live view) is interrupted with Ctrl-C once it has shown
the queue. Every command must exit 0, and those of CHECKS must print what the README says
they print; a python block must exit 0 and print what its check in PYTHON_CHECKS says the
block promises. A README command or output that no longer holds fails here.

One file, though long: the README's runner (blocks, placeholders, transcripts,
background processes) and its checks are one test.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from plurai.broker_config.connection import connect
from plurai.broker_config.embedded import free_port, running_url
from plurai.broker_config.stats import serving_workers

from .conftest import ROOT

README = ROOT / "README.md"
DOCS = (README, ROOT / "docs" / "guide.md")  # run in this order, in one folder
SKIP = re.compile(r"<!--\s*readme-test:\s*skip:\s*(.+?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
COMMAND_S = 120  # the most any one command may take (a batch to its end included)
READY_S = 120  # a worker or gateway to be ready
SHELL_ONLY = {"|", ">", ">>", "<", ";", "&&", "||"}


@dataclass
class Block:
    lang: str  # "sh", "python", "js", or "" (text, or a transcript of `$ ` lines)
    text: str
    file: str  # README.md or docs/guide.md
    line: int  # of the opening fence, 1-based
    section: str  # the `##` heading above it
    skip: str | None  # why the README marks it as not run


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    name = str(path.relative_to(ROOT))
    out, section, i = [], "", 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].strip()
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = SKIP.search(lines[i - 1]) if i else None
        text = "\n".join(lines[i + 1 : end])
        skip = marker and marker.group(1)
        out.append(Block(fence.group(1), text, name, i + 1, section, skip))
        i = end + 1
    return out


def commands(text: str) -> list[str]:
    """The command lines of a sh block: continuations joined, comment lines dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        out.append(current)
        current = ""
    return out


@dataclass
class Run:
    """One README command's result."""

    argv: list[str]
    code: int
    out: str
    err: str


@dataclass
class Session:
    """The folder, environment and values the README's commands share."""

    root: Path
    test_redis: str  # a redis-server of the test's, for the sections that name one
    env: dict[str, str]
    values: dict[str, str] = field(default_factory=dict)  # placeholder -> value
    batches: list[str] = field(default_factory=list)
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)

    def redis_url(self) -> str:
        """The Redis the commands so far use: the embedded one a worker without a URL
        started (under data/), else the exported PLURAI_REDIS_URL, else the test's."""
        return (
            running_url(self.root / "data") or self.env.get("PLURAI_REDIS_URL") or self.test_redis
        )

    def fill(self, text: str) -> str:
        """`text` with its placeholders replaced by the values known now."""
        for name, value in self.values.items():
            text = text.replace(name, value)
        for placeholder in REDIS_URLS:
            if placeholder in text:
                text = text.replace(placeholder, self.redis_url())
        return text

    def log(self, name: str) -> Path:
        n = len(list((self.root / "logs").iterdir()))
        return self.root / "logs" / f"{n}-{name}.log"

    def background(self, argv: list[str]) -> subprocess.Popen[bytes]:
        path = self.log(Path(argv[0]).name + "-" + (argv[1] if len(argv) > 1 else ""))
        with open(path, "wb") as log:
            proc = subprocess.Popen(
                argv, cwd=self.root, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        self.procs.append((shlex.join(argv), proc, path))
        return proc

    def stop_all(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for _, proc, _ in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []

    def tail(self, path: Path) -> str:
        return path.read_text(errors="replace")[-3000:]


# -- placeholders and what each command must print ---------------------------------------

# The README's placeholders, and what replaces each in every command and block after the
# command that printed its value (Session.values; the Redis URLs: Session.redis_url).
REDIS_URLS = ("redis://127.0.0.1:6379/0",)
PLACEHOLDERS = {
    "JOB_ID": "the job id `plurai submit` prints",
    "pk-...": "the key `plurai keys create` prints",
    "batch_c1637a5a1c5b83ff4ab1670e": "the batch id the last `plurai batch submit` printed",
    **dict.fromkeys(REDIS_URLS, "the Redis in use"),
    "127.0.0.1:8000": "the gateway's address, on a free port",
    "--port 8000": "the gateway's port, a free one",
    "--port 8001": "the dashboard's port, a free one",
}


def _plurai(argv: list[str], *words: str) -> bool:
    return Path(argv[0]).name == "plurai" and argv[1 : 1 + len(words)] == list(words)


def check_make_model(s: Session, run: Run) -> None:
    assert (s.root / run.argv[2] / "config.json").is_file(), run.out


def check_submit(s: Session, run: Run) -> None:
    ids = [x for x in run.err.splitlines() if re.fullmatch(r"[A-Za-z0-9_-]{8,128}", x)]
    assert ids, f"no job id on stderr: {run.err!r}"
    job_id = ids[0]
    if "--stream" in run.argv:
        assert run.out.strip(), "--stream printed no text"
    s.values["JOB_ID"] = job_id


def check_get(s: Session, run: Run) -> None:
    record = json.loads(run.out)
    assert record["id"] == s.values["JOB_ID"] and record["state"] == "completed", record


def check_keys_create(s: Session, run: Run) -> None:
    key = re.search(r"\bpk-[\w-]{20,}", run.out)
    assert key, f"no key printed: {run.out!r}"
    s.values["pk-..."] = key.group(0)


def check_batch_submit(s: Session, run: Run) -> None:
    batch_id = run.out.strip()
    assert re.fullmatch(r"batch_[0-9a-f]{24}", batch_id), f"no batch id: {run.out!r}"
    s.values["batch_c1637a5a1c5b83ff4ab1670e"] = batch_id
    s.batches.append(batch_id)


def check_batch_status(s: Session, run: Run) -> None:
    if "--json" in run.argv:
        info = json.loads(run.out)
        shown = json.dumps(info)[:2000]
        assert info["status"] == "completed" and info["request_counts"]["failed"] == 0, shown
    else:  # live until it ends: its last view says so
        last = run.out.strip().splitlines()[-1]
        assert re.search(r" completed .* 0 failed ", last), last


def check_batch_cancel(s: Session, run: Run) -> None:
    assert run.out.strip() == "completed", run.out  # ended already: nothing to stop


def check_batch_results(s: Session, run: Run) -> None:
    folder = Path(run.argv[run.argv.index("--dir") + 1])
    batch_id = s.values["batch_c1637a5a1c5b83ff4ab1670e"]
    out = s.root / folder / f"{batch_id}_output.jsonl"
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines and all(x["response"]["status_code"] == 200 for x in lines), lines
    assert (s.root / folder / f"{batch_id}_errors.jsonl").read_text() == ""


CHECKS: list[tuple[Callable[[list[str]], bool], Callable[[Session, Run], None]]] = [
    (lambda a: _plurai(a, "make-model"), check_make_model),
    (lambda a: _plurai(a, "submit"), check_submit),
    (lambda a: _plurai(a, "get"), check_get),
    (lambda a: _plurai(a, "keys", "create"), check_keys_create),
    (lambda a: _plurai(a, "batch", "submit"), check_batch_submit),
    (lambda a: _plurai(a, "batch", "status"), check_batch_status),
    (lambda a: _plurai(a, "batch", "cancel"), check_batch_cancel),
    (lambda a: _plurai(a, "batch", "results"), check_batch_results),
]


# What each python block prints, found by a line of its code: every block run has one.


def check_client(out: str) -> None:
    """The text streamed, then the result's text (the same), then both jobs completed."""
    text, _, states = out.removesuffix("\n").rpartition("\n")
    assert ast.literal_eval(states) == ["completed", "completed"], states
    half = len(text) // 2
    assert text and text[:half] == text[half:], f"streamed + result text: {text!r}"


def check_openai(out: str) -> None:
    assert out, "the streamed chat completion printed no text"


def check_structured(out: str) -> None:
    """`Person(...) label`: the person validated against the schema, a label of the two."""
    got = re.fullmatch(r"name=('.*'|\".*\") age=(\d+) (spam|ham)", out.strip())
    assert got, f"not a person and a label: {out!r}"
    assert len(ast.literal_eval(got.group(1))) <= 20 and 0 <= int(got.group(2)) <= 130, out


def check_offline(out: str) -> None:
    texts = ast.literal_eval(out.strip())
    assert isinstance(texts, list) and len(texts) == 2, out
    assert all(isinstance(t, str) and t for t in texts), f"an empty text: {texts!r}"


PYTHON_CHECKS: list[tuple[str, Callable[[str], None]]] = [
    ("client.wait_all(jobs", check_client),
    ("api.chat.completions.create(", check_openai),
    ("response_format=Person", check_structured),
    ("engine.generate(", check_offline),
]


def python_check(block: Block) -> Callable[[str], None]:
    found = [check for line, check in PYTHON_CHECKS if line in block.text]
    assert len(found) == 1, f"{block.file} line {block.line}: {len(found)} PYTHON_CHECKS match"
    return found[0]


# -- running blocks ------------------------------------------------------------------------


def run_sh(s: Session, block: Block) -> None:
    for line in commands(block.text):
        line = s.fill(line)
        argv = shlex.split(line, comments=True)
        where = f"{block.file} line {block.line}: {line.strip()}"
        assert not SHELL_ONLY & set(argv), f"{where}: needs a shell; the README test runs none"
        if argv[0] == "export":
            name, _, value = argv[1].partition("=")
            s.env[name] = s.fill(value)
            continue
        in_background = argv[-1] == "&"
        argv = argv[:-1] if in_background else argv
        if any(_plurai(argv, w) for w in ("worker", "gateway", "dashboard")) or in_background:
            start(s, argv, where)
        elif _plurai(argv, "status") and len(argv) == 2:
            live_view(s, argv, where)
        else:
            run_one(s, argv, where)
        for command, proc, log in s.procs:  # what runs until stopped must still run
            assert proc.poll() is None, f"{command}: exited with {proc.returncode}\n{s.tail(log)}"


def run_one(s: Session, argv: list[str], where: str) -> Run:
    try:
        p = subprocess.run(
            argv, cwd=s.root, env=s.env, capture_output=True, text=True, timeout=COMMAND_S
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{where}: still running after {COMMAND_S}s: {e.output!r}") from e
    run = Run(argv, p.returncode, p.stdout, p.stderr)
    assert run.code == 0, f"{where}: exit {run.code}\n{run.out[-2000:]}\n{run.err[-3000:]}"
    for matches, check in CHECKS:
        if matches(argv):
            try:
                check(s, run)
            except (AssertionError, ValueError, KeyError, IndexError) as e:
                raise AssertionError(f"{where}: {type(e).__name__}: {e}") from e
    return run


def start(s: Session, argv: list[str], where: str) -> None:
    """A command that runs until stopped; a worker or gateway is waited for until ready."""
    proc = s.background(argv)
    _, _, log = s.procs[-1]
    deadline = time.monotonic() + READY_S
    if _plurai(argv, "worker"):
        url = (lambda: argv[argv.index("--url") + 1]) if "--url" in argv else s.redis_url
        before = _serving(url())
        while _serving(url()) <= before:
            _alive(proc, log, where, deadline, s)
    elif _plurai(argv, "gateway") or _plurai(argv, "dashboard"):
        port = int(argv[argv.index("--port") + 1])
        path = "/health" if _plurai(argv, "gateway") else "/dashboard/data"
        while not _answers(f"http://127.0.0.1:{port}{path}"):
            _alive(proc, log, where, deadline, s)


def _serving(url: str | None) -> int:
    if url is None:
        return 0
    try:
        r = connect(url)
        try:
            return serving_workers(r)
        finally:
            r.close()
    except Exception:  # not up yet
        return 0


def _answers(url: str) -> bool:
    try:
        httpx.get(url, timeout=1.0)
        return True
    except httpx.HTTPError:
        return False


def _alive(
    proc: subprocess.Popen[bytes], log: Path, where: str, deadline: float, s: Session
) -> None:
    assert proc.poll() is None, f"{where}: exited with {proc.returncode}\n{s.tail(log)}"
    assert time.monotonic() < deadline, f"{where}: not ready after {READY_S}s\n{s.tail(log)}"
    time.sleep(0.2)


def live_view(s: Session, argv: list[str], where: str) -> None:
    """`plurai status`: refreshes until Ctrl-C; it must show the live worker, then end 0."""
    proc = subprocess.Popen(
        argv,
        cwd=s.root,
        env={**s.env, "PYTHONFAULTHANDLER": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a suite run as a background job of a script inherits SIGINT ignored (POSIX):
        # the view must get Ctrl-C as a terminal would give it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(2.5)  # a few refreshes
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # say where it is: faulthandler dumps every thread
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"{where}: no exit 60 s after Ctrl-C\n{err[-6000:]}") from None
    assert proc.returncode == 0, f"{where}: exit {proc.returncode}\n{err[-3000:]}"
    assert re.search(r"\b1 worker\(s\)", out), f"{where}: the view shows no worker:\n{out}"


def run_python(s: Session, block: Block) -> None:
    code = s.fill(block.text)
    where = f"{block.file} line {block.line} (python)"
    check = python_check(block)
    try:
        p = subprocess.run(
            [str(s.root / ".venv" / "bin" / "python"), "-c", code],
            cwd=s.root,
            env=s.env,
            capture_output=True,
            timeout=COMMAND_S,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{where}: still running after {COMMAND_S}s") from e
    # bytes: a text mode would turn a generated "\r" into a newline
    out, err = (x.decode(errors="replace") for x in (p.stdout, p.stderr))
    assert p.returncode == 0, f"{where}: exit {p.returncode}\n{err[-3000:]}"
    try:
        check(out)
    except (AssertionError, ValueError, SyntaxError) as e:
        raise AssertionError(f"{where}: {type(e).__name__}: {e}\n{out[-2000:]}") from e


def run_js(s: Session, block: Block) -> None:
    """A Node block (an ES module: top-level await); it must exit 0 and print something."""
    where = f"{block.file} line {block.line} (js)"
    try:
        p = subprocess.run(
            ["node", "--input-type=module", "-e", s.fill(block.text)],
            cwd=s.root,
            env=s.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_S,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{where}: still running after {COMMAND_S}s") from e
    except FileNotFoundError as e:
        raise AssertionError(f"{where}: no `node` on PATH (`make install` installs it)") from e
    assert p.returncode == 0, f"{where}: exit {p.returncode}\n{p.stderr[-3000:]}"
    assert p.stdout.strip(), f"{where}: printed nothing"


def run_transcript(s: Session, block: Block) -> None:
    """`$ command` lines, each followed by what it prints: run each (`plurai` is the
    venv's), and its output must match the last lines shown, numbers and the width of
    progress bars aside (a view that refreshes shows only its last state off a terminal)."""
    shown: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            shown.append((line[2:], []))
        elif line.strip():
            shown[-1][1].append(line)
    for command, expected in shown:
        where = f"{block.file} line {block.line}: $ {command}"
        run = run_one(s, shlex.split(s.fill(command)), where)
        got = [x for x in run.out.splitlines() if x.strip()]
        assert got and len(got) <= len(expected), f"{where}: printed {run.out!r}"
        for want, line in zip(expected[-len(got) :], got, strict=True):
            matches = re.fullmatch(_pattern(s.fill(want)), line.strip())
            assert matches, f"{where}: printed {line.strip()!r}; the README shows {want!r}"


def _pattern(shown: str) -> str:
    """A shown output line as a regex: any number where it has one, any bar where it has a
    bar, any run of spaces where it has spaces."""
    parts = re.split(r"(\d+(?:[.:,]\d+)*|[━╸╺]+|\s+)", shown.strip())
    out = []
    for part in parts:
        if not part:
            continue
        if re.fullmatch(r"\d+(?:[.:,]\d+)*", part):
            out.append(r"[\d.:,]+")
        elif re.fullmatch(r"[━╸╺]+", part):
            out.append(r"[━╸╺]+")
        elif part.isspace():
            out.append(r"\s+")
        else:
            out.append(re.escape(part))
    return "".join(out)


# -- the test ------------------------------------------------------------------------------


def lay_out(root: Path) -> None:
    """What the README presumes a user has: this checkout's venv, documents in reports/
    (one longer than the bulk section's context of 256, so it is split and reduced) and an
    OpenAI Batch file."""
    (root / ".venv").symlink_to(sys.prefix)  # the venv running this test
    (root / "logs").mkdir()
    reports = root / "reports"
    reports.mkdir()
    words = "the river rose overnight and the town woke to water in the streets".split()
    (reports / "flood.txt").write_text(" ".join(words[i % len(words)] for i in range(400)))
    (reports / "short.txt").write_text("Quarterly sales were flat; costs fell by a tenth.")
    (reports / "note.txt").write_text("The meeting moved to Thursday.")
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny-llama",
                "messages": [{"role": "user", "content": q}],
                "max_tokens": 16,
            },
        }
        for i, q in enumerate(["Hello", "Name a river"])
    ]
    (root / "requests.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture
def session(tmp_path: Path, redis_url: str) -> Iterator[Session]:
    root = tmp_path / "readme"
    root.mkdir()
    lay_out(root)
    keep = {k: v for k, v in os.environ.items() if not k.startswith("PLURAI_")}
    env = {
        **keep,
        "PATH": f"{root / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "PLURAI_HEARTBEAT_INTERVAL_S": "1",  # ready sooner; nothing else is tuned
        "COLUMNS": "160",  # as wide as the terminal the transcripts were taken on
    }
    s = Session(root, redis_url, env)
    s.values["127.0.0.1:8000"] = f"127.0.0.1:{free_port()}"
    s.values["--port 8000"] = "--port " + s.values["127.0.0.1:8000"].rpartition(":")[2]
    s.values["--port 8001"] = f"--port {free_port()}"
    yield s
    s.stop_all()


def test_every_placeholder_and_marker_is_known() -> None:
    """The README's blocks are what this test expects: each is run, or skipped with a
    reason; each sh line parses; every fenced block is closed."""
    found = [b for doc in DOCS for b in blocks(doc)]
    assert sum(b.lang == "sh" and b.skip is None for b in found) >= 3
    assert sum(b.lang == "python" and b.skip is None for b in found) >= 4
    assert any(b.lang == "" and b.text.startswith("$ ") for b in found)
    for b in found:
        if b.skip is not None:
            assert len(b.skip) > 10, f"{b.file} line {b.line}: say why it is skipped"
        if b.lang == "python" and b.skip is None:
            python_check(b)
        if b.lang == "sh" and b.skip is None:
            for line in commands(b.text):
                assert shlex.split(line, comments=True), line
    assert any(b.lang == "js" and b.skip is None for b in found)
    text = "".join(doc.read_text() for doc in DOCS)
    for placeholder in PLACEHOLDERS:
        assert placeholder in text, f"{placeholder!r} is no longer in the docs: drop it here"


def test_the_readme_runs_as_written(session: Session) -> None:
    section = None
    for block in [b for doc in DOCS for b in blocks(doc)]:
        if (block.file, block.section) != section:
            session.stop_all()  # a section's workers, gateway and Celery end with it
            section = (block.file, block.section)
        if block.skip is not None:
            continue
        if block.lang == "sh":
            run_sh(session, block)
        elif block.lang == "python":
            run_python(session, block)
        elif block.lang == "js":
            run_js(session, block)
        elif block.lang == "" and block.text.startswith("$ "):
            run_transcript(session, block)
        elif block.lang:
            raise AssertionError(f"{block.file} line {block.line}: no runner for ```{block.lang}")
    # every batch the README submitted, the documents' included, completed without errors
    assert len(session.batches) >= 2
    for batch_id in session.batches:
        where = f"batch {batch_id}"
        run = run_one(session, ["plurai", "batch", "status", batch_id, "--json"], where)
        info = json.loads(run.out)
        assert info["request_counts"]["completed"] >= 2, info
