"""The sync face of the semaphore: Semaphore, Mutex and Lease."""

from __future__ import annotations

import contextvars
import logging
import os
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .. import _flows
from .._common import (
    LeaseFacts,
    LeaseState,
    SemaphorePlan,
    adopt_connection,
    holder_thread_id,
    make_policy,
)
from ._driver import _IO
from .admin import SemaphoreAdmin
from .connection import Connection

__all__ = ["Lease", "Mutex", "Semaphore"]

log = logging.getLogger("amqp_locks")


class Lease(LeaseFacts):
    """One held slot of a semaphore, returned by :meth:`Semaphore.acquire`.

    Use it as a context manager, or call :meth:`release`::

        with sem.acquire(timeout=5) as lease:
            use(lease.slot)            # 1..N
            do_work()
            if not lease.held: ...     # lost meanwhile (connection died, slot removed)

    Guarantees:

    * While ``held`` is True, no other lease anywhere holds this slot, and no more than N
      leases of the semaphore exist — as far as the broker can tell; see ``docs/semaphore.md``
      for what a network partition does to that.
    * A lease is never lost silently: when the connection dies or the slot is removed,
      ``held`` turns False, the ``on_lost`` callbacks run (in the I/O thread: keep them short)
      and leaving the ``with`` block raises :class:`~amqp_locks.errors.LockLostError` — unless
      another exception is already propagating, which then wins.
    * :meth:`release` is idempotent and never raises for a lost lease.

    Not re-entrant: acquiring again in the same thread takes a second slot (or blocks).
    """

    def __init__(self, state: LeaseState[Lease], io: _IO, connection: Connection) -> None:
        self._state = state
        self._io = io
        self._connection = connection
        state.owner = self

    def verify(self) -> bool:
        """Ask the broker whether the slot is still ours (one round trip).

        Returns False (and marks the lease lost) when the slot queue or our holder queue is
        gone or the connection died; False at once for a lease already released or lost.
        Raises :class:`~amqp_locks.errors.BrokerError` when the broker cannot answer while
        the connection lives (the lease is then neither confirmed nor given up).
        """
        if not self._state.held:
            return False
        try:
            (ok,), _ = self._connection._run(
                _flows.verify(self._state.plan.names, [self.slot]), io=self._io
            )
        except Exception:
            if self._io.dead:
                return False  # the connection loss marked the lease lost
            raise
        if not ok:
            self._state.mark_lost("its slot or holder queue is gone", still_ours=True)
        return bool(ok) and self._state.held

    def release(self) -> None:
        """Free the slot and wake one waiter. Idempotent; never raises for a lost lease.

        A lease lost while its connection lived (its slot was removed) still deletes its
        holder queue here: to the broker, and to ``wait_released``, the holder lets go now.
        """
        state = self._state
        if not state.mark_released() and not state.take_cleanup():
            return
        io = self._io
        if io.dead or io.pid != os.getpid():
            return  # freed with the connection; or the parent's, after a fork: not ours
        try:
            self._connection._run(
                _flows.release(state.plan.names, self.slot),
                io=io,
                before=lambda: io.leases.discard(state),
                cancellable=False,  # an interrupted release must still free the slot
            )
        except Exception:
            # The slot is freed with the connection anyway; nothing the caller can do.
            log.warning("could not release %s cleanly", state.describe(), exc_info=True)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lost = self.lost
        self.release()
        if lost and exc_type is None:
            raise self._state.lost_error()

    def __repr__(self) -> str:
        return f"<Lease {self._state.describe()}>"


