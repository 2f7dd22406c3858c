"""Worker functions run in child processes by ``tests/test_pressure_failures.py``.

As in ``tests/_workers.py``: started with the ``spawn`` context, they talk to the parent only
through files written atomically (``write_json``), so a worker killed with SIGKILL cannot
corrupt a pipe or a queue; a progress file holds the latest state the worker is sure of.
Every wait is bounded: a worker whose parent vanished exits on its own.

Items are ``item-<n>`` (n from 0), so the parent can check order, gaps and duplicates.
"""

from __future__ import annotations

import os
import time
from typing import Any

from _workers import _error, touch, write_json

from amqp_locks import PressureQueue, errors

__all__ = [
    "blocked_get",
    "blocked_put",
    "consume",
    "hold_in_receive",
    "hold_role",
    "item",
    "number",
    "produce",
    "touch",
    "write_json",
]


def item(n: int) -> bytes:
    return b"item-%d" % n


def number(data: bytes) -> int:
    assert data.startswith(b"item-"), data
    return int(data[5:])


def _queue(url: str, prefix: str, name: str, client_id: str | None = None) -> PressureQueue:
    q = PressureQueue(name, url=url, prefix=prefix, client_id=client_id)
    q.exists()  # connect now, before the parent is told we are ready
    return q


def produce(
    url: str,
    prefix: str,
    name: str,
    count: int,
    ready: str,
    progress: str,
    out: str,
    close: bool = False,
    client_id: str | None = None,
) -> None:
    """Hold the producer role and put ``item-0`` .. ``item-<count-1>`` flat out.

    Touches ``ready`` once it holds the role; after every put writes ``{"put": n}`` (n items
    put so far) to ``progress``. Closes the queue at the end if ``close``.
    """
    report: dict[str, Any] = {"pid": os.getpid(), "put": 0}
    q = _queue(url, prefix, name, client_id)
    try:
        with q.producing(timeout=30) as p:
            touch(ready)
            for n in range(count):
                p.put(item(n), timeout=60)
                report["put"] = n + 1
                write_json(progress, {"put": n + 1, "t": time.time()})
            if close:
                p.close()
                report["closed"] = True
    except Exception as exc:
        report["error"] = _error(exc)
    finally:
        q.disconnect()
        write_json(out, report)


def consume(
    url: str,
    prefix: str,
    name: str,
    ready: str,
    progress: str,
    out: str,
    receive: bool = True,
    client_id: str | None = None,
) -> None:
    """Hold the consumer role and take items until the queue is closed and drained.

    With ``receive``, each item is taken with ``receive()`` (acknowledged as the block ends),
    else with ``get()``. After each item writes ``{"got": [numbers so far]}`` to ``progress``:
    an item listed there was acknowledged, except possibly the last one (a receive block is
    reported from inside, just before it ends).
    """
    report: dict[str, Any] = {"pid": os.getpid(), "got": []}
    got: list[int] = report["got"]
    q = _queue(url, prefix, name, client_id)
    try:
        with q.consuming(timeout=30) as c:
            touch(ready)
            while True:
                try:
                    if receive:
                        with c.receive(timeout=60) as data:
                            got.append(number(data))
                            write_json(progress, {"got": got})
                    else:
                        got.append(number(c.get(timeout=60)))
                        write_json(progress, {"got": got})
                except errors.QueueClosedError:
                    report["closed"] = True
                    break
    except Exception as exc:
        report["error"] = _error(exc)
    finally:
        q.disconnect()
        write_json(out, report)


def hold_in_receive(
    url: str, prefix: str, name: str, holding: str, out: str, max_hold: float = 60.0
) -> None:
    """Receive one item and stay inside the ``receive`` block (to be SIGKILLed there).

    Writes ``{"item": <number>}`` to ``holding`` once it holds the item.
    """
    report: dict[str, Any] = {"pid": os.getpid()}
    q = _queue(url, prefix, name)
    try:
        with q.consuming(timeout=30) as c, c.receive(timeout=30) as data:
            write_json(holding, {"item": number(data), "pid": os.getpid()})
            time.sleep(max_hold)
            report["timed_out"] = True
    except Exception as exc:
        report["error"] = _error(exc)
    finally:
        q.disconnect()
        write_json(out, report)


def _blocked(
    call: str, url: str, prefix: str, name: str, ready: str, out: str, timeout: float
) -> None:
    report: dict[str, Any] = {"pid": os.getpid()}
    q = _queue(url, prefix, name, client_id=f"blocked-{call}")
    try:
        touch(ready)
        report["t_called"] = time.time()
        if call == "get":
            report["result"] = q.get(timeout=timeout).decode()
        else:
            q.put(b"blocked put", timeout=timeout)
            report["result"] = "put"
    except Exception as exc:
        report["raised"] = type(exc).__name__
        report["message"] = str(exc)
    report["t_returned"] = time.time()
    try:
        q.disconnect()
    finally:
        write_json(out, report)


def blocked_get(url: str, prefix: str, name: str, ready: str, out: str, timeout: float) -> None:
    """One ``get(timeout)``; reports its result or the error type, and when it returned."""
    _blocked("get", url, prefix, name, ready, out, timeout)


def blocked_put(url: str, prefix: str, name: str, ready: str, out: str, timeout: float) -> None:
    """One ``put(b"blocked put", timeout)``; reports as :func:`blocked_get`."""
    _blocked("put", url, prefix, name, ready, out, timeout)


def hold_role(
    url: str, prefix: str, name: str, role: str, ready: str, out: str, max_hold: float = 60.0
) -> None:
    """Take the ``role`` (producer: and put ``item-0``), touch ``ready``, and sit on it idle
    (to be SIGKILLed)."""
    report: dict[str, Any] = {"pid": os.getpid()}
    q = _queue(url, prefix, name, client_id=f"holder-{os.getpid()}")
    try:
        if role == "producer":
            with q.producing(timeout=30) as p:
                p.put(item(0))
                touch(ready)
                time.sleep(max_hold)
        else:
            with q.consuming(timeout=30):
                touch(ready)
                time.sleep(max_hold)
        report["timed_out"] = True
    except Exception as exc:
        report["error"] = _error(exc)
    finally:
        q.disconnect()
        write_json(out, report)
