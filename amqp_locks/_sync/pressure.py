"""The sync face of pressure queues: PressureQueue, and the Producing/Consuming role handles."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar, cast

from .. import _flows
from .. import _pressure as P
from .. import _pressure_common as C
from .._common import adopt_connection, holder_thread_id
from .._pressure_common import (
    Deadline,
    check_client_id,
    resolve_prefix,
    role_error,
    role_lost,
)
from ..errors import (
    AcquireTimeoutError,
    PressureError,
    QueueClosedError,
    QueueInUseError,
    SemaphoreNotFoundError,
)
from ._driver import _IO
from .connection import Connection
from .semaphore import Lease, Mutex

__all__ = ["Consuming", "PressureQueue", "Producing"]

log = logging.getLogger("amqp_locks")
T = TypeVar("T")


class _Role:
    """A held role: its lease, and the session its operations run on."""

    def __init__(self, queue: PressureQueue, role: str, lease: Lease) -> None:
        self.queue = queue
        self.role = role
        self.lease = lease
        self.io: _IO = lease._io
        self.done = False
        self.broken: str | None = None
        #: The role holder's protocol state (set by the handle).
        self.state: Callable[[], Any] = lambda: None
        # One operation at a time on a session: each commit carries the record the previous
        # one left, and pika allows one basic.get in flight per channel.
        self.lock = threading.Lock()

    def run(self, flow: P.Flow[T]) -> T:
        with self.lock:
            if self.broken is not None:
                raise role_lost(self.queue._names, self.role, self.broken)
            if self.done:
                raise RuntimeError(f"this {self.role} handle was released; take the role again")
            if not self.lease.held:
                raise role_lost(self.queue._names, self.role, self.lease.lost_reason)
            try:
                return self.queue._run(flow, io=self.io)
            except PressureError:
                raise  # the protocol's own verdict: the session is in a known state
            except BaseException as exc:
                # Interrupted, timed out or failed midway: what the broker did is unknown, so
                # the holder's state (records, deliveries in hand) can no longer be trusted.
                # Give the role up: the session's deliveries go back, and the next holder
                # starts from the broker's records.
                self.broken = f"an operation on it failed midway ({type(exc).__name__})"
                self._finish()
                raise

    def finish(self) -> None:
        with self.lock:
            self._finish()

    def _finish(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            if not self.io.dead:
                # Before the role goes: whatever the session holds goes back first.
                # (Read now: a put-back on a quorum queue replaces the session.)
                try:
                    self.queue._run(P.stop(self.state()), io=self.io, cancellable=False)
                except Exception:
                    # Paying an owed credit failed: the next consumer pays it; the sessions
                    # must close all the same, or their deliveries stay held.
                    self.queue._run(P.stop(self.state(), pay=False), io=self.io, cancellable=False)
        except Exception:
            log.debug("could not close the %s session cleanly", self.role, exc_info=True)
        finally:
            self.lease.release()


class _Held:
    """What both role handles share: the role, and giving it back."""

    _role: _Role

    @property
    def held(self) -> bool:
        """Whether the role is still held (False once released, lost, or given up)."""
        return not self._role.done and self._role.lease.held

    def release(self) -> None:
        """Give the role back (an item taken by an open ``receive`` goes back first).
        Idempotent."""
        self._role.finish()

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


_H = TypeVar("_H", bound=_Held)


class Producing(_Held):
    """The producer role of a pressure queue, held: from :meth:`PressureQueue.producing`.

    ::

        with q.producing(timeout=10) as p:
            for frame in frames:
                p.put(frame)          # one round trip per item while room is left
            p.close()                 # optional: no more items, ever

    While you hold it no other client anywhere puts, closes or kicks. It is given back when
    the ``with`` block ends (or by :meth:`release`), and by the broker at once if this process
    dies. If the role's lease is lost (connection died), every later call raises
    :class:`~amqp_locks.errors.LockLostError`.
    """

    def __init__(self, role: _Role, state: P.Producer) -> None:
        self._role = role
        self._state = state
        role.state = lambda: self._state

    def put(self, data: bytes, timeout: float | None = None) -> None:
        """Append ``data``; waits up to ``timeout`` s (None: forever) while the queue is full.

        Raises :class:`~amqp_locks.errors.OperationTimeoutError` if no room came in time
        (nothing was put), :class:`~amqp_locks.errors.QueueClosedError` after close.
        """
        self._role.run(C.put(self._state, data, timeout))

    def put_many(self, items: Iterable[bytes], timeout: float | None = None) -> None:
        """Append ``items`` in order, as many per transaction as there is room for.

        Much faster than one :meth:`put` per item (one round trip per batch). Waits up to
        ``timeout`` s in all while the queue is full; then
        :class:`~amqp_locks.errors.OperationTimeoutError`, whose ``done`` says how many of
        the items (the first ones) were put.
        """
        self._role.run(C.put_many(self._state, items, timeout))

    def put_nowait(self, data: bytes) -> None:
        """Append ``data`` now, or raise :class:`~amqp_locks.errors.QueueFullError`."""
        self._role.run(C.put_nowait(self._state, data))

    def close(self) -> None:
        """Close the queue: consumers drain what was put, then get QueueClosedError."""
        self._role.run(P.close(self._state))

    def kick(self, count: int = 1, timeout: float | None = None) -> int:
        """Move up to ``count`` dead-lettered items back to the tail; returns how many moved.

        Waits up to ``timeout`` s for room for each (bounded queues); stops early when the
        dead-letter queue is empty or no room came in time.
        """
        return self._role.run(C.kick(self._state, count, timeout))

    @property
    def bound(self) -> int:
        """The queue's bound (0: unbounded)."""
        return self._state.record.bound


