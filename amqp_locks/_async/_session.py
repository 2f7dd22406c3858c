"""The aio-pika side of pressure-queue operations (see :mod:`amqp_locks._pressure`).

The asyncio twin of :mod:`amqp_locks._sync._session`, with the same semantics. Role holders
work on a *session*: an aiormq channel of their own in transaction mode, where items and
credits are taken (``basic.get``, or a consumer while waiting) and settled together with the
records in one ``tx.commit``. Reads that need no role (passive declares, record reads,
confirmed publishes at create) go on the driver's pooled confirm-mode channels.

Cancellation (the caller's ``asyncio.timeout``, ``wait_for``, task cancel) never leaves the
queue inconsistent nor the role handle broken:

* a session RPC in flight (a get, a consume or its cancel, a ``tx.commit``) is never cut off:
  aiormq would close the channel, and a commit cut off could leave the flow's records behind
  the broker's. It runs to its answer, the flow gets the result, and the run raises the
  cancellation before the flow's next operation. Only waits (for a delivery, a credit) stop
  at once;
* a run that ends in an error gives back (``basic.reject``, requeue) every delivery it took and
  did not settle, and closes the sessions it opened, so no item or credit stays stuck,
  unacknowledged, on a live channel.

aiormq quirks met here:

* A channel without publisher confirms never reports a ``basic.return`` to its
  ``on_return_callbacks`` (it matches returns to confirmations by message id, and logs an
  error instead). Sessions replace the channel's return handler to collect routing keys.
* aiormq gives every publish without a message id a random one.
* Consumer callbacks run as tasks, one per delivery, scheduled in order as the frames are read:
  they have run before any later frame's RPC answer (``get-empty``, ``cancel-ok``) reaches its
  caller, which the "delivered before the answer" rules below rely on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import aiormq
import aiormq.exceptions as amqp_errors
from pamqp import commands as spec

from .. import _pressure as P
from ..errors import BrokerError, BrokerTimeoutError, BrokerUnavailableError

if TYPE_CHECKING:
    from ._driver import _AIO

log = logging.getLogger("amqp_locks.aio")
T = TypeVar("T")

_PRESSURE_OPS = (
    P.Inspect,
    P.ReadAll,
    P.PublishConfirmed,
    P.OpenSession,
    P.CloseSession,
    P.Subscribe,
    P.Take,
    P.Commit,
)


class _Closed:
    """What a wait is woken with when its session channel closes."""


_CLOSED = _Closed()


def _is_not_found(reason: object) -> bool:
    return isinstance(reason, amqp_errors.ChannelNotFoundEntity)


def _delivery(message: Any) -> P.Delivery:
    properties = message.header.properties
    return P.Delivery(
        tag=message.delivery.delivery_tag,
        body=message.body,
        redelivered=bool(message.delivery.redelivered),
        kind=properties.message_type or P.ITEM,
        message_id=properties.message_id,
        headers=dict(properties.headers or {}),
    )


def _consumer_tag() -> str:
    return f"amqp_locks.pressure.{uuid.uuid4().hex}"


@contextlib.contextmanager
def _mapped(
    what: str, queue: str | None, seconds: float, *, not_found: bool = True
) -> Iterator[None]:
    """Translate aiormq's errors into ours at one boundary.

    ``not_found``: let a 404 pass, for a caller that knows what a missing queue means.
    """
    from ._driver import map_error

    try:
        yield
    except BrokerError:
        raise
    except amqp_errors.ChannelNotFoundEntity as exc:
        if not_found:
            raise
        raise map_error(exc, queue) from exc
    except asyncio.TimeoutError as exc:  # (TimeoutError itself on 3.11+, an OSError)
        raise BrokerTimeoutError(f"the broker did not answer {what} in {seconds:g} s") from exc
    except amqp_errors.ChannelInvalidStateError as exc:
        raise BrokerUnavailableError(f"the channel for {what} is closed: {exc}") from exc
    except Exception as exc:
        raise map_error(exc, queue) from exc


class _Session:
    """A transactional channel owned by one role holder."""

    def __init__(self, channel: aiormq.Channel) -> None:
        self.channel = channel
        self.closed = False
        self.close_reason: BaseException | None = None
        # One transaction at a time: a commit, or an aborted run giving deliveries back.
        self.lock = asyncio.Lock()
        self.returned: list[str] = []
        # The credit stream (Subscribe), and whoever waits for a credit.
        self.stream_tag: str | None = None
        self.stream_gone = False
        self.buffer: deque[P.Delivery] = deque()
        self.stream_waiter: asyncio.Future[P.Delivery | P.Gone | _Closed] | None = None
        # A one-delivery consumer serving a blocked Take, and its wake-up.
        self.once_tag: str | None = None
        self.once_waiter: asyncio.Future[None] | None = None
        # aiormq reports returns only on confirm channels (see the module docstring).
        channel._on_return_frame = self._on_return_frame  # type: ignore[method-assign]
        channel.on_consumer_cancel_callbacks.add(self._on_broker_cancel)
        channel.closing.add_done_callback(self._on_close)

    async def _on_return_frame(self, frame: spec.Basic.Return) -> None:
        # Read the returned message off the channel (header, then body frames), as aiormq's
        # own handler does, and remember where it went: Basic.Return precedes Tx.CommitOk.
        header = await self.channel._get_frame()
        await self.channel._read_content(frame, header)  # type: ignore[arg-type]
        self.returned.append(frame.routing_key or "")

    def _on_close(self, closing: asyncio.Future[Any]) -> None:
        self.closed = True
        if not closing.cancelled():
            self.close_reason = closing.exception()
        waiter, self.stream_waiter = self.stream_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(_CLOSED)
        once = self.once_waiter
        if once is not None and not once.done():
            once.set_result(None)

    def _on_broker_cancel(self, frame: spec.Basic.Cancel) -> None:
        # RabbitMQ cancels the consumers of a queue that is deleted.
        tag = frame.consumer_tag
        if tag is not None and tag == self.stream_tag:
            self.stream_tag = None
            self.stream_gone = True
            waiter, self.stream_waiter = self.stream_waiter, None
            if waiter is not None and not waiter.done():
                waiter.set_result(P.GONE)
        elif tag is not None and tag == self.once_tag:
            self.once_tag = None
            once = self.once_waiter
            if once is not None and not once.done():
                once.set_result(None)

    async def _on_credit(self, message: aiormq.abc.DeliveredMessage) -> None:
        # No await inside: aiormq runs it as a task that ends in its first step.
        delivery = _delivery(message)
        waiter, self.stream_waiter = self.stream_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(delivery)
        else:
            self.buffer.append(delivery)

    def check_open(self, what: str, *, gone_ok: bool) -> P.Gone | None:
        """GONE (for takes) if the channel was closed by a 404; raise if closed otherwise."""
        if not self.closed:
            return None
        if gone_ok and _is_not_found(self.close_reason):
            return P.GONE
        raise self.closed_error(what)

    def closed_error(self, what: str) -> BrokerError:
        reason = self.close_reason
        if isinstance(reason, Exception) and any(reason.args):
            why = f": {reason}"
        else:  # closed by us (role released) or with the connection
            why = " (the role was released, or the connection closed)"
        return BrokerUnavailableError(f"the session channel closed, stopping {what}{why}")

    async def close(self, seconds: float) -> None:
        """Close the channel; whatever it holds unacknowledged goes back to its queue."""
        if self.closed or self.channel.is_closed:
            self.closed = True
            return
        self.closed = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.channel.close(), seconds)


class RunState:
    """What one flow run did with sessions, for the driver to undo if the run is aborted."""

    def __init__(self) -> None:
        # Sessions opened by this run and not yet handed over (closed if it fails).
        self.sessions: list[_Session] = []
        # Deliveries this run took and has not acknowledged or rejected.
        self.taken: set[tuple[_Session, int]] = set()
        # Sessions whose deliveries in hand must go back by closing them (quorum queues).
        self.close_on_abort: set[_Session] = set()
        # A cancellation that arrived during a session RPC: raised once the flow has its result.
        self.deferred: BaseException | None = None

    @property
    def pending(self) -> bool:
        return bool(self.sessions or self.taken)

    def defer(self, cancelled: BaseException) -> None:
        if self.deferred is None:
            self.deferred = cancelled

    def check(self) -> None:
        """Raise the cancellation deferred by a session RPC, if any."""
        deferred, self.deferred = self.deferred, None
        if deferred is not None:
            raise deferred

    def took(self, session: _Session, result: object, close: bool = False) -> None:
        if isinstance(result, P.Delivery):
            self.taken.add((session, result.tag))
            if close:
                self.close_on_abort.add(session)


def handles(op: object) -> bool:
    return isinstance(op, _PRESSURE_OPS)


def _spawn(io: _AIO, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task the driver keeps a reference to until it ends."""
    task = asyncio.ensure_future(coro)
    io.spawn(task)
    return task


