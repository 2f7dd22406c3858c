"""The asyncio face's connection."""

from __future__ import annotations

import asyncio
import os
from types import TracebackType
from typing import TypeVar

from .. import _flows
from .._config import ConnectionSettings
from ..errors import ClosedError
from ._driver import _AIO

__all__ = ["Connection"]

T = TypeVar("T")


class Connection:
    """One aio-pika connection, shared by semaphores, admins and tasks.

    The asyncio twin of :class:`amqp_locks.Connection`, with the same guarantees: leases held
    by different tasks over one connection stay exclusive; every connection loss marks every
    lease held over it lost (never a silent reconnect); the connection opens lazily within
    ``connect_timeout`` seconds or raises
    :class:`~amqp_locks.errors.BrokerUnavailableError`. Heartbeats are sent by a task: an event
    loop blocked for longer than about two heartbeats loses its leases.

    ::

        async with Connection(url) as conn:
            sem = Semaphore("jobs", connection=conn)
            async with sem.acquire(timeout=5) as lease:
                ...
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
        self._io: _AIO | None = None
        self._lock: asyncio.Lock | None = None
        self._pid = os.getpid()
        self._closed = False

    @property
    def client_id(self) -> str:
        return self.settings.client_id

    @property
    def closed(self) -> bool:
        return self._closed

    async def _live(self) -> _AIO:
        if self._closed:
            raise ClosedError("this Connection was closed; create a new one")
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._pid != os.getpid():
                self._io, self._pid = None, os.getpid()
            if self._io is None or self._io.dead:
                io = _AIO(self.settings)
                await io.start()
                self._io = io
            return self._io

    async def _run(self, flow: _flows.Flow[T], *, io: _AIO | None = None) -> tuple[T, _AIO]:
        io = io or await self._live()
        return await io.run(flow), io

    async def close(self) -> None:
        """Close the connection: every slot held over it is freed. Idempotent."""
        self._closed = True
        io, self._io = self._io, None
        if io is not None and self._pid == os.getpid():
            await io.close()

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<aio.Connection {self.settings.url_for_humans} {self.client_id!r} {state}>"