class Consuming(_Held):
    """The consumer role of a pressure queue, held: from :meth:`PressureQueue.consuming`.

    ::

        with q.consuming() as c:
            for item in c:                   # until closed and drained
                handle(item)
            with c.receive(timeout=5) as item:
                handle(item)                 # acknowledged on a clean exit, put back on error

    Items come strictly in the order they were put. :meth:`get` removes an item before it
    returns it (at most once, even if this process dies right after); :meth:`receive` removes
    it only when the block succeeds (at least once: if the process dies inside the block, the
    next consumer gets the same item, first in line).
    """

    def __init__(self, role: _Role, state: P.Consumer, policy: P.Policy) -> None:
        self._role = role
        self._state = state
        role.state = lambda: self._state
        self._policy = policy

    def get(self, timeout: float | None = None) -> bytes:
        """Remove and return the oldest item, waiting up to ``timeout`` s for one.

        Raises :class:`~amqp_locks.errors.QueueClosedError` once the queue is closed and
        drained, :class:`~amqp_locks.errors.OperationTimeoutError` if nothing came in time.
        """
        return self._role.run(C.get(self._state, self._policy, timeout))

    def get_many(self, most: int, timeout: float | None = None) -> list[bytes]:
        """Up to ``most`` of the oldest items, removed together (one transaction).

        Waits up to ``timeout`` s for the first item, then takes only the items already there.
        Raises QueueClosedError once closed and drained, OperationTimeoutError if nothing
        came in time.
        """
        return self._role.run(C.get_many(self._state, self._policy, most, timeout))

    def get_nowait(self) -> bytes | None:
        """The oldest item, removed; None when the queue is empty (and still open)."""
        return self._role.run(C.get_nowait(self._state, self._policy))

    @contextlib.contextmanager
    def receive(self, timeout: float | None = None) -> Iterator[bytes]:
        """Take the oldest item; acknowledge it if the block succeeds, else put it back.

        Put back (an exception in the block, or this process dying) means first in line
        again, and one more delivery counted against the queue's ``delivery_limit``.
        """
        item = self._role.run(C.take(self._state, self._policy, timeout, "receive"))
        try:
            yield item.body
        except BaseException:
            with contextlib.suppress(Exception):
                self._role.run(P.settle(self._state, item, False))
            raise
        self._role.run(P.settle(self._state, item, True))

    def peek(self) -> bytes | None:
        """The oldest item, left in the queue (None when empty)."""
        return self._role.run(P.peek(self._state, self._policy))

    def __iter__(self) -> Iterator[bytes]:
        """Get items until the queue is closed and drained."""
        while True:
            try:
                yield self.get()
            except QueueClosedError:
                return


