"""The ``amqp-locks`` command line (also ``python -m amqp_locks``).

Administer semaphores (``create``, ``ensure``, ``resize``, ``add``, ``remove``, ``destroy``,
``status``, ``wait``), hold a slot while a command runs (``run``, like ``flock(1)`` across
hosts), administer and use pressure queues from scripts (``queue create|status|put|get|close|
kick|delete``), run a throwaway broker for development (``broker start|stop|status|url``) and
the live demo (``demo``). Every command and exit code is described in ``docs/cli.md``; ``amqp-locks
COMMAND --help`` says the same in short.

It uses only the public API (:mod:`amqp_locks`, :mod:`amqp_locks.errors`,
:mod:`amqp_locks.broker`, :mod:`amqp_locks.demo`), so it doubles as an example of it.

Conventions: data goes to stdout (``--json`` makes it machine-readable); errors are one line
on stderr, ``amqp-locks: error: …``, with a traceback only under ``-v``; progress of long waits
is shown on stderr when it is a terminal; the exit status says what happened (:class:`Exit`).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import enum
import importlib
import json
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from . import (
    DEFAULT_URL,
    HOLDER_ID_ARGUMENT,
    Connection,
    Lease,
    PressureQueue,
    Semaphore,
    SemaphoreAdmin,
    __version__,
    errors,
    redact_url,
)
from .broker import LocalBroker, LocalBrokerError

__all__ = ["Exit", "main"]

PROG = "amqp-locks"
log = logging.getLogger("amqp_locks.cli")

#: Broker used when neither --url, $AMQP_URL nor a running local broker says otherwise.
#: Image of the Docker fallback of ``broker start`` (the one the pytest plugin uses).
DOCKER_IMAGE = "rabbitmq:3.13-management"
_DOCKER_RECORD = "docker-broker.json"
_NODE_SUBDIR = "node"
_MANAGEMENT_TIMEOUT = 3.0
#: Holder queue argument set by amqp_locks on every B queue (see docs/semaphore.md).


class Exit(enum.IntEnum):
    """Exit statuses of ``amqp-locks`` (``run`` also passes its command's status through)."""

    OK = 0
    ERROR = 1  # anything not listed below
    USAGE = 2  # bad arguments (argparse), invalid names or values
    TIMEOUT = 3  # --timeout passed: no slot became free, or holders kept removed slots
    NOT_FOUND = 4  # the semaphore does not exist
    BUSY = 5  # run --no-wait found no free slot; another admin kept the admin mutex
    LOST = 6  # run: the slot was lost while COMMAND ran (COMMAND was terminated)
    EXISTS = 7  # create: the semaphore already exists
    UNAVAILABLE = 8  # no broker to talk to (or none to start); the broker failed or timed out
    CLOSED = 9  # queue put/close/kick after close; queue get on a closed, drained queue


EXIT_CODES_HELP = """\
exit status:
  0  ok                       5  busy (run --no-wait; another admin holds the mutex)
  1  other error              6  lock lost while COMMAND ran (COMMAND was terminated)
  2  usage                    7  already exists (create)
  3  timeout                  8  broker unavailable
  4  not found (semaphore     9  queue closed (put/close/kick after close; get once drained)
     or queue)                run: otherwise COMMAND's own status (128+N if killed by signal N)
"""


class CliError(Exception):
    """An error to report as one line on stderr, with its exit status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Interrupted(BaseException):
    """SIGTERM or SIGHUP while waiting (SIGINT raises KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# ------------------------------------------------------------------------------------ output


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _error_line(message: str) -> None:
    _err(f"{PROG}: error: {message}")


def _emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    """Write ``data`` as JSON under --json, else ``text``."""
    if args.json:
        _out(json.dumps(data, indent=2))
    else:
        _out(text)


def _plural(n: int, word: str = "slot") -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _slot_list(slots: Sequence[int]) -> str:
    return ("slot " if len(slots) == 1 else "slots ") + ", ".join(map(str, slots))


class _Progress:
    """A line on stderr, rewritten every second, while a long wait runs (terminals only)."""

    def __init__(self, label: str, *, enabled: bool = True) -> None:
        self._label = label
        self._enabled = enabled and _isatty(sys.stderr)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._width = 0

    def __enter__(self) -> _Progress:
        if self._enabled:
            self._thread = threading.Thread(target=self._tick, name="amqp-locks-progress")
            self._thread.daemon = True
            self._thread.start()
        return self

    def _tick(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(1.0):
            line = f"\r{self._label}… {time.monotonic() - started:.0f} s"
            self._width = max(self._width, len(line))
            sys.stderr.write(line)
            sys.stderr.flush()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if self._width:
                sys.stderr.write("\r" + " " * self._width + "\r")
                sys.stderr.flush()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


# ------------------------------------------------------------------------------- broker URL


def _state_dir(args: argparse.Namespace | None = None) -> Path:
    """Where ``broker start`` keeps its node: --state-dir, $AMQP_LOCKS_STATE_DIR, XDG."""
    given = getattr(args, "state_dir", None)
    if given:
        return Path(given).expanduser().absolute()
    env = os.environ.get("AMQP_LOCKS_STATE_DIR")
    if env:
        return Path(env).expanduser().absolute()
    base = os.environ.get("XDG_STATE_HOME") or "~/.local/state"
    return Path(base).expanduser().absolute() / "amqp_locks" / "broker"


@dataclass
class _DevBroker:
    """The broker ``amqp-locks broker start`` left running (a node, or a container)."""

    kind: str  # "local" or "docker"
    url: str
    management_url: str | None
    running: bool
    state_dir: Path
    details: dict[str, Any] = field(default_factory=dict)
    local: LocalBroker | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "kind": self.kind,
            "url": self.url,
            "management_url": self.management_url,
            "state_dir": str(self.state_dir),
            **self.details,
        }


def _port_open(url: str, timeout: float = 0.5) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "localhost", parts.port or 5672), timeout):
            return True
    except OSError:
        return False