class Semaphore:
    """A persistent semaphore on RabbitMQ: at most N holders at once, N kept on the broker.

    The slots are created by an administrator (:class:`SemaphoreAdmin` or ``amqp-locks``);
    clients only acquire and release::

        sem = Semaphore("reports", url="amqp://guest:guest@localhost/%2F")
        with sem.acquire(timeout=30) as lease:   # AcquireTimeoutError after 30 s
            render(lease.slot)
        lease = sem.try_acquire()                # a Lease, or None when all slots are held
        with sem as lease: ...                   # acquire(timeout=None)

    Guarantees: never two holders of a slot, never more holders than slots, for leases whose
    ``held`` is True (the broker's exclusive queues enforce it; see ``docs/semaphore.md``). A
    blocked ``acquire`` wakes when a slot is released (one token wakes one waiter, so no
    thundering herd) or, for holders that crashed, at the next jittered poll
    (``poll_interval``, default 1 s).

    Not fair: a ``try_acquire`` may take a slot before a long waiter. Not re-entrant.
    Thread-safe: threads may share one ``Semaphore`` (and its connection).

    Errors: :class:`~amqp_locks.errors.SemaphoreNotFoundError` when the semaphore has no
    slots, :class:`~amqp_locks.errors.AcquireTimeoutError` on timeout,
    :class:`~amqp_locks.errors.ContentionError` after ``max_collisions`` lost races in a row,
    :class:`~amqp_locks.errors.BrokerError` subclasses when the broker fails.
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
            f"amqp_locks.entered.{id(self)}", default=()
        )

    @property
    def name(self) -> str:
        """The semaphore's name, namespace included (the base of its queue names)."""
        return self._plan.name

    def acquire(
        self, timeout: float | None = None, *, on_lost: Callable[[Lease], Any] | None = None
    ) -> Lease:
        """Wait for a free slot and take it; ``timeout=None`` waits forever."""
        lease = self._acquire(blocking=True, timeout=timeout, on_lost=on_lost)
        assert lease is not None
        return lease

    def try_acquire(self, *, on_lost: Callable[[Lease], Any] | None = None) -> Lease | None:
        """Take a free slot if there is one now; None if all are held. Never waits for one."""
        return self._acquire(blocking=False, timeout=None, on_lost=on_lost)

    def _acquire(
        self,
        *,
        blocking: bool,
        timeout: float | None,
        on_lost: Callable[[Lease], Any] | None,
    ) -> Lease | None:
        holder_id = holder_thread_id(self.connection.client_id)
        flow = self._plan.acquire(holder_id, blocking=blocking, timeout=timeout)
        io = self.connection._live()

        def adopt(outcome: _flows.Acquired) -> Lease | None:
            # In the I/O thread, as the flow ends: from here on a connection loss marks the
            # new lease lost (and finds its owner, for on_lost): no gap to miss it in.
            self._plan.acquired(outcome)
            if outcome.slot is None:
                return None
            state: LeaseState[Lease] = LeaseState(
                self._plan, outcome.slot, holder_id, outcome, on_lost
            )
            lease = Lease(state, io, self.connection)
            io.track(state)
            return lease

        def give_back(lease: Lease | None) -> None:
            state = lease._state if lease is not None else None
            if state is not None and state.mark_released():
                io.submit(
                    _flows.release(self._plan.names, state.slot),
                    before=lambda: io.leases.discard(state),
                )

        lease, _ = self.connection._call(flow, io=io, on_orphan=give_back, after=adopt)
        if lease is not None and log.isEnabledFor(logging.DEBUG):
            log.debug("acquired %s as %s", lease._state.describe(), holder_id)
        return lease  # type: ignore[no-any-return]

    def __enter__(self) -> Lease:
        lease = self.acquire()
        self._entered.set((*self._entered.get(), lease))
        return lease

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        *rest, lease = self._entered.get()
        self._entered.set(tuple(rest))
        lease.__exit__(exc_type, exc, tb)

    def close(self) -> None:
        """Close the connection if this object opened it (freeing its leases). Idempotent."""
        if self._owns_connection:
            self.connection.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class Mutex(Semaphore):
    """A one-slot semaphore: mutual exclusion across processes and hosts.

    ::

        Mutex("nightly-job", url=url).ensure()         # once, from a deploy or admin script
        with Mutex("nightly-job", url=url) as lease:   # waits for the holder to finish
            run_nightly_job()

    Exactly the guarantees of :class:`Semaphore` with N = 1. The mutex must exist first
    (:meth:`create` or :meth:`ensure`); otherwise acquiring raises
    :class:`~amqp_locks.errors.SemaphoreNotFoundError`.
    """

    def _admin(self) -> SemaphoreAdmin:
        return SemaphoreAdmin(self.name, connection=self.connection)

    def create(self) -> None:
        """Create the mutex; SemaphoreExistsError if it exists."""
        self._admin().create(1)

    def ensure(self) -> None:
        """Create the mutex, or make an existing semaphore of that name one slot."""
        self._admin().ensure(1)

    def destroy(self) -> None:
        """Delete the mutex's slot queue; a holder keeps running until it lets go."""
        self._admin().destroy()
