"""The asyncio face of the semaphore: Semaphore, Mutex and Lease."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Generator
from types import TracebackType
from typing import Any

from .. import _flows
from .._common import LeaseFacts, LeaseState, SemaphorePlan, adopt_connection, make_policy
from ._driver import _AIO
from .admin import SemaphoreAdmin
from .connection import Connection

__all__ = ["Lease", "Mutex", "Semaphore"]

log = logging.getLogger("amqp_locks")


def holder_task_id(client_id: str) -> str:
    task = asyncio.current_task()
    return f"{client_id}:{task.get_name() if task else 'loop'}"


class Lease(LeaseFacts):
    """One held slot; the asyncio twin of :class:`amqp_locks.Lease`, with the same guarantees.

    ::

        async with sem.acquire(timeout=5) as lease:
            await work(lease.slot)
        # LockLostError here if the lease was lost inside the block

    ``on_lost`` callbacks run in the event loop's thread; keep them short and non-blocking.
    """

    def __init__(self, state: LeaseState[Lease], io: _AIO, connection: Connection) -> None:
        self._state = state
        self._io = io
        self._connection = connection
        state.owner = self

    async def verify(self) -> bool:
        """Ask the broker whether the slot is still ours; as the sync ``Lease.verify``."""
        if not self._state.held:
            return False
        try:
            (ok,), _ = await self._connection._run(
                _flows.verify(self._state.plan.names, [self.slot]), io=self._io
            )
        except Exception:
            if self._io.dead:
                return False  # the connection loss marked the lease lost
            raise
        if not ok:
            self._state.mark_lost("its slot or holder queue is gone", still_ours=True)
        return bool(ok) and self._state.held

    async def release(self) -> None:
        """Free the slot and wake one waiter. Idempotent; safe under cancellation.

        A lease lost while its connection lived (its slot was removed) still deletes its
        holder queue here, as in the sync API.
        """
        state = self._state
        if not state.mark_released() and not state.take_cleanup():
            return
        self._io.untrack(state)
        if self._io.dead:
            return
        flow = _flows.release(state.plan.names, self.slot)
        # Shielded: a release interrupted by cancellation would leave the slot held by a live
        # connection until it closes.
        task = asyncio.ensure_future(self._connection._run(flow, io=self._io))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("could not release %s cleanly", state.describe(), exc_info=True)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lost = self.lost
        await self.release()
        if lost and exc_type is None:
            raise self._state.lost_error()

    def __repr__(self) -> str:
        return f"<aio.Lease {self._state.describe()}>"


class _Acquiring:
    """What ``Semaphore.acquire()`` returns: ``await`` it, or ``async with`` it."""

    def __init__(self, semaphore: Semaphore, timeout: float | None, on_lost: Any) -> None:
        self._semaphore = semaphore
        self._timeout = timeout
        self._on_lost = on_lost
        self._lease: Lease | None = None

    def __await__(self) -> Generator[Any, None, Lease]:
        return self._semaphore._acquire_blocking(self._timeout, self._on_lost).__await__()

    async def __aenter__(self) -> Lease:
        self._lease = await self._semaphore._acquire_blocking(self._timeout, self._on_lost)
        return self._lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._lease is not None
        await self._lease.__aexit__(exc_type, exc, tb)


class Semaphore:
    """A persistent semaphore on RabbitMQ; the asyncio twin of :class:`amqp_locks.Semaphore`.

    ::

        sem = Semaphore("reports", url=url)
        async with sem.acquire(timeout=30) as lease:
            await render(lease.slot)
        lease = await sem.acquire(timeout=30); ...; await lease.release()
        lease = await sem.try_acquire()          # Lease or None, never waits for a slot
        async with sem as lease: ...             # acquire(timeout=None)
        await sem.close()

    Same guarantees and errors as the sync class. Cancelling an acquire leaves nothing held on
    the broker. Tasks may share one ``Semaphore``.

    Prefer ``acquire(timeout=…)`` to ``asyncio.wait_for(sem.acquire(), …)``: before Python
    3.12, ``wait_for`` can drop a result that arrives as its timeout fires, and a lease
    nobody holds a reference to stays held until its connection closes.
    """

    def __init__(
        self,
        name: str,
        url: str | None = None,
        *,
        namespace: str | None = None,
        connection: Connection | None = None,
        heartbeat: int = 10,
        connect_timeout: float = 5.0,
        client_id: str | None = None,
        poll_interval: float = 1.0,
        max_collisions: int = 64,
    ) -> None:
        self._plan = SemaphorePlan(
            name,
            namespace,
            make_policy(poll_interval=poll_interval, max_collisions=max_collisions),
        )
        self.connection, self._owns_connection = adopt_connection(
            connection,
            url,
            Connection,
            lambda: Connection(
                url, heartbeat=heartbeat, connect_timeout=connect_timeout, client_id=client_id
            ),
        )
        self._entered: contextvars.ContextVar[tuple[Lease, ...]] = contextvars.ContextVar(
            f"amqp_locks.aio.entered.{id(self)}", default=()
        )

    @property
    def name(self) -> str:
        return self._plan.name

    def acquire(
        self, timeout: float | None = None, *, on_lost: Callable[[Lease], Any] | None = None
    ) -> _Acquiring:
        """Wait for a free slot and take it: ``await`` it or use it with ``async with``."""
        self._plan.acquire("", blocking=True, timeout=timeout).close()  # validate eagerly
        return _Acquiring(self, timeout, on_lost)

    async def try_acquire(self, *, on_lost: Callable[[Lease], Any] | None = None) -> Lease | None:
        """Take a free slot if there is one now; None if all are held."""
        return await self._acquire(blocking=False, timeout=None, on_lost=on_lost)

    async def _acquire_blocking(self, timeout: float | None, on_lost: Any) -> Lease:
        lease = await self._acquire(blocking=True, timeout=timeout, on_lost=on_lost)
        assert lease is not None
        return lease

    async def _acquire(
        self,
        *,
        blocking: bool,
        timeout: float | None,
        on_lost: Callable[[Lease], Any] | None,
    ) -> Lease | None:
        holder_id = holder_task_id(self.connection.client_id)
        flow = self._plan.acquire(holder_id, blocking=blocking, timeout=timeout)
        outcome, io = await self.connection._run(flow)
        self._plan.acquired(outcome)
        if outcome.slot is None:
            return None
        state: LeaseState[Lease] = LeaseState(self._plan, outcome.slot, holder_id, outcome, on_lost)
        lease = Lease(state, io, self.connection)
        io.track(state)
        log.debug("acquired %s as %s", state.describe(), holder_id)
        return lease

    async def __aenter__(self) -> Lease:
        lease = await self._acquire_blocking(None, None)
        self._entered.set((*self._entered.get(), lease))
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        *rest, lease = self._entered.get()
        self._entered.set(tuple(rest))
        await lease.__aexit__(exc_type, exc, tb)

    async def close(self) -> None:
        """Close the connection if this object opened it (freeing its leases)."""
        if self._owns_connection:
            await self.connection.close()

    def __repr__(self) -> str:
        return f"<aio.{type(self).__name__} {self.name!r}>"


class Mutex(Semaphore):
    """A one-slot semaphore; the asyncio twin of :class:`amqp_locks.Mutex`.

    ::

        await Mutex("nightly-job", url=url).ensure()
        async with Mutex("nightly-job", url=url) as lease:
            await run_nightly_job()
    """

    def _admin(self) -> SemaphoreAdmin:
        return SemaphoreAdmin(self.name, connection=self.connection)

    async def create(self) -> None:
        await self._admin().create(1)

    async def ensure(self) -> None:
        await self._admin().ensure(1)

    async def destroy(self) -> None:
        await self._admin().destroy()