class PressureQueue:
    """A bounded, exclusive FIFO queue on RabbitMQ (the pressure protocol).

    ::

        q = PressureQueue("frames", url=url)
        q.create(bound=100)                 # once; QueueAlreadyExistsError if it exists
        q.put(b"frame-1")                   # blocks while full or while another producer works
        item = q.get(timeout=5)             # blocks while empty; QueueClosedError once drained
        with q.receive() as item: ...       # acknowledged only if the block succeeds
        q.close(); q.delete()

    Guarantees (see ``docs/pressure.md`` for the protocol and the failure cases):

    * Strict FIFO, one producer and one consumer at a time across every host. The roles are
      one-slot persistent semaphores: a holder that dies frees its role at once (on a network
      cut, within about two heartbeats) — no deadlock.
    * Never more than ``bound`` items on the broker, counting items being received.
    * A blocked ``put`` wakes when a consumer frees room, a blocked ``get`` when an item
      arrives: the broker pushes both, nobody polls.
    * ``stats()`` are exact: each counter changes in the same transaction as its item.

    Each call that needs a role takes it and gives it back; hold it across many calls with
    :meth:`producing` / :meth:`consuming` (much faster). Thread-safe; threads may share one
    queue object and its connection.
    """

    def __init__(
        self,
        name: str,
        url: str | None = None,
        *,
        prefix: str | None = None,
        client_id: str | None = None,
        connection: Connection | None = None,
        heartbeat: int = 10,
        connect_timeout: float = 5.0,
    ) -> None:
        self._prefix = resolve_prefix(prefix)
        self._names = P.PressureNames.of(name, self._prefix)
        self._client_id = check_client_id(client_id)
        self._policy = P.Policy()
        self.connection, self._owns_connection = adopt_connection(
            connection,
            url,
            Connection,
            lambda: Connection(url, heartbeat=heartbeat, connect_timeout=connect_timeout),
        )
        self._roles = {
            role: Mutex(self._names.role(role).base, connection=self.connection)
            for role in ("producer", "consumer")
        }

    @property
    def name(self) -> str:
        return self._names.name

    @property
    def prefix(self) -> str:
        """The prefix in use: the argument, else ``$PRESSURE_PREFIX``, else ``__pressure__``."""
        return self._prefix

    @property
    def base(self) -> str:
        """The prefixed name: the data queue's name, and the stem of every other queue."""
        return self._names.base

    def _holder(self) -> str:
        """The id recorded for a role holder: ``client_id``, else ``host:pid:thread``."""
        if self._client_id is not None:
            return self._client_id
        return holder_thread_id(self.connection.client_id)

    def _run(self, flow: P.Flow[T], io: _IO | None = None, *, cancellable: bool = True) -> T:
        result, _ = self.connection._run(cast(_flows.Flow[T], flow), io=io, cancellable=cancellable)
        return result

    # -- state, no role needed --------------------------------------------------------------------

    def create(
        self, bound: int = 0, *, replicated: bool = False, delivery_limit: int | None = None
    ) -> None:
        """Create the queue: at most ``bound`` items (0: unbounded).

        ``replicated=True`` keeps items on quorum queues (replicated across the cluster).
        ``delivery_limit=n``: an item delivered n times without being acknowledged (its
        consumers died or raised in ``receive``) goes to the dead-letter queue on its next
        delivery (see :meth:`kick`). Raises QueueAlreadyExistsError if the queue exists.
        """
        self._run(
            C.create(self._names, self._policy, self._holder(), bound, replicated, delivery_limit)
        )

    def exists(self) -> bool:
        return self._run(P.exists(self._names))

    def length(self) -> int:
        """Items waiting (not those being received); QueueDoesNotExistError if missing."""
        return self._run(P.length(self._names, self._policy))

    def closed(self) -> bool:
        return self._run(P.closed(self._names, self._policy))

    def stats(self) -> dict[str, int]:
        """``produced_messages``, ``produced_bytes``, ``consumed_messages``, ``consumed_bytes``."""
        return self._run(C.read_stats(self._names, self._policy))

    def producer_id(self) -> str | None:
        """Who holds the producer role, or last held it (None if nobody ever did)."""
        return self._run(P.records(self._names, self._policy))[0].id

    def consumer_id(self) -> str | None:
        return self._run(P.records(self._names, self._policy))[1].id

    def bound(self) -> int:
        return self._run(P.records(self._names, self._policy))[0].bound

    def dead_length(self) -> int:
        """Items in the dead-letter queue (moved there by the delivery limit)."""
        return self._run(P.dead_length(self._names))

    def delete(self, timeout: float | None = None) -> None:
        """Delete the queue and everything in it.

        Blocked producers and consumers wake with QueueDoesNotExistError at once; holders of
        the roles are waited for (up to ``timeout`` s, then OperationTimeoutError, with the
        items already gone: call delete() again to finish).
        """
        deadline = Deadline(timeout)
        holder = self._holder()
        self._run(P.delete_begin(self._names, holder, self._policy))
        leases: list[Lease] = []
        finished = False
        try:
            for role, mutex in self._roles.items():
                try:
                    leases.append(mutex.acquire(timeout=deadline.left()))
                except SemaphoreNotFoundError:
                    continue
                except AcquireTimeoutError as exc:
                    raise role_error(self._names, role, "delete", exc) from None
            self._run(P.delete_end(self._names, holder, self._policy))
            finished = True
        finally:
            for lease in leases:
                lease.release()
            if not finished:
                with contextlib.suppress(Exception):
                    self._run(P.unlock(self._names))

    # -- roles ----------------------------------------------------------------------------------

    def _take_role(self, role: str, timeout: float | None, what: str, blocking: bool) -> Lease:
        mutex = self._roles[role]
        try:
            lease = mutex.acquire(timeout=timeout) if blocking else mutex.try_acquire()
        except (SemaphoreNotFoundError, AcquireTimeoutError) as exc:
            raise role_error(self._names, role, what, exc) from None
        if lease is None:
            records = self._run(P.records(self._names, self._policy))
            holder = records[0].id if role == "producer" else records[1].id
            raise QueueInUseError(self._names.name, role, holder)
        return lease

    def _producing(self, timeout: float | None, what: str, blocking: bool = True) -> Producing:
        lease = self._take_role("producer", timeout, what, blocking)
        role = _Role(self, "producer", lease)
        try:
            state = self._run(P.start_producer(self._names, self._holder(), self._policy), role.io)
        except BaseException:
            lease.release()
            raise
        return Producing(role, state)

    def _consuming(self, timeout: float | None, what: str, blocking: bool = True) -> Consuming:
        lease = self._take_role("consumer", timeout, what, blocking)
        role = _Role(self, "consumer", lease)
        try:
            state = self._run(P.start_consumer(self._names, self._holder(), self._policy), role.io)
        except BaseException:
            lease.release()
            raise
        return Consuming(role, state, self._policy)

    def producing(self, timeout: float | None = None) -> Producing:
        """Take the producer role (waiting up to ``timeout`` s) and keep it until released."""
        return self._producing(Deadline(timeout).timeout, "producing")

    def consuming(self, timeout: float | None = None) -> Consuming:
        """Take the consumer role (waiting up to ``timeout`` s) and keep it until released."""
        return self._consuming(Deadline(timeout).timeout, "consuming")

    # -- one-shot operations (each takes and gives back a role) -----------------------------------

    def put(self, data: bytes, timeout: float | None = None) -> None:
        """Append ``data``, waiting up to ``timeout`` s in all for the role and for room."""
        P.check_data(data)
        deadline = Deadline(timeout)
        with deadline.overall(), self._producing(deadline.left(), "put") as p:
            p.put(data, deadline.left())

    def put_many(self, items: Iterable[bytes], timeout: float | None = None) -> None:
        """As :meth:`Producing.put_many`, taking the producer role for the batch."""
        bodies = [P.check_data(item) for item in items]
        deadline = Deadline(timeout)
        with deadline.overall(), self._producing(deadline.left(), "put_many") as p:
            p.put_many(bodies, deadline.left())

    def get_many(self, most: int, timeout: float | None = None) -> list[bytes]:
        """As :meth:`Consuming.get_many`, taking the consumer role for the batch."""
        deadline = Deadline(timeout)
        with deadline.overall(), self._consuming(deadline.left(), "get_many") as c:
            return c.get_many(most, deadline.left())

    def put_nowait(self, data: bytes) -> None:
        """Append now; QueueInUseError, QueueFullError or QueueClosedError otherwise."""
        P.check_data(data)
        with self._producing(None, "put_nowait", blocking=False) as p:
            p.put_nowait(data)

    def get(self, timeout: float | None = None) -> bytes:
        """Remove and return the oldest item, waiting up to ``timeout`` s in all."""
        deadline = Deadline(timeout)
        with deadline.overall(), self._consuming(deadline.left(), "get") as c:
            return c.get(deadline.left())

    def get_nowait(self) -> bytes | None:
        """The oldest item now; None if empty and open; QueueInUseError if a consumer works."""
        with self._consuming(None, "get_nowait", blocking=False) as c:
            return c.get_nowait()

    @contextlib.contextmanager
    def receive(self, timeout: float | None = None) -> Iterator[bytes]:
        """As :meth:`Consuming.receive`, taking the consumer role for the block."""
        deadline = Deadline(timeout)
        with self._consuming(deadline.left(), "receive") as c, c.receive(deadline.left()) as item:
            yield item

    def peek(self, timeout: float | None = None) -> bytes | None:
        """The oldest item, left in place; None when empty. Takes the consumer role briefly."""
        with self._consuming(Deadline(timeout).timeout, "peek") as c:
            return c.peek()

    def close(self, timeout: float | None = None) -> None:
        """Close the queue (once; again raises QueueClosedError). Takes the producer role."""
        with self._producing(Deadline(timeout).timeout, "close") as p:
            p.close()

    def kick(self, count: int = 1, timeout: float | None = None) -> int:
        """Move up to ``count`` dead-lettered items back to the tail; returns how many."""
        n = P.check_count(count, "count")
        deadline = Deadline(timeout)
        with deadline.overall(), self._producing(deadline.left(), "kick") as p:
            return p.kick(n, deadline.left())

    def __iter__(self) -> Iterator[bytes]:
        """Hold the consumer role and get items until the queue is closed and drained."""
        with self.consuming() as c:
            yield from c

    # -- lifecycle -------------------------------------------------------------------------------

    def disconnect(self) -> None:
        """Close the connection if this queue opened it (roles held over it are freed)."""
        if self._owns_connection:
            self.connection.close()

    def __enter__(self) -> PressureQueue:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.disconnect()

    def __repr__(self) -> str:
        return f"<PressureQueue {self._names.base!r}>"
