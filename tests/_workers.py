"""Worker functions run in child processes by ``tests/test_concurrency.py``.

They are started with the ``spawn`` multiprocessing context (a fresh interpreter that imports
this module by name: the parent's ``sys.path`` is handed down, so the installed ``amqp_locks``
and this file are found). Every worker talks to the parent only through files and
``multiprocessing.Event`` objects, so a worker killed with SIGKILL or frozen with SIGSTOP
cannot corrupt a shared pipe or queue. Results are written as JSON, atomically (``os.replace``),
so the parent never reads half a report.

Every wait in here is bounded: a worker whose parent vanished exits on its own.
"""

from __future__ import annotations

import json
import os
import random
import time
import traceback
from pathlib import Path
from typing import Any

import pika
import pika.exceptions

from amqp_locks import Semaphore, SemaphoreAdmin, errors

__all__ = [
    "admin_churn",
    "churn",
    "existing_slot_queues",
    "hold",
    "probe_while_held",
    "wait_for_path",
    "wait_once",
    "write_json",
]


# ------------------------------------------------------------------------------------------
# Small shared helpers (also used by the parent)
# ------------------------------------------------------------------------------------------


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def touch(path: str | Path) -> None:
    write_json(path, {"pid": os.getpid(), "t": time.time()})


def wait_for_path(path: str | Path, timeout: float, interval: float = 0.01) -> bool:
    """True once ``path`` exists; False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    path = Path(path)
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def existing_slot_queues(url: str, base: str, upto: int) -> list[int]:
    """Slot numbers k in 1..upto whose A queue ``{base}-{k}-A`` exists.

    An independent check (not the library's probe code): a pika BlockingConnection in confirm
    mode publishes mandatory to each name; UnroutableError (312 NO_ROUTE) means missing.
    """
    params = pika.URLParameters(url)
    params.socket_timeout = 5
    params.blocked_connection_timeout = 30
    conn = pika.BlockingConnection(params)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        found = []
        for k in range(1, upto + 1):
            try:
                ch.basic_publish("", f"{base}-{k}-A", b"", mandatory=True)
            except pika.exceptions.UnroutableError:
                continue
            found.append(k)
        return found
    finally:
        conn.close()


def _connect(sem: Semaphore, name: str, namespace: str) -> None:
    """Open the semaphore's connection now (it is lazy) without taking a slot."""
    SemaphoreAdmin(name, connection=sem.connection, namespace=namespace).exists()


def _error(exc: BaseException) -> dict[str, str]:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


# ------------------------------------------------------------------------------------------
# Workers
# ------------------------------------------------------------------------------------------


def churn(
    url: str,
    namespace: str,
    name: str,
    rounds: int,
    go: Any,
    out: str,
    seed: int,
    hold_ms: tuple[float, float] = (1.0, 6.0),
    acquire_timeout: float = 60.0,
) -> None:
    """Acquire and release ``rounds`` times, recording ``[slot, t_start, t_end, ...]``.

    ``t_start`` is taken right after ``acquire`` returned and ``t_end`` right before
    ``release``, both with ``time.time()``; the hold in between is a random few ms.
    """
    rng = random.Random(seed)
    report: dict[str, Any] = {"pid": os.getpid(), "records": [], "errors": []}
    sem = Semaphore(name, url=url, namespace=namespace)
    try:
        _connect(sem, name, namespace)
        if not go.wait(60):
            report["errors"].append({"type": "NoGo", "message": "go event never set"})
            return
        for _ in range(rounds):
            try:
                lease = sem.acquire(timeout=acquire_timeout)
            except Exception as exc:
                report["errors"].append(_error(exc))
                continue
            t_start = time.time()
            time.sleep(rng.uniform(*hold_ms) / 1000.0)
            held = lease.held
            t_end = time.time()
            lease.release()
            report["records"].append([lease.slot, t_start, t_end, lease.collisions, held])
    except Exception as exc:
        report["errors"].append(_error(exc))
    finally:
        sem.close()
        write_json(out, report)


def hold(
    url: str,
    namespace: str,
    name: str,
    heartbeat: int,
    ready: str,
    proceed: str,
    out: str,
    max_hold: float = 60.0,
    notice_within: float = 10.0,
) -> None:
    """Hold a slot inside ``with sem.acquire() as lease:`` until ``proceed`` appears.

    Touches ``ready`` once the slot is held. When ``proceed`` appears, waits up to
    ``notice_within`` seconds for the lease to be reported lost (it is expected to be, after
    a SIGSTOP longer than two heartbeats), then leaves the ``with`` block and reports what it
    saw: ``held``/``lost``/``reason`` just before leaving, whether on_lost fired, and whether
    leaving raised LockLostError.
    """
    report: dict[str, Any] = {"pid": os.getpid(), "raised": None}
    lost_at: list[float] = []
    sem = Semaphore(name, url=url, namespace=namespace, heartbeat=heartbeat)
    try:
        _connect(sem, name, namespace)
        try:
            with sem.acquire(
                timeout=10, on_lost=lambda _lease: lost_at.append(time.time())
            ) as lease:
                report["slot"] = lease.slot
                touch(ready)
                report["proceed_seen"] = wait_for_path(proceed, max_hold, interval=0.02)
                report["resumed_at"] = time.time()
                deadline = time.monotonic() + notice_within
                while lease.held and time.monotonic() < deadline:
                    time.sleep(0.02)
                report["held"] = lease.held
                report["lost"] = lease.lost
                report["lost_reason"] = lease.lost_reason
                report["verify"] = lease.verify()
                report["noticed_at"] = time.time()
        except errors.LockLostError as exc:
            report["raised"] = "LockLostError"
            report["raised_message"] = str(exc)
        report["on_lost_fired_at"] = lost_at
    except Exception as exc:
        report["error"] = _error(exc)
    finally:
        sem.close()
        write_json(out, report)


def probe_while_held(
    url: str, namespace: str, name: str, ready: str, stop: str, out: str, period: float = 0.25
) -> None:
    """Call ``try_acquire()`` every ``period`` s until ``stop`` appears (at most 60 s).

    Records ``[time.time(), got_a_slot, slot]`` per call; a slot obtained is released at once.
    """
    report: dict[str, Any] = {"pid": os.getpid(), "probes": []}
    sem = Semaphore(name, url=url, namespace=namespace)
    try:
        _connect(sem, name, namespace)
        touch(ready)
        deadline = time.monotonic() + 60
        while not os.path.exists(stop) and time.monotonic() < deadline:
            lease = sem.try_acquire()
            report["probes"].append([time.time(), lease is not None, lease and lease.slot])
            if lease is not None:
                lease.release()
            time.sleep(period)
    except Exception as exc:
        report["error"] = _error(exc)
    finally:
        sem.close()
        write_json(out, report)


def admin_churn(
    url: str, namespace: str, name: str, ops: int, go: Any, out: str, seed: int
) -> None:
    """Run ``ops`` random admin operations (ensure/resize/add/remove, counts 1..12).

    Logs ``[op, n, result, error_type]`` per operation; SemaphoreNotFoundError is an expected
    outcome (add/remove/resize while another admin shrank the semaphore to 0).
    """
    rng = random.Random(seed)
    report: dict[str, Any] = {"pid": os.getpid(), "log": [], "errors": []}
    admin = SemaphoreAdmin(name, url=url, namespace=namespace)
    try:
        admin.exists()
        if not go.wait(60):
            report["errors"].append({"type": "NoGo", "message": "go event never set"})
            return
        for _ in range(ops):
            op = rng.choice(["ensure", "resize", "add", "remove"])
            n = rng.randint(1, 12)
            try:
                result = getattr(admin, op)(n)
            except errors.SemaphoreNotFoundError:
                report["log"].append([op, n, None, "SemaphoreNotFoundError"])
            except Exception as exc:
                report["log"].append([op, n, None, type(exc).__name__])
                report["errors"].append(_error(exc))
            else:
                report["log"].append([op, n, result, None])
    except Exception as exc:
        report["errors"].append(_error(exc))
    finally:
        admin.close()
        write_json(out, report)


def wait_once(
    url: str,
    namespace: str,
    name: str,
    ready: str,
    out: str,
    hold_s: float = 0.05,
    acquire_timeout: float = 60.0,
) -> None:
    """Block in ``acquire`` once, hold ``hold_s`` seconds, release, report, exit."""
    report: dict[str, Any] = {"pid": os.getpid()}
    sem = Semaphore(name, url=url, namespace=namespace)
    try:
        _connect(sem, name, namespace)
        touch(ready)
        report["t_called"] = time.time()
        lease = sem.acquire(timeout=acquire_timeout)
        report["t_acquired"] = time.time()
        report["slot"] = lease.slot
        report["collisions"] = lease.collisions
        report["waits"] = getattr(lease, "waits", None)
        time.sleep(hold_s)
        report["held"] = lease.held
        report["t_release"] = time.time()
        lease.release()
    except Exception as exc:
        report["error"] = _error(exc)
    finally:
        sem.close()
        write_json(out, report)
