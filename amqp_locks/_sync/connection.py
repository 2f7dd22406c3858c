"""The sync face's connection: shared by semaphores, admins and threads."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from .. import _flows
from .._config import ConnectionSettings
from ..errors import ClosedError
from ._driver import _IO

__all__ = ["Connection"]

T = TypeVar("T")


class Connection:
    """One connection to the broker, serviced by a background I/O thread.

    Many :class:`~amqp_locks.Semaphore`, :class:`~amqp_locks.SemaphoreAdmin` and
    :class:`~amqp_locks.Mutex` objects, and many threads, may share one ``Connection``; leases
    held over it stay exclusive among themselves (RabbitMQ would let one connection re-declare
    its own exclusive queue, so the connection keeps its own book of what it holds).

    Guarantees:

    * Heartbeats flow while your code runs, so a lease held for hours is not dropped by the
      broker as long as the process and the network are alive.
    * If the connection dies, every lease held over it is marked lost at once (``held`` turns
      False, ``on_lost`` callbacks fire). The next operation opens a new connection; the
      leases of the old one are never silently re-taken.
    * The connection is opened lazily, by the first operation, within ``connect_timeout``
      seconds or :class:`~amqp_locks.errors.BrokerUnavailableError`.
    * After ``os.fork()`` the child opens a connection of its own.

    Usage::

        with Connection("amqp://guest:guest@broker:5672/%2F", heartbeat=10) as conn:
            jobs = Semaphore("jobs", connection=conn)
            admin = SemaphoreAdmin("jobs", connection=conn)

    ``client_id`` (default ``host:pid``) names the connection on the broker
    (``amqp_locks host:pid``) and, with the thread name, each holder queue.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        heartbeat: int = 10,
        connect_timeout: float = 5.0,
        operation_timeout: float = 30.0,
        verify_interval: float | None = None,
        client_id: str | None = None,
    ) -> None:
        self.settings = ConnectionSettings.build(
            url,
            heartbeat=heartbeat,
            connect_timeout=connect_timeout,
            operation_timeout=operation_timeout,
            verify_interval=verify_interval,
            client_id=client_id,
        )
        self._lock = threading.Lock()
        self._io: _IO | None = None
        self._pid = os.getpid()
        self._closed = False

    @property
    def client_id(self) -> str:
        return self.settings.client_id

    @property
    def closed(self) -> bool:
        return self._closed

    def _live(self) -> _IO:
        with self._lock:
            if self._closed:
                raise ClosedError("this Connection was closed; create a new one")
            if self._pid != os.getpid():
                # Forked: the parent's socket and thread are not ours to use or to close.
                self._io, self._pid = None, os.getpid()
            if self._io is None or self._io.dead:
                io = _IO(self.settings)
                io.start()
                self._io = io
            return self._io

    def _run(
        self,
        flow: _flows.Flow[T],
        *,
        io: _IO | None = None,
        before: Callable[[], None] | None = None,
        cancellable: bool = True,
    ) -> tuple[T, _IO]:
        """Run a flow to completion in the I/O thread; return its result and the I/O used."""
        result, io = self._call(flow, io=io, before=before, cancellable=cancellable)
        return result, io

    def _call(
        self,
        flow: _flows.Flow[Any],
        *,
        io: _IO | None = None,
        on_orphan: Callable[[Any], Any] | None = None,
        before: Callable[[], None] | None = None,
        after: Callable[[Any], Any] | None = None,
        cancellable: bool = True,
    ) -> tuple[Any, _IO]:
        """As ``_run``, with ``before``/``after`` work in the I/O thread (``_IO.submit``)
        and ``on_orphan(result)`` for a result that arrives after the caller gave up."""
        io = io or self._live()
        if io.pid != os.getpid():
            raise ClosedError(
                "this lease or connection belongs to the parent process (before fork); "
                "the child must acquire its own"
            )
        if io.in_io_thread:
            # Waiting here would wait on ourselves: the I/O thread runs the flow.
            raise RuntimeError(
                "blocking amqp_locks calls cannot be made from an on_lost callback (it runs "
                "in the connection's I/O thread); hand the work to another thread"
            )
        future, cancel = io.submit(flow, before=before, after=after)
        try:
            return future.result(), io
        except BaseException:
            if not cancellable:
                raise  # e.g. a release: it finishes in the I/O thread all the same
            if future.done():
                if on_orphan is not None and not future.cancelled() and not future.exception():
                    on_orphan(future.result())  # done just as we were interrupted
            else:
                # Interrupted (KeyboardInterrupt, …): stop the flow, and give back whatever it
                # obtains if it finishes first.
                cancel()
                if on_orphan is not None:
                    orphan_handler = on_orphan

                    def orphaned(f: Any) -> None:
                        if not f.cancelled() and f.exception() is None:
                            orphan_handler(f.result())

                    future.add_done_callback(orphaned)
            raise

    def close(self) -> None:
        """Close the connection: every slot held over it is freed. Idempotent."""
        with self._lock:
            self._closed = True
            io, self._io = self._io, None
        if io is not None and self._pid == os.getpid():
            io.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Connection {self.settings.url_for_humans} {self.client_id!r} {state}>"
