"""A private, throwaway RabbitMQ node for development, demos and tests.

:class:`LocalBroker` runs the ``rabbitmq-server`` installed on this machine as a separate
node of its own: its own node name, free ports picked at random, and all its state (data,
logs, Erlang cookie, configuration) in one directory. It never touches a system broker that
may already run here (``rabbit@localhost`` on port 5672), so several LocalBrokers -- for
example from parallel CI jobs or test sessions -- can run side by side.

Typical use::

    from amqp_locks.broker import LocalBroker

    with LocalBroker() as broker:          # starts a node (a few seconds)
        url = broker.url                   # amqp://guest:guest@127.0.0.1:<port>/%2F
        ...                                # connect with pika / aio-pika / amqp_locks
        broker.restart()                   # drop every client connection, keep durable data
    # the node is stopped and its temporary state directory removed

or, without a ``with`` block::

    broker = LocalBroker(management=True)
    broker.start()
    try:
        api = broker.management_url        # http://127.0.0.1:<port>/ (guest/guest)
    finally:
        broker.stop()

A node can outlive the process that started it: :meth:`LocalBroker.detach` writes a small
JSON record (node name, ports, pid, state directory) into the state directory and leaves the
node running at exit; :meth:`LocalBroker.attach` rebuilds a LocalBroker from that record in a
later process, so that it can be inspected and stopped (``amqp-locks broker start|stop`` work
this way)::

    broker = LocalBroker("/tmp/dev-broker", management=True)
    broker.start()
    broker.detach()                        # the node keeps running after this process exits
    ...                                    # later, in another process:
    broker = LocalBroker.attach("/tmp/dev-broker")
    broker.is_running(), broker.url
    broker.stop()                          # `rabbitmqctl stop`, then kills what is left

Requirements: a RabbitMQ server installation (``apt-get install -y rabbitmq-server`` as root
on Debian/Ubuntu, ``brew install rabbitmq`` on macOS). :meth:`LocalBroker.available` tells
whether one was found. On Debian the ``/usr/sbin`` commands are wrappers that switch to the
``rabbitmq`` user and drop the environment, so the real scripts in ``/usr/lib/rabbitmq/bin``
are used instead. The node runs as the current user; it does not need root.

The guest user keeps its default password and may only connect from localhost; every listener
(AMQP, Erlang distribution, management) is bound to 127.0.0.1.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import string
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["RECORD_FILE", "LocalBroker", "LocalBrokerError", "find_rabbitmq_server"]

logger = logging.getLogger("amqp_locks.broker")

#: Directories searched for ``rabbitmq-server`` after ``$PATH``.
_FALLBACK_DIRS: tuple[str, ...] = (
    "/usr/lib/rabbitmq/bin",
    "/usr/sbin",
    "/usr/local/sbin",
    "/opt/homebrew/sbin",
    "/usr/local/opt/rabbitmq/sbin",
)

#: Standard directories appended to the node's PATH: the server scripts need ``erl``,
#: ``sed``, ``dirname`` etc. even if the caller runs with an unusual PATH.
_SYSTEM_PATH = ("/usr/local/bin", "/usr/bin", "/bin", "/usr/local/sbin", "/usr/sbin", "/sbin")

#: Environment variable put into the node's environment (and so inherited by every process
#: it spawns), used to find and kill stragglers.
_MARKER_ENV = "AMQP_LOCKS_LOCAL_BROKER"

#: Inherited variables kept although they start with ``ERL_``: where epmd runs.
_KEEP_ENV = frozenset({"ERL_EPMD_PORT", "ERL_EPMD_ADDRESS"})

_INSTALL_HINT = (
    "rabbitmq-server was not found (looked on PATH and in {dirs}). To get a broker for "
    "development and tests, either: install it -- as root on Debian/Ubuntu: "
    "`apt-get install -y rabbitmq-server` (on macOS: `brew install rabbitmq`); or run where a "
    "Docker engine is reachable (the amqp_locks pytest plugin then starts a container with "
    "testcontainers); or set AMQP_URL to an existing broker, e.g. "
    "AMQP_URL='amqp://guest:guest@127.0.0.1:5672/%2F'."
)

#: Name of the record :meth:`LocalBroker.detach` writes into the state directory.
RECORD_FILE = "local-broker.json"
_RECORD_VERSION = 1

_TAIL_LINES = 40
_TAIL_CHARS = 6000


class LocalBrokerError(RuntimeError):
    """A :class:`LocalBroker` could not be found, started, restarted or controlled."""


def find_rabbitmq_server() -> Path | None:
    """Return the path of a usable ``rabbitmq-server`` script, or None if none is installed.

    Looks on ``$PATH`` first, then in :data:`_FALLBACK_DIRS`. Distribution wrappers that
    re-execute the command as another user (Debian's ``rabbitmq-script-wrapper`` behind
    ``/usr/sbin/rabbitmq-server``, which also drops the environment) are replaced by the real
    script next to them. ``rabbitmqctl`` must exist in the same directory.
    """
    candidates: list[Path] = []
    on_path = shutil.which("rabbitmq-server")
    if on_path:
        candidates.append(Path(on_path))
    candidates.extend(Path(d) / "rabbitmq-server" for d in _FALLBACK_DIRS)
    for candidate in candidates:
        script = _real_server_script(candidate)
        if script is not None:
            return script
    return None


def _real_server_script(candidate: Path) -> Path | None:
    if not candidate.is_file():
        return None
    resolved = candidate.resolve()
    if resolved.name != "rabbitmq-server":
        # A wrapper (Debian: /usr/sbin/rabbitmq-server -> .../bin/rabbitmq-script-wrapper,
        # which `su`s to the rabbitmq user). The real script lives beside the wrapper.
        sibling = resolved.parent / "rabbitmq-server"
        if not sibling.is_file() or sibling.resolve().name != "rabbitmq-server":
            return None
        candidate = sibling
    if not os.access(candidate, os.X_OK):
        return None
    if not (candidate.parent / "rabbitmqctl").is_file():
        return None
    return candidate


def _free_ports(count: int) -> list[int]:
    """Pick ``count`` distinct free TCP ports on 127.0.0.1 (bind to port 0, then release)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _tail(path: Path, lines: int = _TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    tail = "\n".join(text.splitlines()[-lines:])
    if len(tail) > _TAIL_CHARS:
        tail = "..." + tail[-_TAIL_CHARS:]
    return tail


def _pids_with_marker(marker: str) -> list[int]:
    """PIDs of live processes whose environment holds ``_MARKER_ENV=marker`` (Linux only)."""
    needle = f"{_MARKER_ENV}={marker}".encode()
    own = os.getpid()
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == own:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:
            continue
        if needle not in environ.split(b"\0"):
            continue
        try:
            with open(f"/proc/{entry}/comm", "rb") as fh:
                comm = fh.read().strip()
        except OSError:
            continue
        if comm != b"epmd":  # a node may start the shared epmd daemon: leave it running
            found.append(int(entry))
    return found


def _node_process_alive(pid: int, marker: str) -> bool:
    """True if ``pid`` is a live (not zombie) process of the node ``marker``.

    For a node started by another process, which this one cannot ``wait()`` for. Where
    ``/proc`` exists, the process must also carry the node's env marker, so that a recycled
    pid is never mistaken for the node (and never signalled); elsewhere the pid is trusted.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process: not a node we started
    proc = Path(f"/proc/{pid}")
    if not Path("/proc/self").exists():
        return True
    try:
        stat = (proc / "stat").read_text(encoding="ascii", errors="replace")
        if stat.rpartition(")")[2].split()[:1] == ["Z"]:
            return False  # a zombie nobody reaped (e.g. PID 1 in a container)
        environ = (proc / "environ").read_bytes()
    except OSError:
        return False
    return f"{_MARKER_ENV}={marker}".encode() in environ.split(b"\0")


#: Brokers that may have a node or a temporary state dir to clean up at exit (strong refs,
#: so a forgotten LocalBroker object cannot be garbage-collected with its node running).
_live_brokers: set[LocalBroker] = set()
_atexit_lock = threading.Lock()
_atexit_registered = False


def _kill_live_brokers_at_exit() -> None:
    for broker in list(_live_brokers):
        with contextlib.suppress(Exception):
            broker._emergency_cleanup()


def _register_atexit(broker: LocalBroker) -> None:
    global _atexit_registered
    with _atexit_lock:
        _live_brokers.add(broker)
        if not _atexit_registered:
            atexit.register(_kill_live_brokers_at_exit)
            _atexit_registered = True


class LocalBroker:
    """A private RabbitMQ node on 127.0.0.1 with free ports, for development and tests.

    Args:
        state_dir: directory for the node's data, logs, configuration and Erlang cookie.
            When omitted, a temporary directory is created on :meth:`start` and removed by
            :meth:`stop`. A directory you pass is never removed; to reuse its data in a later
            run, pass the same ``node_name`` too (Mnesia data is tied to the node name).
        node_name: Erlang node name; default ``amqp_locks_<pid>_<random>@localhost``. A name
            without ``@`` gets ``@localhost`` appended.
        amqp_port: AMQP port; default a free port. The Erlang distribution port (and the
            management port) are always picked automatically.
        management: also enable the management plugin (HTTP API/UI on
            :attr:`management_url`, guest/guest). Adds a second or two to the startup.

    Example::

        broker = LocalBroker()
        broker.start()                 # raises LocalBrokerError with the log tail on failure
        conn = pika.BlockingConnection(pika.URLParameters(broker.url))
        broker.restart()               # conn is now closed by the broker; durable queues stay
        broker.kill()                  # SIGKILL, like a crash; data stays on disk
        broker.start()                 # same node, same ports, recovers durable queues
        broker.stop()                  # clean shutdown; removes the temporary state dir

    Starting takes about 3-5 seconds. The node runs in its own process group with stdin
    closed; its console output goes to ``<state_dir>/server-output.log`` and its log to
    ``<state_dir>/log/<node>.log``. Nodes still running when the interpreter exits are
    killed by an ``atexit`` hook. Methods are thread-safe.
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        node_name: str | None = None,
        amqp_port: int | None = None,
        management: bool = False,
    ) -> None:
        if node_name is None:
            node_name = f"amqp_locks_{os.getpid()}_{secrets.token_hex(4)}@localhost"
        elif "@" not in node_name:
            node_name = f"{node_name}@localhost"
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+@[A-Za-z0-9_.\-]+", node_name):
            raise ValueError(f"invalid Erlang node name: {node_name!r}")
        if amqp_port is not None and not 0 < amqp_port < 65536:
            raise ValueError(f"invalid amqp_port: {amqp_port!r}")
        self._node_name = node_name
        self._management = management
        self._fixed_amqp_port = amqp_port is not None
        self._amqp_port = 0
        self._dist_port = 0
        self._management_port: int | None = None
        self._pick_ports(amqp_port)
        self._owns_state_dir = state_dir is None
        self._state_dir: Path | None = (
            None if state_dir is None else Path(state_dir).expanduser().absolute()
        )
        self._proc: subprocess.Popen[bytes] | None = None
        #: PID of a node started by another process, set by attach() (no Popen to wait on).
        self._attached_pid: int | None = None
        self._server: Path | None = None
        self._ever_started = False
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ properties

    @property
    def node_name(self) -> str:
        """The Erlang node name, e.g. ``amqp_locks_1234_0a1b2c3d@localhost``."""
        return self._node_name

    @property
    def amqp_port(self) -> int:
        """The AMQP port on 127.0.0.1."""
        return self._amqp_port

    @property
    def dist_port(self) -> int:
        """The Erlang distribution port on 127.0.0.1 (for ``rabbitmqctl``/clustering)."""
        return self._dist_port

    @property
    def management_port(self) -> int | None:
        """The management HTTP port, or None when ``management`` is off."""
        return self._management_port

    @property
    def url(self) -> str:
        """AMQP URL of the node's default vhost: ``amqp://guest:guest@127.0.0.1:PORT/%2F``."""
        return f"amqp://guest:guest@127.0.0.1:{self._amqp_port}/%2F"

    @property
    def management_url(self) -> str | None:
        """``http://127.0.0.1:PORT/`` of the management plugin, or None when it is off."""
        if self._management_port is None:
            return None
        return f"http://127.0.0.1:{self._management_port}/"

    @property
    def state_dir(self) -> Path | None:
        """The state directory; None until :meth:`start` creates a temporary one."""
        return self._state_dir

    @property
    def log_file(self) -> Path | None:
        """The node's own log file (None before a state directory exists)."""
        if self._state_dir is None:
            return None
        return self._state_dir / "log" / f"{self._node_name}.log"

    @property
    def output_file(self) -> Path | None:
        """File receiving the server process's stdout and stderr."""
        if self._state_dir is None:
            return None
        return self._state_dir / "server-output.log"

    @property
    def pid(self) -> int | None:
        """PID of the ``rabbitmq-server`` process (also its process group id) while running."""
        proc = self._proc
        if proc is not None:
            return proc.pid if proc.poll() is None else None
        pid = self._attached_pid
        return pid if pid is not None and _node_process_alive(pid, self._node_name) else None

    @property
    def record_file(self) -> Path | None:
        """Where :meth:`detach` writes the node's record (None before a state dir exists)."""
        return None if self._state_dir is None else self._state_dir / RECORD_FILE

    @classmethod
    def available(cls) -> bool:
        """True if a usable ``rabbitmq-server`` is installed on this machine."""
        return find_rabbitmq_server() is not None

    def is_running(self) -> bool:
        """True while the node's OS process is alive (it may still be booting)."""
        return self.pid is not None

    # ------------------------------------------------------------------ outliving the process

    def detach(self) -> Path:
        """Let the running node outlive this process; return the path of its record.

        Takes the node off the ``atexit`` kill list and writes :data:`RECORD_FILE` (node
        name, ports, pid, state directory, URLs) into the state directory, for
        :meth:`attach` in a later process. The node must have a state directory of the
        caller's (``LocalBroker(state_dir)``): a temporary one would be removed at exit.
        This object stays usable; :meth:`stop` still stops the node and removes the record.

        Raises:
            LocalBrokerError: the node is not running, or its state dir is a temporary one.
        """
        with self._lock:
            pid = self.pid
            state = self._state_dir
            if pid is None or state is None:
                raise LocalBrokerError(f"node {self._node_name} is not running")
            if self._owns_state_dir:
                raise LocalBrokerError(
                    "only a node with a state_dir of the caller's can be detached (a temporary "
                    "one is removed at exit); pass LocalBroker(state_dir)"
                )
            record: dict[str, Any] = {
                "version": _RECORD_VERSION,
                "node_name": self._node_name,
                "pid": pid,
                "amqp_port": self._amqp_port,
                "dist_port": self._dist_port,
                "management_port": self._management_port,
                "url": self.url,
                "management_url": self.management_url,
                "state_dir": str(state),
                "server": str(self._server) if self._server is not None else None,
                "started_at": time.time(),
            }
            path = state / RECORD_FILE
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
            os.replace(tmp, path)
            with _atexit_lock:
                _live_brokers.discard(self)
            logger.info("node %s detached; record in %s", self._node_name, path)
            return path

    @classmethod
    def attach(cls, state_dir: str | os.PathLike[str]) -> LocalBroker:
        """A LocalBroker for the node that :meth:`detach` recorded in ``state_dir``.

        It reports :meth:`is_running`, :attr:`url`, :attr:`pid` etc., and :meth:`stop`,
        :meth:`kill` and :meth:`restart` control the node although another process started
        it. A stopped or crashed node gives an object whose :meth:`is_running` is False
        (:meth:`stop` then still kills stragglers and removes the record). Where ``/proc``
        exists, a process only counts as the node if it carries the node's marker, so a
        recycled pid is never signalled.

        Raises:
            LocalBrokerError: no readable record in ``state_dir``.
        """
        state = Path(state_dir).expanduser().absolute()
        path = state / RECORD_FILE
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            if record.get("version") != _RECORD_VERSION:
                raise ValueError(f"unknown record version {record.get('version')!r}")
            node_name = str(record["node_name"])
            amqp_port = int(record["amqp_port"])
            dist_port = int(record["dist_port"])
            management_port = record.get("management_port")
            pid = int(record["pid"])
            server = record.get("server")
        except FileNotFoundError as exc:
            raise LocalBrokerError(f"no LocalBroker record in {state} ({RECORD_FILE})") from exc
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LocalBrokerError(f"unreadable LocalBroker record {path}: {exc}") from exc
        broker = cls(
            state,
            node_name=node_name,
            amqp_port=amqp_port,
            management=management_port is not None,
        )
        broker._dist_port = dist_port
        broker._management_port = None if management_port is None else int(management_port)
        broker._attached_pid = pid
        broker._ever_started = True
        if server is not None and Path(server).is_file():
            broker._server = Path(server)
        return broker

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"<LocalBroker {self._node_name} {self.url} {state}>"

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60.0) -> None:
        """Start the node and wait until RabbitMQ is fully booted.

        Does nothing if it is already running. If the automatically picked ports were taken
        by someone else in the meantime, retries with new ones (only before the first
        successful start: afterwards the ports, and so :attr:`url`, stay fixed).

        Raises:
            LocalBrokerError: ``rabbitmq-server`` is not installed, or the node did not come
                up within ``timeout`` seconds (the message holds the end of its logs). A node
                that failed to start is killed with everything it spawned.
        """
        with self._lock:
            if self.is_running():
                return
            self._attached_pid = None
            server = find_rabbitmq_server()
            if server is None:
                raise LocalBrokerError(_INSTALL_HINT.format(dirs=", ".join(_FALLBACK_DIRS)))
            deadline = time.monotonic() + timeout
            attempts = 1 if (self._fixed_amqp_port or self._ever_started) else 3
            for attempt in range(1, attempts + 1):
                try:
                    self._start_once(server, deadline)
                except LocalBrokerError as exc:
                    if attempt < attempts and "eaddrinuse" in str(exc).lower():
                        logger.warning(
                            "node %s: port conflict (%s), retrying with new ports",
                            self._node_name,
                            self._port_summary(),
                        )
                        self._pick_ports(None)
                        continue
                    raise
                self._ever_started = True
                return

    def stop(self, timeout: float = 30.0, *, keep_state: bool = False) -> None:
        """Stop the node cleanly (``rabbitmqctl stop``); kill it if it does not exit in time.

        Idempotent. Removes the state directory if this LocalBroker created it (a temporary
        one), unless ``keep_state`` is true; a directory passed by the caller is kept.
        """
        with self._lock:
            if self._proc is not None or self._attached_pid is not None:
                if self.is_running():
                    deadline = time.monotonic() + timeout
                    logger.info("stopping RabbitMQ node %s", self._node_name)
                    with contextlib.suppress(LocalBrokerError):
                        self._ctl(["stop"], timeout=max(1.0, timeout * 0.8))
                    if not self._wait_exit(max(0.5, deadline - time.monotonic())):
                        logger.warning(
                            "node %s did not exit within %.0f s; killing it",
                            self._node_name,
                            timeout,
                        )
                self._kill_all()
                self._proc = None
                self._attached_pid = None
                record = self.record_file
                if record is not None:  # it described the node just stopped
                    with contextlib.suppress(FileNotFoundError):
                        record.unlink()
            with _atexit_lock:
                _live_brokers.discard(self)
            if self._owns_state_dir and not keep_state and self._state_dir is not None:
                shutil.rmtree(self._state_dir, ignore_errors=True)
                self._state_dir = None

    def kill(self) -> None:
        """SIGKILL the node and everything it spawned, as in a crash. Keeps the state dir.

        A later :meth:`start` boots the same node from the same data on the same ports.
        """
        with self._lock:
            if self._proc is not None or self._attached_pid is not None:
                logger.info("killing RabbitMQ node %s", self._node_name)
                self._kill_all()
                self._proc = None
                self._attached_pid = None

    def restart(self, timeout: float = 60.0) -> None:
        """Restart the RabbitMQ application inside the running node, keeping its data.

        Runs ``rabbitmqctl stop_app``, ``start_app`` and ``await_startup``: every client
        connection is closed (with 320 CONNECTION_FORCED), exclusive and non-durable queues
        disappear, durable queues and persistent messages survive. Ports stay the same.

        Raises:
            LocalBrokerError: the node is not running, or a step failed or timed out.
        """
        with self._lock:
            if not self.is_running():
                raise LocalBrokerError(f"node {self._node_name} is not running")
            deadline = time.monotonic() + timeout
            logger.info("restarting the RabbitMQ application on node %s", self._node_name)
            try:
                for command in ("stop_app", "start_app", "await_startup"):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise LocalBrokerError(f"timed out before `rabbitmqctl {command}`")
                    args = [command]
                    if command == "await_startup":
                        args = ["--timeout", str(max(1, int(remaining))), command]
                    self._ctl(args, timeout=remaining)
            except LocalBrokerError as exc:
                raise LocalBrokerError(
                    f"restart of node {self._node_name} failed: {exc}\n{self._log_tails()}"
                ) from exc

    def __enter__(self) -> LocalBroker:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals

    def _pick_ports(self, amqp_port: int | None) -> None:
        count = 2 if self._management else 1
        if amqp_port is None:
            count += 1
        ports = _free_ports(count)
        self._amqp_port = amqp_port if amqp_port is not None else ports.pop()
        self._dist_port = ports.pop()
        self._management_port = ports.pop() if self._management else None

    def _port_summary(self) -> str:
        summary = f"amqp={self._amqp_port} dist={self._dist_port}"
        if self._management_port is not None:
            summary += f" management={self._management_port}"
        return summary

    def _prepare_state_dir(self) -> Path:
        if self._state_dir is None:
            self._state_dir = Path(tempfile.mkdtemp(prefix="amqp_locks_broker_"))
        _register_atexit(self)
        state = self._state_dir
        for sub in ("log", "mnesia", "conf.d"):
            (state / sub).mkdir(parents=True, exist_ok=True)
        cookie = state / ".erlang.cookie"
        if not cookie.exists():
            alphabet = string.ascii_uppercase
            value = "".join(secrets.choice(alphabet) for _ in range(32))
            fd = os.open(cookie, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            with os.fdopen(fd, "w") as fh:
                fh.write(value)
        plugins = "[rabbitmq_management]." if self._management else "[]."
        (state / "enabled_plugins").write_text(plugins + "\n", encoding="utf-8")
        lines = [
            "# Written by amqp_locks.broker.LocalBroker; rewritten on every start.",
            f"listeners.tcp.1 = 127.0.0.1:{self._amqp_port}",
        ]
        if self._management_port is not None:
            lines += [
                f"management.tcp.port = {self._management_port}",
                "management.tcp.ip = 127.0.0.1",
            ]
        (state / "rabbitmq.conf").write_text("\n".join(lines) + "\n", encoding="utf-8")
        with contextlib.suppress(FileNotFoundError):
            (state / "rabbitmq.pid").unlink()  # a stale one (after kill) confuses `wait`
        with contextlib.suppress(FileNotFoundError):
            (state / RECORD_FILE).unlink()  # describes a node that is gone
        return state

    def _env(self) -> dict[str, str]:
        state = self._state_dir
        assert state is not None
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("RABBITMQ_", "ERL_")) or key in _KEEP_ENV
        }
        env.pop(_MARKER_ENV, None)
        path_dirs = env.get("PATH", "").split(os.pathsep)
        path_dirs = [d for d in path_dirs if d] + [d for d in _SYSTEM_PATH if d not in path_dirs]
        env["PATH"] = os.pathsep.join(path_dirs)
        if not (env.get("LC_ALL") or env.get("LANG")):
            env["LANG"] = "C.UTF-8"
        env.update(
            {
                _MARKER_ENV: self._node_name,
                # Both the node and rabbitmqctl read $HOME/.erlang.cookie.
                "HOME": str(state),
                "RABBITMQ_NODENAME": self._node_name,
                "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                "RABBITMQ_NODE_PORT": str(self._amqp_port),
                "RABBITMQ_DIST_PORT": str(self._dist_port),
                "RABBITMQ_MNESIA_BASE": str(state / "mnesia"),
                "RABBITMQ_LOG_BASE": str(state / "log"),
                "RABBITMQ_PID_FILE": str(state / "rabbitmq.pid"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(state / "enabled_plugins"),
                "RABBITMQ_CONFIG_FILE": str(state / "rabbitmq.conf"),
                # Keep the system's /etc/rabbitmq out: its rabbitmq-env.conf may set
                # NODENAME=rabbit@localhost, and conf.d/advanced.config may hold anything.
                "RABBITMQ_CONF_ENV_FILE": str(state / "rabbitmq-env.conf"),
                "RABBITMQ_CONFIG_FILES": str(state / "conf.d"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(state / "advanced.config"),
                "RABBITMQ_MOTD_FILE": str(state / "motd"),
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": (
                    "-kernel inet_dist_use_interface {127,0,0,1}"
                ),
                # rabbitmqctl's own distribution listener: any free port, instead of the
                # fixed 35672-35682 range that parallel CLI calls could exhaust.
                "RABBITMQ_CTL_DIST_PORT_MIN": "0",
                "RABBITMQ_CTL_DIST_PORT_MAX": "0",
            }
        )
        return env

    def _start_once(self, server: Path, deadline: float) -> None:
        state = self._prepare_state_dir()
        self._server = server
        env = self._env()
        output = state / "server-output.log"
        logger.info(
            "starting RabbitMQ node %s (%s) in %s", self._node_name, self._port_summary(), state
        )
        started_at = time.monotonic()
        with open(output, "ab") as out:
            out.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} start =====\n".encode())
            out.flush()
            try:
                self._proc = subprocess.Popen(
                    [str(server)],
                    env=env,
                    cwd=state,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as exc:
                raise LocalBrokerError(f"could not run {server}: {exc}") from exc
        try:
            self._await_boot(deadline)
        except BaseException as exc:
            self._kill_all()
            self._proc = None
            if isinstance(exc, LocalBrokerError):
                raise LocalBrokerError(
                    f"RabbitMQ node {self._node_name} failed to start: {exc}\n{self._log_tails()}"
                ) from exc
            raise
        logger.info(
            "RabbitMQ node %s is up at %s (%.1f s)",
            self._node_name,
            self.url,
            time.monotonic() - started_at,
        )

    def _await_boot(self, deadline: float) -> None:
        """Wait for the node to boot, watching that the server process stays alive.

        ``rabbitmqctl await_startup`` fails at once while the node is not yet reachable, so
        first ``rabbitmqctl wait <pidfile>`` (which waits for the pid file, the Erlang
        distribution and the applications), then ``await_startup`` to confirm.
        """
        state = self._state_dir
        proc = self._proc
        assert state is not None and proc is not None
        for command in ("wait", "await_startup"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LocalBrokerError("timed out waiting for the node to boot")
            if command == "wait":
                args = ["wait", str(state / "rabbitmq.pid"), "--timeout", str(int(remaining) + 1)]
            else:
                args = ["--timeout", str(int(remaining) + 1), "await_startup"]
            self._ctl(args, timeout=remaining, watch=proc)

    def _ctl(
        self,
        args: list[str],
        *,
        timeout: float,
        watch: subprocess.Popen[bytes] | None = None,
    ) -> str:
        """Run ``rabbitmqctl -n NODE ARGS`` with the node's environment; return its output.

        With ``watch``, fail early if that (server) process exits meanwhile.
        """
        server = self._server or find_rabbitmq_server()
        if server is None:
            raise LocalBrokerError(_INSTALL_HINT.format(dirs=", ".join(_FALLBACK_DIRS)))
        state = self._state_dir
        assert state is not None
        cmd = [str(server.parent / "rabbitmqctl"), "-n", self._node_name, *args]
        logger.debug("running %s", " ".join(cmd))
        with tempfile.TemporaryFile() as out:
            ctl = subprocess.Popen(
                cmd,
                env=self._env(),
                cwd=state,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
            deadline = time.monotonic() + timeout
            failure: str | None = None
            try:
                while True:
                    try:
                        ctl.wait(timeout=0.1)
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    if watch is not None and watch.poll() is not None:
                        failure = f"the server process exited with status {watch.returncode}"
                        break
                    if time.monotonic() > deadline:
                        failure = f"`rabbitmqctl {' '.join(args)}` timed out after {timeout:.0f} s"
                        break
            finally:
                if ctl.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(ctl.pid, signal.SIGKILL)
                    ctl.wait()
            out.seek(0)
            text = out.read().decode("utf-8", errors="replace").strip()
        logger.debug("rabbitmqctl %s -> %s: %s", " ".join(args), ctl.returncode, text[-2000:])
        if failure is None and ctl.returncode != 0:
            failure = f"`rabbitmqctl {' '.join(args)}` exited with status {ctl.returncode}"
        if failure is not None:
            raise LocalBrokerError(f"{failure}\n{text[-_TAIL_CHARS:]}".rstrip())
        return text

    def _kill_all(self) -> None:
        """SIGKILL the server's process group and every process carrying our env marker.

        The Erlang VM starts helpers (``erl_child_setup``, ``inet_gethost``, the disk monitor
        shell) in sessions of their own, so killing the process group alone can orphan them.
        """
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        attached = self._attached_pid
        if attached is not None and _node_process_alive(attached, self._node_name):
            # Started with start_new_session: the server's pid is its process group id.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(attached, signal.SIGKILL)
        for _ in range(50):
            pids = _pids_with_marker(self._node_name)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.warning("process %d of node %s did not die", proc.pid, self._node_name)

    def _wait_exit(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the server process to exit; True if it did."""
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = time.monotonic() + timeout
        while self.is_running():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def _emergency_cleanup(self) -> None:
        """atexit hook: kill a node left running and remove a temporary state dir."""
        if self._proc is not None:
            logger.warning("killing RabbitMQ node %s left running at exit", self._node_name)
            self._kill_all()
            self._proc = None
        if self._owns_state_dir and self._state_dir is not None:
            shutil.rmtree(self._state_dir, ignore_errors=True)
            self._state_dir = None

    def _log_tails(self) -> str:
        parts: list[str] = []
        for label, path in (("server output", self.output_file), ("node log", self.log_file)):
            if path is None:
                continue
            tail = _tail(path)
            if tail:
                parts.append(f"--- {label} ({path}), last lines ---\n{tail}")
        return "\n".join(parts) if parts else "(no log output)"