async def _uninterrupted(io: _AIO, state: RunState, coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` (session RPCs) to its end even if the caller is cancelled meanwhile.

    aiormq closes a channel whose RPC is cancelled (its answer could no longer be paired),
    which would leave the role handle with a dead session, and a commit cut off midway would
    leave the flow's records behind the broker's. So the RPC runs on; its result goes to the
    flow, and the run raises the cancellation before the flow's next operation (then gives
    back whatever the run took). A second cancellation is not deferred again.
    """
    task = _spawn(io, coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError as cancelled:
        state.defer(cancelled)
        try:
            return await task
        except Exception as exc:
            raise cancelled from exc


async def execute(io: _AIO, op: Any, slot: list[aiormq.Channel | None], state: RunState) -> Any:
    """Run one pressure operation for a flow (see :mod:`amqp_locks._pressure`)."""
    if isinstance(op, (P.Inspect, P.ReadAll, P.PublishConfirmed)):
        return await _pool_op(io, op, slot)
    seconds = io.settings.operation_timeout
    if isinstance(op, P.OpenSession):
        opened = await _open_session(io)
        state.sessions.append(opened)
        return opened
    if isinstance(op, P.CloseSession):
        closing: _Session = op.session
        if closing in state.sessions:
            state.sessions.remove(closing)
        state.taken = {entry for entry in state.taken if entry[0] is not closing}
        await asyncio.shield(_spawn(io, closing.close(seconds)))
        return None
    session = op.session
    assert isinstance(session, _Session)
    if isinstance(op, P.Commit):
        return await _commit(io, session, op.actions, state)
    if isinstance(op, P.Subscribe):
        return await _subscribe(io, session, op, state)
    assert isinstance(op, P.Take)
    if op.stream:
        result = await _take_stream(io, session, op, state)
    else:
        result = await _take_once(io, session, op, state)
    state.took(session, result, isinstance(op, P.Take) and op.close_to_give_back)
    return result


# -- pooled channels -----------------------------------------------------------------------------


async def _pool_op(
    io: _AIO, op: P.Inspect | P.ReadAll | P.PublishConfirmed, slot: list[aiormq.Channel | None]
) -> Any:
    channel = slot[0]
    if channel is None or channel.is_closed:
        channel = slot[0] = await io._channel()
    seconds = io.settings.operation_timeout
    queue = op.queue
    try:
        if isinstance(op, P.Inspect):
            with _mapped(f"a passive declare of {queue!r}", queue, seconds):
                ok = await channel.queue_declare(queue, passive=True, timeout=seconds)
            return P.QueueInfo(int(ok.message_count or 0), int(ok.consumer_count or 0))
        if isinstance(op, P.ReadAll):
            with _mapped(f"a read of {queue!r}", queue, seconds):
                return await _read_all(channel, queue, seconds)
        with _mapped(f"confirmed publishes to {queue!r}", queue, seconds):
            await asyncio.wait_for(_publish_confirmed(channel, queue, op.bodies), seconds)
        return None
    except amqp_errors.ChannelNotFoundEntity:
        slot[0] = None  # closed by the broker
        if isinstance(op, P.PublishConfirmed):
            raise BrokerUnavailableError(f"{queue!r} vanished during publishes") from None
        return None
    except BaseException:
        # The channel's state is unknown (an RPC cancelled or timed out makes aiormq close
        # it): never give it back to the pool.
        slot[0] = None
        if not channel.is_closed:
            io.spawn(_close_quietly(channel, seconds))
        raise


async def _close_quietly(channel: aiormq.Channel, seconds: float) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(channel.close(), seconds)


async def _read_all(channel: aiormq.Channel, queue: str, seconds: float) -> tuple[bytes, ...]:
    """basic.get until empty, then give every message back (nack, requeue)."""
    bodies: list[bytes] = []
    last_tag = 0
    while True:
        message = await channel.basic_get(queue, no_ack=False, timeout=seconds)
        if isinstance(message.delivery, spec.Basic.GetEmpty):
            break
        bodies.append(message.body)
        last_tag = int(getattr(message.delivery, "delivery_tag", 0) or 0)
    if last_tag:
        await channel.basic_nack(last_tag, multiple=True, requeue=True, wait=False)
    return tuple(bodies)


async def _publish_confirmed(
    channel: aiormq.Channel, queue: str, bodies: tuple[bytes, ...]
) -> None:
    # One Properties each: aiormq writes a message id into the object it is given.
    results = await asyncio.gather(
        *(
            channel.basic_publish(
                body,
                exchange="",
                routing_key=queue,
                properties=spec.Basic.Properties(delivery_mode=2),
                mandatory=True,
            )
            for body in bodies
        ),
        return_exceptions=True,
    )
    for result in results:
        if isinstance(result, (amqp_errors.DeliveryError, spec.Basic.Nack)):
            # Returned (no such queue) or nacked: PublishError is a DeliveryError.
            raise BrokerUnavailableError(
                f"the broker did not take the publishes to {queue!r} (queue missing, or a "
                "nack); retry the operation"
            )
        if isinstance(result, BaseException):
            raise result


# -- sessions ------------------------------------------------------------------------------------


async def _open_session(io: _AIO) -> _Session:
    seconds = io.settings.operation_timeout
    channel = await io._open_channel(confirms=False)
    try:
        with _mapped("a session channel open", None, seconds, not_found=False):
            await channel.tx_select(timeout=seconds)
    except BaseException:
        io.spawn(_close_quietly(channel, seconds))
        raise
    return _Session(channel)


async def _subscribe(
    io: _AIO, session: _Session, op: P.Subscribe, state: RunState
) -> P.Gone | None:
    gone = session.check_open(f"a consume of {op.queue!r}", gone_ok=True)
    if gone is not None:
        return gone
    seconds = io.settings.operation_timeout
    tag = session.stream_tag = _consumer_tag()
    channel = session.channel

    async def subscribe() -> None:
        await channel.basic_qos(prefetch_count=op.prefetch, timeout=seconds)
        await channel.basic_consume(
            op.queue, session._on_credit, no_ack=False, consumer_tag=tag, timeout=seconds
        )

    try:
        with _mapped(f"a consume of {op.queue!r}", op.queue, seconds):
            await _uninterrupted(io, state, subscribe())
    except amqp_errors.ChannelNotFoundEntity:
        session.stream_tag = None
        return P.GONE
    return None


async def _get(
    io: _AIO, session: _Session, queue: str, state: RunState
) -> P.Delivery | P.Gone | None:
    gone = session.check_open(f"a get from {queue!r}", gone_ok=True)
    if gone is not None:
        return gone
    seconds = io.settings.operation_timeout
    try:
        with _mapped(f"a get from {queue!r}", queue, seconds):
            message = await _uninterrupted(
                io, state, session.channel.basic_get(queue, no_ack=False, timeout=seconds)
            )
    except amqp_errors.ChannelNotFoundEntity:
        return P.GONE
    if isinstance(message.delivery, spec.Basic.GetEmpty):
        return None
    return _delivery(message)


async def _take_stream(
    io: _AIO, session: _Session, op: P.Take, state: RunState
) -> P.Delivery | P.Gone | None:
    if session.buffer:
        return session.buffer.popleft()
    if session.stream_gone:
        return P.GONE
    gone = session.check_open(f"a wait on {op.queue!r}", gone_ok=True)
    if gone is not None:
        return gone
    if op.wait == 0:
        delivery = await _get(io, session, op.queue, state)
        # A credit pushed to our consumer before the broker answered the get arrived before
        # its answer (one channel, in order).
        if delivery is None and session.buffer:
            delivery = session.buffer.popleft()
        return delivery
    waiter: asyncio.Future[P.Delivery | P.Gone | _Closed]
    waiter = asyncio.get_running_loop().create_future()
    session.stream_waiter = waiter
    try:
        # asyncio.wait, not wait_for: a timeout must not cancel a delivery already set.
        await asyncio.wait({waiter}, timeout=op.wait)
    except asyncio.CancelledError:
        if waiter.done() and isinstance(waiter.result(), P.Delivery):
            session.buffer.appendleft(waiter.result())  # type: ignore[arg-type]
        raise
    finally:
        if session.stream_waiter is waiter:
            session.stream_waiter = None
    if not waiter.done():
        return None
    result = waiter.result()
    if isinstance(result, _Closed):
        return _closed_take(session, f"a wait on {op.queue!r}")
    return result


def _closed_take(session: _Session, what: str) -> P.Gone:
    """A take whose session channel closed: GONE after a 404, else the error is raised."""
    gone = session.check_open(what, gone_ok=True)
    if gone is None:  # pragma: no cover - only called once the channel is closed
        raise session.closed_error(what)
    return gone


async def _take_once(
    io: _AIO, session: _Session, op: P.Take, state: RunState
) -> P.Delivery | P.Gone | None:
    delivery = await _get(io, session, op.queue, state)
    if delivery is not None or op.wait == 0 or state.deferred is not None:
        return delivery
    # Nothing ready: a consumer with prefetch 1 until one delivery or the wait passes.
    seconds = io.settings.operation_timeout
    what = f"a consume of {op.queue!r}"
    channel = session.channel
    got: list[P.Delivery] = []
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def on_message(message: aiormq.abc.DeliveredMessage) -> None:
        got.append(_delivery(message))
        if not waiter.done():
            waiter.set_result(None)

    async def consume() -> None:
        await channel.basic_qos(prefetch_count=1, timeout=seconds)
        await channel.basic_consume(
            op.queue, on_message, no_ack=False, consumer_tag=tag, timeout=seconds
        )

    tag = session.once_tag = _consumer_tag()
    session.once_waiter = waiter
    try:
        try:
            with _mapped(what, op.queue, seconds):
                await _uninterrupted(io, state, consume())
        except amqp_errors.ChannelNotFoundEntity:
            return P.GONE
        if state.deferred is None:
            try:
                await asyncio.wait({waiter}, timeout=op.wait)
            except asyncio.CancelledError as cancelled:
                # Stop waiting, not consuming mid-way: the cancel below runs first, and the
                # run gives back what arrived.
                state.defer(cancelled)
        broker_cancelled = session.once_tag != tag
        with _mapped(
            f"the cancel of a consumer of {op.queue!r}", op.queue, seconds, not_found=False
        ):
            await _uninterrupted(io, state, _cancel_once(session, tag, seconds))
    finally:
        session.once_waiter = None
        if session.once_tag == tag:
            session.once_tag = None
    if session.closed:  # what it delivered went back with the channel
        return _closed_take(session, what)
    # After the cancel-ok: every delivery to this consumer has been seen.
    if got:
        for extra in got[1:]:  # cannot happen with prefetch 1; be safe (settled at commit)
            with _mapped(what, op.queue, seconds, not_found=False):
                await channel.basic_reject(extra.tag, requeue=True, wait=False)
        return got[0]
    return P.GONE if broker_cancelled else None


async def _cancel_once(session: _Session, tag: str, seconds: float) -> None:
    if session.once_tag != tag or session.closed:
        return  # cancelled by the broker (queue deleted), or the channel is gone
    session.once_tag = None
    await session.channel.basic_cancel(tag, timeout=seconds)


async def _commit(
    io: _AIO, session: _Session, actions: tuple[P.Action, ...], state: RunState
) -> tuple[str, ...]:
    returned = await _uninterrupted(io, state, _send_commit(io, session, actions))
    for action in actions:
        if isinstance(action, (P.Ack, P.Reject)):
            state.taken.discard((session, action.tag))
    return returned


async def _send_commit(
    io: _AIO, session: _Session, actions: tuple[P.Action, ...]
) -> tuple[str, ...]:
    seconds = io.settings.operation_timeout
    async with session.lock:
        session.check_open("a transaction commit", gone_ok=False)
        channel = session.channel
        session.returned = []
        with _mapped("a transaction commit", None, seconds, not_found=False):
            # No confirms on this channel: the publishes, acks and rejects are only written
            # (wait=False: not even a drain); the commit-ok answers for them all.
            for action in actions:
                if isinstance(action, P.Publish):
                    await channel.basic_publish(
                        action.body,
                        exchange="",
                        routing_key=action.queue,
                        properties=spec.Basic.Properties(
                            delivery_mode=2,
                            message_type=action.kind,
                            message_id=action.message_id,
                            headers=action.headers,
                        ),
                        mandatory=True,
                        wait=False,
                    )
                elif isinstance(action, P.Ack):
                    await channel.basic_ack(action.tag, wait=False)
                else:
                    await channel.basic_reject(action.tag, requeue=True, wait=False)
            await channel.tx_commit(timeout=seconds)
        returned, session.returned = tuple(session.returned), []
        return returned


# -- aborted runs --------------------------------------------------------------------------------


async def abort(io: _AIO, state: RunState) -> None:
    """Undo what an aborted run left on sessions; survives the caller's cancellation."""
    if not state.pending:
        return
    sessions, state.sessions = state.sessions, []
    taken, state.taken = state.taken, set()
    closing, state.close_on_abort = state.close_on_abort, set()
    await asyncio.shield(_spawn(io, _give_back(io, sessions, taken, closing)))


async def _give_back(
    io: _AIO,
    opened: list[_Session],
    taken: set[tuple[_Session, int]],
    closing: set[_Session],
) -> None:
    seconds = io.settings.operation_timeout
    for session in opened:
        await session.close(seconds)  # its deliveries go back with it
    by_session: dict[_Session, list[int]] = {}
    for session, tag in taken:
        if session not in opened and not session.closed:
            by_session.setdefault(session, []).append(tag)
    for session, tags in by_session.items():
        if session in closing:
            # A quorum queue requeues a rejected message at its tail; a closed channel's
            # deliveries go back to its head. (The role handle then gives the role up.)
            await session.close(seconds)
            continue
        try:
            async with session.lock:
                for tag in sorted(tags):
                    await session.channel.basic_reject(tag, requeue=True, wait=False)
                await session.channel.tx_commit(timeout=seconds)
        except Exception:
            log.debug("could not give deliveries back; closing the session", exc_info=True)
            await session.close(seconds)