def _find_dev_broker(state: Path) -> _DevBroker | None:
    """The broker recorded in ``state``, running or not; None if there is no record."""
    node_dir = state / _NODE_SUBDIR
    try:
        node = LocalBroker.attach(node_dir)
    except LocalBrokerError:
        node = None
    if node is not None:
        return _DevBroker(
            kind="local",
            url=node.url,
            management_url=node.management_url,
            running=node.is_running(),
            state_dir=state,
            details={"node": node.node_name, "pid": node.pid},
            local=node,
        )
    try:
        record = json.loads((state / _DOCKER_RECORD).read_text(encoding="utf-8"))
        url = str(record["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return _DevBroker(
        kind="docker",
        url=url,
        management_url=record.get("management_url"),
        running=_port_open(url),
        state_dir=state,
        details={"container": record.get("container"), "image": record.get("image")},
    )


def _resolve_url(args: argparse.Namespace, *, fallback: bool = True) -> tuple[str | None, str]:
    """The broker URL and where it came from: --url, $AMQP_URL, the local broker, localhost."""
    if args.url:
        return args.url, "--url"
    env = os.environ.get("AMQP_URL", "").strip()
    if env:
        return env, "$AMQP_URL"
    dev = _find_dev_broker(_state_dir())
    if dev is not None and dev.running:
        return dev.url, f"the local broker ({dev.state_dir})"
    if not fallback:
        return None, "none"
    return DEFAULT_URL, "the default"


def _url(args: argparse.Namespace) -> str:
    url, source = _resolve_url(args)
    assert url is not None
    log.info("broker %s (from %s)", redact_url(url), source)
    return url


# ------------------------------------------------------------------------ admin commands


@contextlib.contextmanager
def _admin(args: argparse.Namespace) -> Iterator[SemaphoreAdmin]:
    conn = Connection(_url(args), connect_timeout=args.connect_timeout)
    try:
        yield SemaphoreAdmin(args.name, namespace=args.namespace, connection=conn)
    finally:
        conn.close()


def _check_wait(args: argparse.Namespace) -> None:
    if args.timeout is not None and not args.wait:
        args.parser.error("--timeout applies only with --wait")


def _waiting_label(admin: SemaphoreAdmin) -> str:
    return f"waiting for the holders of removed slots of {admin.name!r} to let go"


def _cmd_create(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        slots = admin.create(args.slots)
        _emit(
            args,
            {"name": admin.name, "slots": slots},
            f"created semaphore {admin.name!r} with {_plural(slots)}",
        )
    return Exit.OK


def _cmd_ensure(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        slots = admin.ensure(args.slots)
        _emit(args, {"name": admin.name, "slots": slots}, f"{admin.name!r} has {_plural(slots)}")
    return Exit.OK


def _resized(args: argparse.Namespace, admin: SemaphoreAdmin, slots: int) -> None:
    waited = " (holders of removed slots have let go)" if getattr(args, "wait", False) else ""
    _emit(
        args,
        {"name": admin.name, "slots": slots},
        f"{admin.name!r} now has {_plural(slots)}{waited}",
    )


def _cmd_resize_or_remove(args: argparse.Namespace) -> int:
    _check_wait(args)
    with _admin(args) as admin, _Progress(_waiting_label(admin), enabled=args.wait):
        change = admin.resize if args.cmd == "resize" else admin.remove
        slots = change(args.slots, wait=args.wait, timeout=args.timeout)
    _resized(args, admin, slots)
    return Exit.OK


def _cmd_add(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        slots = admin.add(args.slots)
    _resized(args, admin, slots)
    return Exit.OK


def _cmd_destroy(args: argparse.Namespace) -> int:
    _check_wait(args)
    with _admin(args) as admin:
        existed = admin.exists()
        # Even when slot 1 is missing: destroy also prunes stray slot queues and the wake queue.
        with _Progress(_waiting_label(admin), enabled=args.wait):
            admin.destroy(wait=args.wait, timeout=args.timeout)
    if not existed and not args.missing_ok:
        raise CliError(
            Exit.NOT_FOUND,
            f"semaphore {admin.name!r} does not exist (nothing to destroy; --missing-ok "
            "makes that a success)",
        )
    waited = " (its holders have let go)" if args.wait else ""
    _emit(
        args,
        {"name": admin.name, "destroyed": True, "existed": existed},
        f"destroyed semaphore {admin.name!r}{waited}",
    )
    return Exit.OK


def _cmd_wait(args: argparse.Namespace) -> int:
    slots: list[int] | None = sorted(set(args.slot)) if args.slot else None
    which = "the removed slots" if slots is None else _slot_list(slots)
    with _admin(args) as admin:
        label = f"waiting for the holders of {which} of {admin.name!r} to let go"
        with _Progress(label):
            released = admin.wait_released(slots, timeout=args.timeout)
    if not released:
        raise CliError(
            Exit.TIMEOUT,
            f"{which} of semaphore {admin.name!r} still held after {args.timeout:g} s",
        )
    _emit(
        args,
        {"name": admin.name, "released": True, "slots": slots},
        f"no holder left on {which} of {admin.name!r}",
    )
    return Exit.OK


# ----------------------------------------------------------------------------------- status


@dataclass
class _Management:
    """Where and how the management API was asked about holders, and what went wrong."""

    url: str
    available: bool = False
    error: str | None = None


def _management_base(args: argparse.Namespace, url: str) -> str:
    if args.management_url:
        return str(args.management_url).rstrip("/") + "/"
    dev = _find_dev_broker(_state_dir())
    if dev is not None and dev.url == url and dev.management_url:
        return dev.management_url
    host = urlsplit(url).hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:15672/"


def _vhost(url: str) -> str:
    path = urlsplit(url).path
    return "/" if path in ("", "/") else unquote(path[1:])


class _ManagementClient:
    """Just enough of the RabbitMQ management HTTP API to name holders, with a time budget."""

    def __init__(self, base: str, url: str, budget: float) -> None:
        parts = urlsplit(url)
        user = unquote(parts.username) if parts.username is not None else "guest"
        password = unquote(parts.password) if parts.password is not None else "guest"
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        self._auth = f"Basic {token}"
        self.base = base
        self._deadline = time.monotonic() + budget

    def get(self, path: str) -> Any:
        """GET ``path``; None on 404. Raises OSError (incl. URLError/HTTPError) otherwise."""
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("out of time")
        request = urllib.request.Request(
            self.base + path, headers={"Authorization": self._auth, "Accept": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=min(2.0, remaining)) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise


def _holders(
    args: argparse.Namespace, url: str, base: str, held: Sequence[int]
) -> tuple[dict[int, dict[str, Any]], _Management]:
    """Who holds each slot, from the B queues' arguments and owners (management API)."""
    mgmt = _Management(_management_base(args, url))
    found: dict[int, dict[str, Any]] = {}
    client = _ManagementClient(mgmt.url, url, _MANAGEMENT_TIMEOUT)
    vhost = quote(_vhost(url), safe="")
    try:
        for slot in held:
            queue = client.get(f"api/queues/{vhost}/{quote(f'{base}-{slot}-B', safe='')}")
            mgmt.available = True
            if not isinstance(queue, dict):
                continue  # released since the probe
            arguments = queue.get("arguments") or {}
            owner = queue.get("owner_pid_details") or {}
            info: dict[str, Any] = {"holder": arguments.get(HOLDER_ID_ARGUMENT)}
            peer = owner.get("name")
            if peer:
                info["peer"] = f"{owner.get('peer_host')}:{owner.get('peer_port')}"
                conn = client.get(f"api/connections/{quote(str(peer), safe='')}")
                if isinstance(conn, dict):
                    props = conn.get("client_properties") or {}
                    info["connection"] = conn.get("user_provided_name") or props.get(
                        "connection_name"
                    )
            found[slot] = info
    except urllib.error.HTTPError as exc:
        mgmt.error = f"HTTP {exc.code} {exc.reason}"
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        mgmt.error = f"not reachable ({reason})"
    if mgmt.error:
        log.info("management API at %s: %s", mgmt.url, mgmt.error)
    return found, mgmt


def _cmd_status(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        url = admin.connection.settings.url
        slots = admin.slots()
        held = admin.held()
    holders: dict[int, dict[str, Any]] = {}
    mgmt: _Management | None = None
    if held:
        holders, mgmt = _holders(args, url, admin.name, held)
    free = slots - sum(1 for k in held if k <= slots)
    data: dict[str, Any] = {
        "name": admin.name,
        "exists": slots > 0,
        "slots": slots,
        "held": held,
        "free": free,
        "holders": [{"slot": k, **holders.get(k, {})} for k in held],
        "management": None
        if mgmt is None
        else {"url": mgmt.url, "available": mgmt.available, "error": mgmt.error},
    }
    if args.json:
        _out(json.dumps(data, indent=2))
    elif slots or held:
        lines = [f"{admin.name!r}: {_plural(slots)}, {len(held)} held, {free} free"]
        for k in held:
            info = holders.get(k, {})
            where = " (removed slot)" if k > slots else ""
            line = f"  slot {k}: held{where}"
            if info.get("holder"):
                line += f" by {info['holder']}"
            if info.get("connection") or info.get("peer"):
                detail = ", ".join(str(v) for v in (info.get("connection"), info.get("peer")) if v)
                line += f" [{detail}]"
            lines.append(line)
        if mgmt is not None and mgmt.error:
            lines.append(
                f"  (holders unknown: management API at {mgmt.url} {mgmt.error}; "
                "--management-url to point at it)"
            )
        _out("\n".join(lines))
    if slots == 0:
        raise CliError(Exit.NOT_FOUND, f"semaphore {admin.name!r} does not exist")
    return Exit.OK


# ------------------------------------------------------------------------ pressure queues


@contextlib.contextmanager
def _queue(args: argparse.Namespace) -> Iterator[PressureQueue]:
    conn = Connection(_url(args), connect_timeout=args.connect_timeout)
    try:
        yield PressureQueue(args.name, prefix=args.prefix, connection=conn)
    finally:
        conn.close()


def _cmd_queue_create(args: argparse.Namespace) -> int:
    with _queue(args) as q:
        q.create(args.bound, replicated=args.replicated, delivery_limit=args.delivery_limit)
        bound = f"bound {args.bound}" if args.bound else "unbounded"
        _emit(
            args,
            {
                "name": q.name,
                "queue": q.base,
                "bound": args.bound,
                "replicated": args.replicated,
                "delivery_limit": args.delivery_limit,
            },
            f"created pressure queue {q.name!r} ({bound})",
        )
    return Exit.OK


def _cmd_queue_status(args: argparse.Namespace) -> int:
    with _queue(args) as q:
        if not q.exists():
            raise CliError(Exit.NOT_FOUND, f"pressure queue {q.name!r} does not exist")
        data: dict[str, Any] = {
            "name": q.name,
            "queue": q.base,
            "bound": q.bound(),
            "length": q.length(),
            "closed": q.closed(),
            "dead": q.dead_length(),
            "producer": q.producer_id(),
            "consumer": q.consumer_id(),
            "stats": q.stats(),
        }
    stats = data["stats"]
    bound = data["bound"] or "unbounded"
    text = "\n".join(
        [
            f"{data['name']!r} ({data['queue']}): {data['length']} of {bound}"
            + (", closed" if data["closed"] else ""),
            f"  produced {stats['produced_messages']} items, {stats['produced_bytes']} bytes"
            f" (producer: {data['producer'] or '-'})",
            f"  consumed {stats['consumed_messages']} items, {stats['consumed_bytes']} bytes"
            f" (consumer: {data['consumer'] or '-'})",
            f"  dead-lettered: {data['dead']}",
        ]
    )
    _emit(args, data, text)
    return Exit.OK


def _cmd_queue_put(args: argparse.Namespace) -> int:
    items = [item.encode() for item in args.items]
    if not items:
        items = [line.rstrip(b"\n") for line in sys.stdin.buffer]
    with _queue(args) as q, q.producing(timeout=args.timeout) as p:
        for item in items:
            p.put(item, timeout=args.timeout)
        if args.close:
            p.close()
    _emit(args, {"name": args.name, "put": len(items)}, f"put {len(items)} item(s)")
    return Exit.OK


def _cmd_queue_get(args: argparse.Namespace) -> int:
    got = 0
    with _queue(args) as q, q.consuming(timeout=args.timeout) as c:
        while args.count is None or got < args.count:
            try:
                item = c.get(timeout=args.timeout)
            except errors.QueueClosedError:
                if got == 0:
                    raise
                break
            got += 1
            if args.json:
                _out(json.dumps({"item": base64.b64encode(item).decode()}))
            else:
                sys.stdout.buffer.write(item + b"\n")
                sys.stdout.flush()
    return Exit.OK


def _cmd_queue_close(args: argparse.Namespace) -> int:
    with _queue(args) as q:
        q.close(timeout=args.timeout)
    _emit(args, {"name": args.name, "closed": True}, f"closed pressure queue {args.name!r}")
    return Exit.OK


def _cmd_queue_kick(args: argparse.Namespace) -> int:
    with _queue(args) as q:
        moved = q.kick(args.count, timeout=args.timeout)
    _emit(args, {"name": args.name, "kicked": moved}, f"moved {moved} dead item(s) back")
    return Exit.OK


def _cmd_queue_delete(args: argparse.Namespace) -> int:
    with _queue(args) as q:
        try:
            q.delete(timeout=args.timeout)
        except errors.QueueDoesNotExistError:
            if not args.missing_ok:
                raise
    _emit(args, {"name": args.name, "deleted": True}, f"deleted pressure queue {args.name!r}")
    return Exit.OK


# -------------------------------------------------------------------------------------- run


@contextlib.contextmanager
def _signals(handlers: dict[int, Callable[[int, FrameType | None], Any]]) -> Iterator[None]:
    """Install signal handlers (main thread only) and restore the previous ones."""
    previous: dict[int, Any] = {}
    try:
        for signum, handler in handlers.items():
            previous[signum] = signal.signal(signum, handler)
        yield
    finally:
        for signum, old in previous.items():
            if old is not None:  # None: a handler not set from Python, which we cannot restore
                signal.signal(signum, old)


def _raise_interrupted(signum: int, _frame: FrameType | None) -> None:
    raise _Interrupted(signum)


def _in_terminal_foreground() -> bool:
    """True if we run in the foreground process group of our terminal (an interactive shell)."""
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
        except (AttributeError, ValueError, OSError):
            continue
    return False


def _die_with_us() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has Linux send SIGTERM to the child if we die first.

    Were amqp-locks killed (SIGKILL, the OOM killer), its connection would close and the slot
    go to someone else while COMMAND ran on, unprotected. ``prctl(PR_SET_PDEATHSIG)`` makes
    the kernel stop it instead. The function only calls ``prctl`` and ``getppid``, which is
    safe between fork and exec even though we run threads. None where there is no prctl.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # we died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _cmd_run(args: argparse.Namespace) -> int:
    command: list[str] = args.argv
    if not command:
        args.parser.error("no COMMAND given (amqp-locks run NAME [options] -- COMMAND [ARGS...])")
    conn = Connection(
        _url(args),
        heartbeat=args.heartbeat,
        verify_interval=args.verify_interval,
        connect_timeout=args.connect_timeout,
    )
    try:
        sem = Semaphore(args.name, namespace=args.namespace, connection=conn)
        lost = threading.Event()

        def on_lost(_lease: Lease) -> None:  # runs in the I/O thread: only flag it
            lost.set()

        interrupts: dict[int, Callable[[int, FrameType | None], Any]] = {
            signal.SIGTERM: _raise_interrupted,
            signal.SIGHUP: _raise_interrupted,
        }
        with _signals(interrupts):
            if args.no_wait:
                lease = sem.try_acquire(on_lost=on_lost)
                if lease is None:
                    raise CliError(
                        Exit.BUSY, f"every slot of semaphore {sem.name!r} is held (--no-wait)"
                    )
            else:
                with _Progress(f"waiting for a slot of {sem.name!r}"):
                    lease = sem.acquire(timeout=args.timeout, on_lost=on_lost)
        log.info("holding slot %d of %r as %s", lease.slot, lease.name, lease.holder_id)
        try:
            return _run_holding(args, command, lease, lost)
        finally:
            lease.release()
    finally:
        conn.close()


def _run_holding(
    args: argparse.Namespace, command: list[str], lease: Lease, lost: threading.Event
) -> int:
    """Run ``command`` while ``lease`` is held; terminate it if the lease is lost."""
    # In an interactive terminal the command stays in our process group, so that it can read
    # the terminal and the terminal's signals (Ctrl-C, Ctrl-\, hangup) reach it directly.
    # Otherwise it leads a group of its own and we signal that whole group.
    foreground = _in_terminal_foreground()
    env = dict(os.environ)
    env.update(
        AMQP_LOCKS_SEMAPHORE=lease.name,
        AMQP_LOCKS_SLOT=str(lease.slot),
        AMQP_LOCKS_HOLDER=lease.holder_id,
    )
    try:
        child = subprocess.Popen(
            command, env=env, start_new_session=not foreground, preexec_fn=_die_with_us()
        )
    except FileNotFoundError:
        raise CliError(127, f"{command[0]}: command not found") from None
    except OSError as exc:
        raise CliError(126, f"cannot run {command[0]}: {exc.strerror or exc}") from None
    log.info("started %s (pid %d)", command[0], child.pid)

    def deliver(signum: int) -> None:
        if child.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if foreground:
                child.send_signal(signum)
            else:
                os.killpg(child.pid, signum)

    def forward(signum: int, _frame: FrameType | None) -> None:
        log.info("forwarding %s to %s", signal.Signals(signum).name, command[0])
        deliver(signum)

    def ignore(signum: int, _frame: FrameType | None) -> None:
        log.info("%s: the terminal delivered it to COMMAND too", signal.Signals(signum).name)

    terminal_signals = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
    handlers: dict[int, Callable[[int, FrameType | None], Any]] = {signal.SIGTERM: forward}
    for signum in terminal_signals:
        handlers[signum] = ignore if foreground else forward
    lost_at: float | None = None
    killed = False
    with _signals(handlers):
        while True:
            try:
                status = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if lost_at is None and (lost.is_set() or not lease.held):
                lost_at = time.monotonic()
                _error_line(
                    f"lost slot {lease.slot} of semaphore {lease.name!r} "
                    f"({lease.lost_reason or 'no longer held'}); terminating {command[0]} "
                    f"(pid {child.pid}) with SIGTERM"
                )
                deliver(signal.SIGTERM)
            elif lost_at is not None and not killed and time.monotonic() - lost_at >= args.grace:
                _err(f"{PROG}: {command[0]} still runs {args.grace:g} s after SIGTERM; SIGKILL")
                deliver(signal.SIGKILL)
                killed = True
    log.info("%s exited with status %d", command[0], status)
    if lost_at is not None:
        return Exit.LOST
    # Fencing: the lease must still hold now that the command is done, or it did not protect
    # the command for its whole run.
    if not lease.verify():
        _error_line(
            f"lost slot {lease.slot} of semaphore {lease.name!r} before {command[0]} finished "
            f"({lease.lost_reason or 'no longer held'}); its work was not protected throughout"
        )
        return Exit.LOST
    return status if status >= 0 else 128 - status


# ----------------------------------------------------------------------------------- broker


@contextlib.contextmanager
def _state_lock(state: Path) -> Iterator[None]:
    """Serialise ``broker start``/``stop`` on one state dir (a no-op where flock is missing)."""
    state.mkdir(parents=True, exist_ok=True)
    if sys.platform == "win32":
        yield
        return
    import fcntl

    with open(state / ".lock", "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


_NO_BROKER_HINT = (
    "no way to start a broker here: rabbitmq-server is not installed (as root on "
    "Debian/Ubuntu: apt-get install -y rabbitmq-server; macOS: brew install rabbitmq) and no "
    "Docker engine answers (start one, or set DOCKER_HOST); or use an existing broker with "
    "--url or $AMQP_URL"
)


def _docker_client() -> Any:
    """A docker SDK client whose engine answers a ping, or None."""
    try:
        docker = importlib.import_module("docker")
    except ImportError:
        log.info("the docker package is not installed (pip install docker)")
        return None
    try:
        client = docker.from_env(timeout=5)
        client.ping()
    except Exception as exc:
        log.info("no Docker engine: %s", exc)
        return None
    return client


def _await_amqp(url: str, timeout: float) -> None:
    """Wait until a broker at ``url`` accepts an amqp_locks connection."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with Connection(url, connect_timeout=2.0) as conn:
                SemaphoreAdmin("amqp-locks-ping", connection=conn).exists()
            return
        except errors.BrokerError as exc:
            if time.monotonic() > deadline:
                raise CliError(Exit.UNAVAILABLE, f"the broker did not come up: {exc}") from exc
            time.sleep(1.0)


def _start_docker(client: Any, state: Path, timeout: float) -> _DevBroker:
    """Start a detached RabbitMQ container (it outlives us: no testcontainers reaper)."""
    name = f"amqp-locks-broker-{secrets.token_hex(4)}"
    _err(f"{PROG}: starting a RabbitMQ container ({DOCKER_IMAGE}, {name})…")
    container = client.containers.run(
        DOCKER_IMAGE,
        detach=True,
        name=name,
        labels={"amqp_locks.state_dir": str(state)},
        ports={"5672/tcp": ("127.0.0.1", None), "15672/tcp": ("127.0.0.1", None)},
    )
    try:
        container.reload()
        ports = container.attrs["NetworkSettings"]["Ports"]
        amqp_port = int(ports["5672/tcp"][0]["HostPort"])
        management_port = int(ports["15672/tcp"][0]["HostPort"])
        url = f"amqp://guest:guest@127.0.0.1:{amqp_port}/%2F"
        _await_amqp(url, timeout)
    except BaseException:
        with contextlib.suppress(Exception):
            container.remove(force=True)
        raise
    record = {
        "container": container.id,
        "name": name,
        "image": DOCKER_IMAGE,
        "url": url,
        "management_url": f"http://127.0.0.1:{management_port}/",
    }
    (state / _DOCKER_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    found = _find_dev_broker(state)
    assert found is not None
    return found


def _stop_dev_broker(dev: _DevBroker) -> None:
    if dev.local is not None:
        dev.local.stop()
        shutil.rmtree(dev.state_dir / _NODE_SUBDIR, ignore_errors=True)
        return
    client = _docker_client()
    if client is None:
        raise CliError(
            Exit.UNAVAILABLE,
            f"cannot stop container {dev.details.get('container')}: no Docker engine answers",
        )
    with contextlib.suppress(Exception):  # already gone: nothing to stop
        client.containers.get(dev.details.get("container")).remove(force=True)
    (dev.state_dir / _DOCKER_RECORD).unlink(missing_ok=True)


def _cmd_broker_start(args: argparse.Namespace) -> int:
    state = _state_dir(args)
    with _state_lock(state):
        dev = _find_dev_broker(state)
        if dev is not None and dev.running:
            _emit(args, {**dev.as_json(), "started": False}, dev.url)
            return Exit.OK
        if dev is not None:  # crashed or stopped behind our back: clear what is left
            _stop_dev_broker(dev)
        shutil.rmtree(state / _NODE_SUBDIR, ignore_errors=True)
        if args.backend in ("auto", "local") and LocalBroker.available():
            broker = LocalBroker(state / _NODE_SUBDIR, management=not args.no_management)
            _err(f"{PROG}: starting RabbitMQ node {broker.node_name} (a few seconds)…")
            try:
                broker.start(timeout=args.timeout)
                broker.detach()
            except BaseException:
                broker.stop()
                raise
        elif args.backend == "local":
            broker = LocalBroker(state / _NODE_SUBDIR)
            broker.start()  # raises LocalBrokerError with the install hint
        else:
            client = _docker_client() if args.backend in ("auto", "docker") else None
            if client is None:
                if args.backend == "docker":
                    raise CliError(
                        Exit.UNAVAILABLE,
                        "no Docker engine answers (start one, or set DOCKER_HOST); "
                        "`pip install docker` if the docker package is missing",
                    )
                raise CliError(Exit.UNAVAILABLE, _NO_BROKER_HINT)
            _start_docker(client, state, args.timeout)
        dev = _find_dev_broker(state)
        assert dev is not None
    _emit(args, {**dev.as_json(), "started": True}, dev.url)
    return Exit.OK


def _cmd_broker_stop(args: argparse.Namespace) -> int:
    state = _state_dir(args)
    with _state_lock(state):
        dev = _find_dev_broker(state)
        if dev is None:
            shutil.rmtree(state / _NODE_SUBDIR, ignore_errors=True)
            _emit(args, {"stopped": False, "state_dir": str(state)}, "no local broker to stop")
            return Exit.OK
        _err(f"{PROG}: stopping the local broker ({dev.kind}, {dev.url})…")
        _stop_dev_broker(dev)
    _emit(args, {"stopped": True, **dev.as_json(), "running": False}, "stopped")
    return Exit.OK


def _cmd_broker_status(args: argparse.Namespace) -> int:
    state = _state_dir(args)
    dev = _find_dev_broker(state)
    if dev is None or not dev.running:
        _emit(
            args,
            {"running": False, "state_dir": str(state)},
            f"no local broker is running (state dir {state})",
        )
        return Exit.UNAVAILABLE
    if dev.local is not None:
        what = f"node {dev.details['node']}, pid {dev.details['pid']}"
    else:
        what = f"container {str(dev.details.get('container'))[:12]}, {dev.details.get('image')}"
    lines = [
        f"running      {dev.kind} ({what})",
        f"url          {dev.url}",
        f"management   {dev.management_url or 'off'}",
        f"state dir    {dev.state_dir}",
    ]
    _emit(args, dev.as_json(), "\n".join(lines))
    return Exit.OK


def _cmd_broker_url(args: argparse.Namespace) -> int:
    dev = _find_dev_broker(_state_dir(args))
    if dev is None or not dev.running:
        raise CliError(
            Exit.UNAVAILABLE, "no local broker is running; start one with `amqp-locks broker start`"
        )
    _emit(args, {"url": dev.url, "management_url": dev.management_url}, dev.url)
    return Exit.OK


# ------------------------------------------------------------------------------------- demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    url, source = _resolve_url(args, fallback=False)
    if url is not None:
        log.info("demo on broker %s (from %s)", redact_url(url), source)
    return run_demo(url, workers=args.workers, phase_seconds=args.phase_seconds)


# ----------------------------------------------------------------------------------- parser


def _whole(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def _count(text: str) -> int:
    return _whole(text, 1, "at least 1")


def _bound(text: str) -> int:
    return _whole(text, 0, "0 (unbounded) or more")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _add_global_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """Options accepted both before and after the command (the latter win)."""

    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    group = parser.add_argument_group("global options")
    group.add_argument(
        "--url",
        default=default(None),
        help="broker URL (default: $AMQP_URL, else the running `amqp-locks broker`, else "
        f"{DEFAULT_URL.replace('%', '%%')})",
    )
    group.add_argument(
        "--namespace",
        default=default(None),
        help="prefix of the semaphore's queue names (as the library's namespace=)",
    )
    group.add_argument(
        "--json", action="store_true", default=default(False), help="write data as JSON"
    )
    group.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=default(0),
        help="log to stderr (-v info, -vv debug) and show tracebacks",
    )
    group.add_argument(
        "--connect-timeout",
        type=_positive_seconds,
        default=default(5.0),
        metavar="S",
        help="seconds to wait for the broker connection (default 5)",
    )


def _wait_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wait",
        action="store_true",
        help="then wait until the holders of removed slots let go",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        metavar="S",
        help="with --wait: give up after S seconds (exit 3; the change stays done)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``amqp-locks`` argument parser."""
    common = argparse.ArgumentParser(add_help=False)
    _add_global_options(common, top=False)
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Distributed semaphores on RabbitMQ: administer them, hold a slot while a "
        "command runs, run a throwaway broker. See docs/cli.md.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_global_options(parser, top=True)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    def command(
        name: str,
        handler: Callable[[argparse.Namespace], int],
        help_text: str,
        group: argparse._SubParsersAction[argparse.ArgumentParser] = commands,
    ) -> argparse.ArgumentParser:
        sub = group.add_parser(
            name,
            parents=[common],
            help=help_text,
            description=help_text,
            epilog=EXIT_CODES_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(handler=handler, parser=sub)
        return sub

    def named(
        name: str, handler: Callable[[argparse.Namespace], int], help_text: str
    ) -> argparse.ArgumentParser:
        sub = command(name, handler, help_text)
        sub.add_argument("name", metavar="NAME", help="the semaphore's name")
        return sub

    p = named("create", _cmd_create, "create a semaphore (exit 7 if it exists)")
    p.add_argument("--slots", type=_count, required=True, metavar="N", help="number of slots")
    p = named("ensure", _cmd_ensure, "create a semaphore, or resize it to N slots")
    p.add_argument("--slots", type=_count, required=True, metavar="N", help="number of slots")
    p = named("resize", _cmd_resize_or_remove, "set the number of slots of an existing semaphore")
    p.add_argument("slots", type=_count, metavar="N", help="the new number of slots")
    _wait_options(p)
    p = named("add", _cmd_add, "add N slots")
    p.add_argument("slots", type=_count, metavar="N", help="slots to add")
    p = named("remove", _cmd_resize_or_remove, "remove the N highest slots")
    p.add_argument("slots", type=_count, metavar="N", help="slots to remove")
    _wait_options(p)
    p = named("destroy", _cmd_destroy, "delete every slot of a semaphore")
    _wait_options(p)
    p.add_argument(
        "--missing-ok", action="store_true", help="succeed if the semaphore does not exist"
    )
    p = named("status", _cmd_status, "show the slot count, held slots and their holders")
    p.add_argument(
        "--management-url",
        metavar="URL",
        help="RabbitMQ management API, to name holders (default: http://<broker host>:15672/, "
        "or the local broker's)",
    )
    p = named("wait", _cmd_wait, "wait until holders (of removed slots by default) let go")
    p.add_argument(
        "--slot",
        type=_count,
        nargs="+",
        action="extend",
        metavar="K",
        help="wait for these slots instead (repeatable)",
    )
    p.add_argument("--timeout", type=_seconds, metavar="S", help="give up after S seconds (exit 3)")
    p = named(
        "run",
        _cmd_run,
        "hold a slot while COMMAND runs (amqp-locks run NAME [options] -- COMMAND [ARGS...])",
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--timeout",
        type=_seconds,
        metavar="S",
        help="wait at most S seconds for a slot (exit 3); default: forever",
    )
    how.add_argument(
        "--no-wait", action="store_true", help="fail at once (exit 5) if no slot is free"
    )
    p.add_argument(
        "--grace",
        type=_seconds,
        default=10.0,
        metavar="S",
        help="if the slot is lost: seconds between SIGTERM and SIGKILL (default 10)",
    )
    p.add_argument(
        "--heartbeat",
        type=_count,
        default=10,
        metavar="S",
        help="AMQP heartbeat in whole seconds (default 10): a frozen or cut-off holder "
        "loses its slot after about two",
    )
    p.add_argument(
        "--verify-interval",
        type=_positive_seconds,
        metavar="S",
        help="check that the slot is still held every S seconds (default: the heartbeat)",
    )
    p.add_argument("argv", nargs="*", metavar="COMMAND", help="the command and its arguments")

    broker = commands.add_parser(
        "broker",
        help="a private throwaway RabbitMQ node for development, demos and tests",
        description="A private throwaway RabbitMQ node (rabbitmq-server on this machine, else "
        "a Docker container) that outlives this command. State dir: --state-dir, "
        "$AMQP_LOCKS_STATE_DIR or ~/.local/state/amqp_locks/broker.",
    )
    actions = broker.add_subparsers(dest="action", metavar="ACTION", required=True)

    def broker_action(
        name: str, handler: Callable[[argparse.Namespace], int], help_text: str
    ) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, parents=[common], help=help_text, description=help_text)
        sub.set_defaults(handler=handler, parser=sub)
        sub.add_argument("--state-dir", metavar="DIR", help="where the broker's state lives")
        return sub

    p = broker_action("start", _cmd_broker_start, "start the broker (or print its URL)")
    p.add_argument(
        "--backend",
        choices=("auto", "local", "docker"),
        default="auto",
        help="rabbitmq-server here (local), a container (docker), or the first that works",
    )
    p.add_argument(
        "--no-management", action="store_true", help="skip the management plugin (faster)"
    )
    p.add_argument(
        "--timeout", type=_positive_seconds, default=90.0, metavar="S", help="startup limit"
    )
    broker_action("stop", _cmd_broker_stop, "stop the broker and delete its data")
    broker_action("status", _cmd_broker_status, "say whether it runs, where (exit 8 if not)")
    broker_action("url", _cmd_broker_url, "print its AMQP URL (exit 8 if it does not run)")

    queue = commands.add_parser(
        "queue",
        help="pressure queues: create, inspect, feed, drain, close, delete",
        description="Bounded FIFO pressure queues (docs/pressure.md). Items are bytes; on the "
        "command line, one item per argument or per stdin line.",
    )
    queue_actions = queue.add_subparsers(dest="action", metavar="ACTION", required=True)

    def queue_action(
        name: str, handler: Callable[[argparse.Namespace], int], help_text: str
    ) -> argparse.ArgumentParser:
        sub = command(name, handler, help_text, queue_actions)
        sub.add_argument("name", metavar="NAME", help="the queue's name")
        sub.add_argument(
            "--prefix",
            metavar="P",
            help="prefix of the queue names (default: $PRESSURE_PREFIX, else __pressure__)",
        )
        return sub

    def queue_timeout(sub: argparse.ArgumentParser, what: str) -> None:
        sub.add_argument(
            "--timeout", type=_seconds, metavar="S", help=f"{what} (exit 3); default: forever"
        )

    p = queue_action("create", _cmd_queue_create, "create a queue (exit 7 if it exists)")
    p.add_argument(
        "--bound", type=_bound, default=0, metavar="N", help="most items held (0: unbounded)"
    )
    p.add_argument("--replicated", action="store_true", help="keep items on quorum queues")
    p.add_argument(
        "--delivery-limit",
        type=_count,
        metavar="N",
        help="dead-letter an item after N deliveries without an acknowledgement",
    )
    queue_action("status", _cmd_queue_status, "length, bound, closed, stats and role holders")
    p = queue_action("put", _cmd_queue_put, "put ITEMs (or each stdin line) as the producer")
    p.add_argument("items", nargs="*", metavar="ITEM", help="items (default: stdin lines)")
    p.add_argument("--close", action="store_true", help="then close the queue")
    queue_timeout(p, "wait at most S seconds for the role and for room")
    p = queue_action("get", _cmd_queue_get, "get items as the consumer, one per stdout line")
    p.add_argument("--count", type=_count, default=1, metavar="N", help="items to get (default 1)")
    p.add_argument(
        "--all", dest="count", action="store_const", const=None, help="until closed and drained"
    )
    queue_timeout(p, "wait at most S seconds for the role and for each item")
    p = queue_action("close", _cmd_queue_close, "close the queue (exit 9 if already closed)")
    queue_timeout(p, "wait at most S seconds for the producer role")
    p = queue_action("kick", _cmd_queue_kick, "move dead-lettered items back to the tail")
    p.add_argument("--count", type=_count, default=1, metavar="N", help="items to move")
    queue_timeout(p, "wait at most S seconds for the role and for room")
    p = queue_action("delete", _cmd_queue_delete, "delete the queue and its items")
    p.add_argument("--missing-ok", action="store_true", help="succeed if it does not exist")
    queue_timeout(p, "wait at most S seconds for role holders to let go")

    p = command("demo", _cmd_demo, "the live demo: workers share a semaphore resized under them")
    p.add_argument("--workers", type=_count, default=8, metavar="N", help="worker processes")
    p.add_argument(
        "--phase-seconds",
        type=_positive_seconds,
        default=4.0,
        metavar="S",
        help="length of each phase (default 4)",
    )
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; for ``run``, everything after the first ``--`` is the command."""
    if "--" in argv and "run" in argv[: argv.index("--")]:
        cut = argv.index("--")
        args = parser.parse_args(argv[:cut])
        if args.cmd == "run":
            if args.argv:
                args.parser.error(f"unexpected arguments before --: {' '.join(args.argv)}")
            args.argv = argv[cut + 1 :]
            return args
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------- main


def _setup_logging(verbose: int) -> None:
    root = logging.getLogger()
    if verbose <= 0:
        # Our own error lines say what went wrong; keep library and pika logs out of stderr.
        root.addHandler(logging.NullHandler())
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose >= 2 else logging.INFO)
    if verbose < 3:
        logging.getLogger("pika").setLevel(logging.WARNING)


#: Library errors and their exit statuses, most specific first.
_ERROR_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (errors.SemaphoreNotFoundError, Exit.NOT_FOUND),
    (errors.SemaphoreExistsError, Exit.EXISTS),
    (errors.QueueDoesNotExistError, Exit.NOT_FOUND),
    (errors.QueueAlreadyExistsError, Exit.EXISTS),
    (errors.QueueClosedError, Exit.CLOSED),
    (errors.QueueInUseError, Exit.BUSY),
    (errors.QueueFullError, Exit.BUSY),
    (errors.OperationTimeoutError, Exit.TIMEOUT),
    (errors.AcquireTimeoutError, Exit.TIMEOUT),
    (errors.ReleaseTimeoutError, Exit.TIMEOUT),
    (errors.AdminBusyError, Exit.BUSY),
    (errors.ContentionError, Exit.BUSY),
    (errors.LockLostError, Exit.LOST),
    (errors.InvalidArgumentError, Exit.USAGE),
    (errors.BrokerUnavailableError, Exit.UNAVAILABLE),
    (errors.BrokerTimeoutError, Exit.UNAVAILABLE),
    (LocalBrokerError, Exit.UNAVAILABLE),
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``amqp-locks`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    args = _parse(parser, list(sys.argv[1:] if argv is None else argv))
    _setup_logging(args.verbose)
    try:
        return int(args.handler(args))
    except CliError as exc:
        _error_line(str(exc))
        return exc.code
    except KeyboardInterrupt:
        _err(f"{PROG}: interrupted")
        return 128 + signal.SIGINT
    except _Interrupted as exc:
        _err(f"{PROG}: interrupted by {signal.Signals(exc.signum).name}")
        return 128 + exc.signum
    except BrokenPipeError:
        # stdout closed early (`amqp-locks status x | head -1`): not worth a message.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return Exit.ERROR
    except Exception as exc:
        if args.verbose:
            sys.stderr.write(traceback.format_exc())
        for kind, code in _ERROR_CODES:
            if isinstance(exc, kind):
                _error_line(str(exc).splitlines()[0] if code == Exit.UNAVAILABLE else str(exc))
                if isinstance(exc, LocalBrokerError) and not args.verbose and "\n" in str(exc):
                    _err(f"{PROG}: (-v shows the node's log tail)")
                return code
        if isinstance(exc, errors.AmqpLocksError):
            _error_line(str(exc))
        else:
            _error_line(f"{type(exc).__name__}: {exc} (-v shows the traceback)")
        return Exit.ERROR
