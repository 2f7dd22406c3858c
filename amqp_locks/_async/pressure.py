"""The asyncio face of pressure queues: PressureQueue, and the Producing/Consuming role handles.

The twin of :mod:`amqp_locks._sync.pressure`: the same classes, methods and guarantees, with
every call that talks to the broker awaitable. The logic lives in :mod:`amqp_locks._pressure`
(the flows) and :mod:`amqp_locks._pressure_common`; this module only drives them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterable
from types import TracebackType
from typing import Any, Generic, TypeVar, cast

from .. import _flows
from .. import _pressure as P
from .. import _pressure_common as C
from .._common import adopt_connection
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
from ._driver import _AIO
from .connection import Connection
from .semaphore import Lease, Mutex, holder_task_id

__all__ = ["Consuming", "PressureQueue", "Producing"]

log = logging.getLogger("amqp_locks")
T = TypeVar("T")
H = TypeVar("H", "Producing", "Consuming")

# Cleanups that must outlive a cancelled caller; referenced until they end.
_background: set[asyncio.Future[Any]] = set()


def _shielded(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """``coro`` as a task that a cancellation of its awaiter does not stop."""
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return asyncio.shield(task)


class _Role:
    """A held role: its lease, and the session its operations run on."""

    def __init__(self, queue: PressureQueue, role: str, lease: Lease) -> None:
        self.queue = queue
        self.role = role
        self.lease = lease
        self.io: _AIO = lease._io
        self.done = False
        self.broken: str | None = None
        #: The role holder's protocol state (set by the handle).
        self.state: Callable[[], Any] = lambda: None
        # One operation at a time: a role's flows update its records in turn.
        self.lock = asyncio.Lock()

    async def run(self, flow: P.Flow[T]) -> T:
        async with self.lock:
            if self.broken is not None:
                raise role_lost(self.queue._names, self.role, self.broken)
            if self.done:
                raise RuntimeError(f"this {self.role} handle was released; take the role again")
            if not self.lease.held:
                raise role_lost(self.queue._names, self.role, self.lease.lost_reason)
            try:
                return await self.queue._run(flow, io=self.io)
            except PressureError:
                raise  # the protocol's own verdict: the session is in a known state
            except asyncio.CancelledError:
                # The driver lets an RPC in flight finish and hands its result to the flow
                # before raising, so the holder's state is still right; only deliveries in
                # hand had to go back, which closes their session.
                if any(getattr(s, "closed", False) for s in self._sessions()):
                    self._break("an operation on it was cancelled with an item in hand")
                raise
            except BaseException as exc:
                # Timed out or failed midway: what the broker did is unknown, so the holder's
                # state (records, deliveries in hand) can no longer be trusted.
                self._break(f"an operation on it failed midway ({type(exc).__name__})")
                raise

    def _sessions(self) -> tuple[Any, ...]:
        state = self.state()
        return tuple(state.sessions) if state is not None else ()

    def _break(self, reason: str) -> None:
        """Give the role up (in the background, whatever cancels us): the sessions'
        deliveries go back, and the next holder starts from the broker's records."""
        self.broken = reason
        _shielded(self._finish_unlocked())

    async def finish(self) -> None:
        """Close the sessions, then give the role back."""
        if self.done:
            return
        # Shielded: a release cut off by cancellation would keep the role (and whatever the
        # session holds) until the connection closes.
        await _shielded(self._finish())

    async def _finish(self) -> None:
        async with self.lock:
            await self._finish_unlocked()

    async def _finish_unlocked(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            if not self.io.dead:
                # Before the role goes: whatever the session holds goes back first.
                # (Read now: a put-back on a quorum queue replaces the session.)
                try:
                    await self.queue._run(P.stop(self.state()), io=self.io)
                except Exception:
                    # Paying an owed credit failed: the next consumer pays it; the sessions
                    # must close all the same, or their deliveries stay held.
                    await self.queue._run(P.stop(self.state(), pay=False), io=self.io)
        except Exception:
            log.debug("could not close the %s session cleanly", self.role, exc_info=True)
        finally:
            await self.lease.release()


class _Taking(Generic[H]):
    """What ``producing()``/``consuming()`` return: ``await`` it, or ``async with`` it."""

    def __init__(self, take: Callable[[], Coroutine[Any, Any, H]]) -> None:
        self._take: Callable[[], Coroutine[Any, Any, H]] = take
        self._handle: H | None = None

    def __await__(self) -> Generator[Any, None, H]:
        return self._take().__await__()

    async def __aenter__(self) -> H:
        self._handle = await self._take()
        return self._handle

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._handle is not None
        await self._handle.release()


class _Held:
    """What both role handles share: the role, and giving it back."""

    _role: _Role

    @property
    def held(self) -> bool:
        """Whether the role is still held (False once released, lost, or given up)."""
        return not self._role.done and self._role.lease.held

    async def release(self) -> None:
        """Give the role back (an item taken by an open ``receive`` goes back first).
        Idempotent; safe under cancellation."""
        await self._role.finish()

    async def __aenter__(self: _H) -> _H:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()


_H = TypeVar("_H", bound=_Held)


class Producing(_Held):
    """The producer role of a pressure queue, held: from :meth:`PressureQueue.producing`.

    ::

        async with q.producing(timeout=10) as p:
            for frame in frames:
                await p.put(frame)    # one round trip per item while room is left
            await p.close()           # optional: no more items, ever

    While you hold it no other client anywhere puts, closes or kicks. It is given back when
    the ``async with`` block ends (or by :meth:`release`), and by the broker at once if this
    process dies. If the role's lease is lost (connection died), every later call raises
    :class:`~amqp_locks.errors.LockLostError`. Tasks may share it: its calls run one at a time.
    """

    def __init__(self, role: _Role, state: P.Producer) -> None:
        self._role = role
        self._state = state
        role.state = lambda: self._state

    async def put(self, data: bytes, timeout: float | None = None) -> None:
        """Append ``data``; waits up to ``timeout`` s (None: forever) while the queue is full.

        Raises :class:`~amqp_locks.errors.OperationTimeoutError` if no room came in time
        (nothing was put), :class:`~amqp_locks.errors.QueueClosedError` after close.
        """
        await self._role.run(C.put(self._state, data, timeout))

    async def put_many(self, items: Iterable[bytes], timeout: float | None = None) -> None:
        """Append ``items`` in order, as many per transaction as there is room for; on
        timeout, OperationTimeoutError's ``done`` says how many (the first ones) were put."""
        await self._role.run(C.put_many(self._state, items, timeout))

    async def put_nowait(self, data: bytes) -> None:
        """Append ``data`` now, or raise :class:`~amqp_locks.errors.QueueFullError`."""
        await self._role.run(C.put_nowait(self._state, data))

    async def close(self) -> None:
        """Close the queue: consumers drain what was put, then get QueueClosedError."""
        await self._role.run(P.close(self._state))

    async def kick(self, count: int = 1, timeout: float | None = None) -> int:
        """Move up to ``count`` dead-lettered items back to the tail; returns how many moved.

        Waits up to ``timeout`` s for room for each (bounded queues); stops early when the
        dead-letter queue is empty or no room came in time.
        """
        return await self._role.run(C.kick(self._state, count, timeout))

    @property
    def bound(self) -> int:
        """The queue's bound (0: unbounded)."""
        return self._state.record.bound


class Consuming(_Held):
    """The consumer role of a pressure queue, held: from :meth:`PressureQueue.consuming`.

    ::

        async with q.consuming() as c:
            async for item in c:                     # until closed and drained
                await handle(item)
            async with c.receive(timeout=5) as item:
                await handle(item)                   # acknowledged on a clean exit, else put back

    Items come strictly in the order they were put. :meth:`get` removes an item before it
    returns it (at most once, even if this process dies right after, or the call is cancelled
    as it returns); :meth:`receive` removes it only when the block succeeds (at least once: if
    the process dies inside the block, the next consumer gets the same item, first in line).
    A cancelled wait leaves nothing taken.
    """

    def __init__(self, role: _Role, state: P.Consumer, policy: P.Policy) -> None:
        self._role = role
        self._state = state
        role.state = lambda: self._state
        self._policy = policy

    async def get(self, timeout: float | None = None) -> bytes:
        """Remove and return the oldest item, waiting up to ``timeout`` s for one.

        Raises :class:`~amqp_locks.errors.QueueClosedError` once the queue is closed and
        drained, :class:`~amqp_locks.errors.OperationTimeoutError` if nothing came in time.
        """
        return await self._role.run(C.get(self._state, self._policy, timeout))

    async def get_many(self, most: int, timeout: float | None = None) -> list[bytes]:
        """Up to ``most`` of the oldest items, removed together: waits up to ``timeout`` s for
        the first, then takes only what is there already."""
        return await self._role.run(C.get_many(self._state, self._policy, most, timeout))

    async def get_nowait(self) -> bytes | None:
        """The oldest item, removed; None when the queue is empty (and still open)."""
        return await self._role.run(C.get_nowait(self._state, self._policy))

    @contextlib.asynccontextmanager
    async def receive(self, timeout: float | None = None) -> AsyncIterator[bytes]:
        """Take the oldest item; acknowledge it if the block succeeds, else put it back.

        Put back (an exception or a cancellation in the block, or this process dying) means
        first in line again, and one more delivery counted against the queue's
        ``delivery_limit``.
        """
        item = await self._role.run(C.take(self._state, self._policy, timeout, "receive"))
        try:
            yield item.body
        except BaseException:
            with contextlib.suppress(Exception):
                await self._settle(item, False)
            raise
        await self._settle(item, True)

    async def _settle(self, item: P.Delivery, done: bool) -> None:
        # Shielded: an item neither acknowledged nor put back would stay with this session.
        await _shielded(self._role.run(P.settle(self._state, item, done)))

    async def peek(self) -> bytes | None:
        """The oldest item, left in the queue (None when empty)."""
        return await self._role.run(P.peek(self._state, self._policy))

    async def __aiter__(self) -> AsyncIterator[bytes]:
        """Get items until the queue is closed and drained."""
        while True:
            try:
                item = await self.get()
            except QueueClosedError:
                return
            yield item


class PressureQueue:
    """A bounded, exclusive FIFO queue on RabbitMQ; the asyncio twin of
    :class:`amqp_locks.PressureQueue`, with the same guarantees.

    ::

        async with PressureQueue("frames", url=url) as q:
            await q.create(bound=100)           # once; QueueAlreadyExistsError if it exists
            await q.put(b"frame-1")             # waits while full or while another producer works
            item = await q.get(timeout=5)       # waits while empty; QueueClosedError once drained
            async with q.receive() as item: ... # acknowledged only if the block succeeds
            async for item in q: ...            # until closed and drained
            await q.close(); await q.delete()

    Each call that needs a role takes it and gives it back; hold it across many calls with
    :meth:`producing` / :meth:`consuming` (much faster). Tasks may share one queue object and
    its connection. Cancelling a call leaves nothing taken or held on the broker; a put or get
    cancelled as its transaction commits still happens (the item is put, or gone).
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
        """The id recorded for a role holder: ``client_id``, else ``host:pid:task``."""
        if self._client_id is not None:
            return self._client_id
        return holder_task_id(self.connection.client_id)

    async def _run(self, flow: P.Flow[T], io: _AIO | None = None) -> T:
        result, _ = await self.connection._run(cast(_flows.Flow[T], flow), io=io)
        return result

    # -- state, no role needed --------------------------------------------------------------------

    async def create(
        self, bound: int = 0, *, replicated: bool = False, delivery_limit: int | None = None
    ) -> None:
        """Create the queue: at most ``bound`` items (0: unbounded).

        ``replicated=True`` keeps items on quorum queues (replicated across the cluster).
        ``delivery_limit=n``: an item delivered n times without being acknowledged (its
        consumers died or raised in ``receive``) goes to the dead-letter queue on its next
        delivery (see :meth:`kick`). Raises QueueAlreadyExistsError if the queue exists.
        """
        await self._run(
            C.create(self._names, self._policy, self._holder(), bound, replicated, delivery_limit)
        )

    async def exists(self) -> bool:
        return await self._run(P.exists(self._names))

    async def length(self) -> int:
        """Items waiting (not those being received); QueueDoesNotExistError if missing."""
        return await self._run(P.length(self._names, self._policy))

    async def closed(self) -> bool:
        return await self._run(P.closed(self._names, self._policy))

    async def stats(self) -> dict[str, int]:
        """``produced_messages``, ``produced_bytes``, ``consumed_messages``, ``consumed_bytes``."""
        return await self._run(C.read_stats(self._names, self._policy))

    async def producer_id(self) -> str | None:
        """Who holds the producer role, or last held it (None if nobody ever did)."""
        return (await self._run(P.records(self._names, self._policy)))[0].id

    async def consumer_id(self) -> str | None:
        return (await self._run(P.records(self._names, self._policy)))[1].id

    async def bound(self) -> int:
        return (await self._run(P.records(self._names, self._policy)))[0].bound

    async def dead_length(self) -> int:
        """Items in the dead-letter queue (moved there by the delivery limit)."""
        return await self._run(P.dead_length(self._names))

    async def delete(self, timeout: float | None = None) -> None:
        """Delete the queue and everything in it.

        Blocked producers and consumers wake with QueueDoesNotExistError at once; holders of
        the roles are waited for (up to ``timeout`` s, then OperationTimeoutError, with the
        items already gone: call delete() again to finish).
        """
        deadline = Deadline(timeout)
        holder = self._holder()
        await self._run(P.delete_begin(self._names, holder, self._policy))
        leases: list[Lease] = []
        finished = False
        try:
            for role, mutex in self._roles.items():
                try:
                    leases.append(await mutex.acquire(timeout=deadline.left()))
                except SemaphoreNotFoundError:
                    continue
                except AcquireTimeoutError as exc:
                    raise role_error(self._names, role, "delete", exc) from None
            await self._run(P.delete_end(self._names, holder, self._policy))
            finished = True
        finally:
            for lease in leases:
                await lease.release()
            if not finished:
                with contextlib.suppress(Exception):
                    await self._run(P.unlock(self._names))

    # -- roles ----------------------------------------------------------------------------------

    async def _take_role(
        self, role: str, timeout: float | None, what: str, blocking: bool
    ) -> Lease:
        mutex = self._roles[role]
        try:
            lease = await mutex.acquire(timeout=timeout) if blocking else await mutex.try_acquire()
        except (SemaphoreNotFoundError, AcquireTimeoutError) as exc:
            raise role_error(self._names, role, what, exc) from None
        if lease is None:
            records = await self._run(P.records(self._names, self._policy))
            holder = records[0].id if role == "producer" else records[1].id
            raise QueueInUseError(self._names.name, role, holder)
        return lease

    async def _producing(
        self, timeout: float | None, what: str, blocking: bool = True
    ) -> Producing:
        lease = await self._take_role("producer", timeout, what, blocking)
        role = _Role(self, "producer", lease)
        try:
            state = await self._run(
                P.start_producer(self._names, self._holder(), self._policy), role.io
            )
        except BaseException:
            await lease.release()
            raise
        return Producing(role, state)

    async def _consuming(
        self, timeout: float | None, what: str, blocking: bool = True
    ) -> Consuming:
        lease = await self._take_role("consumer", timeout, what, blocking)
        role = _Role(self, "consumer", lease)
        try:
            state = await self._run(
                P.start_consumer(self._names, self._holder(), self._policy), role.io
            )
        except BaseException:
            await lease.release()
            raise
        return Consuming(role, state, self._policy)

    def producing(self, timeout: float | None = None) -> _Taking[Producing]:
        """Take the producer role (waiting up to ``timeout`` s) and keep it until released:
        ``async with q.producing() as p``, or ``p = await q.producing()``."""
        wait = Deadline(timeout).timeout
        return _Taking(lambda: self._producing(wait, "producing"))

    def consuming(self, timeout: float | None = None) -> _Taking[Consuming]:
        """Take the consumer role (waiting up to ``timeout`` s) and keep it until released:
        ``async with q.consuming() as c``, or ``c = await q.consuming()``."""
        wait = Deadline(timeout).timeout
        return _Taking(lambda: self._consuming(wait, "consuming"))

    # -- one-shot operations (each takes and gives back a role) -----------------------------------

    async def put(self, data: bytes, timeout: float | None = None) -> None:
        """Append ``data``, waiting up to ``timeout`` s in all for the role and for room."""
        P.check_data(data)
        deadline = Deadline(timeout)
        with deadline.overall():
            async with await self._producing(deadline.left(), "put") as p:
                await p.put(data, deadline.left())

    async def put_many(self, items: Iterable[bytes], timeout: float | None = None) -> None:
        """As :meth:`Producing.put_many`, taking the producer role for the batch."""
        bodies = [P.check_data(item) for item in items]
        deadline = Deadline(timeout)
        with deadline.overall():
            async with await self._producing(deadline.left(), "put_many") as p:
                await p.put_many(bodies, deadline.left())

    async def get_many(self, most: int, timeout: float | None = None) -> list[bytes]:
        """As :meth:`Consuming.get_many`, taking the consumer role for the batch."""
        deadline = Deadline(timeout)
        with deadline.overall():
            async with await self._consuming(deadline.left(), "get_many") as c:
                return await c.get_many(most, deadline.left())

    async def put_nowait(self, data: bytes) -> None:
        """Append now; QueueInUseError, QueueFullError or QueueClosedError otherwise."""
        P.check_data(data)
        async with await self._producing(None, "put_nowait", blocking=False) as p:
            await p.put_nowait(data)

    async def get(self, timeout: float | None = None) -> bytes:
        """Remove and return the oldest item, waiting up to ``timeout`` s in all."""
        deadline = Deadline(timeout)
        with deadline.overall():
            async with await self._consuming(deadline.left(), "get") as c:
                return await c.get(deadline.left())

    async def get_nowait(self) -> bytes | None:
        """The oldest item now; None if empty and open; QueueInUseError if a consumer works."""
        async with await self._consuming(None, "get_nowait", blocking=False) as c:
            return await c.get_nowait()

    @contextlib.asynccontextmanager
    async def receive(self, timeout: float | None = None) -> AsyncIterator[bytes]:
        """As :meth:`Consuming.receive`, taking the consumer role for the block."""
        deadline = Deadline(timeout)
        async with (
            await self._consuming(deadline.left(), "receive") as c,
            c.receive(deadline.left()) as item,
        ):
            yield item

    async def peek(self, timeout: float | None = None) -> bytes | None:
        """The oldest item, left in place; None when empty. Takes the consumer role briefly."""
        async with await self._consuming(Deadline(timeout).timeout, "peek") as c:
            return await c.peek()

    async def close(self, timeout: float | None = None) -> None:
        """Close the queue (once; again raises QueueClosedError). Takes the producer role."""
        async with await self._producing(Deadline(timeout).timeout, "close") as p:
            await p.close()

    async def kick(self, count: int = 1, timeout: float | None = None) -> int:
        """Move up to ``count`` dead-lettered items back to the tail; returns how many."""
        n = P.check_count(count, "count")
        deadline = Deadline(timeout)
        with deadline.overall():
            async with await self._producing(deadline.left(), "kick") as p:
                return await p.kick(n, deadline.left())

    async def __aiter__(self) -> AsyncIterator[bytes]:
        """Hold the consumer role and get items until the queue is closed and drained."""
        async with await self._consuming(None, "iterate") as c:
            async for item in c:
                yield item

    # -- lifecycle -------------------------------------------------------------------------------

    async def disconnect(self) -> None:
        """Close the connection if this queue opened it (roles held over it are freed)."""
        if self._owns_connection:
            await self.connection.close()

    async def __aenter__(self) -> PressureQueue:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.disconnect()

    def __repr__(self) -> str:
        return f"<aio.PressureQueue {self._names.base!r}>"
