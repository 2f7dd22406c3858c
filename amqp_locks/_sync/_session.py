"""The pika side of pressure-queue operations (see :mod:`amqp_locks._pressure`).

Role holders work on a *session*: a channel of their own in transaction mode, where items and
credits are taken (``basic.get``, or a consumer while waiting) and settled together with the
records in one ``tx.commit``. Reads that need no role (passive declares, record reads,
confirmed publishes at create) go on the driver's pooled confirm-mode channels.

Everything here runs in the connection's I/O thread.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pika
import pika.exceptions
import pika.spec

from .. import _pressure as P
from ..errors import BrokerError, BrokerUnavailableError

if TYPE_CHECKING:
    from ._driver import _IO, _Channel, _Run

log = logging.getLogger("amqp_locks.sync")

_NOT_FOUND = 404


def _is_not_found(reason: object) -> bool:
    return (
        isinstance(reason, pika.exceptions.ChannelClosedByBroker)
        and reason.reply_code == _NOT_FOUND
    )


def _delivery(method: Any, properties: Any, body: bytes) -> P.Delivery:
    return P.Delivery(
        tag=method.delivery_tag,
        body=body,
        redelivered=bool(method.redelivered),
        kind=properties.type or P.ITEM,
        message_id=properties.message_id,
        headers=dict(properties.headers or {}),
    )


class _Session:
    """A transactional channel owned by one role holder."""

    def __init__(self, io: _IO, ready: Callable[[_Session | None, object], None]) -> None:
        self.io = io
        self.closed = False
        self.close_reason: object = None
        self._ready: Callable[[_Session | None, object], None] | None = ready
        # Completion of the outstanding basic.get (pika allows one at a time).
        self._get: Callable[[P.Delivery | None], None] | None = None
        # Failure handlers of whatever waits on this channel, called if it closes.
        self._pending: list[Callable[[object], None]] = []
        # Routing keys returned, per commit in flight, oldest first: the broker sends a
        # transaction's returns before its Commit-Ok, and answers commits in order.
        self._commits: deque[list[str]] = deque()
        # RabbitMQ closes the connection (504 "unexpected command while processing
        # 'tx.commit'") if anything follows a tx.commit on its channel before the Commit-Ok:
        # operations issued behind a commit sent without waiting are held here until then.
        self._deferred = 0
        self._held: deque[Callable[[], None]] = deque()
        self._merged: list[P.Action] | None = None
        self._after_close: list[Callable[[], None]] = []
        # The credit stream (Subscribe), and whoever waits for a credit.
        self.stream_tag: str | None = None
        self.stream_gone = False
        self.buffer: deque[P.Delivery] = deque()
        self.stream_waiter: Callable[[P.Delivery | P.Gone | None], None] | None = None
        # A one-delivery consumer serving a blocked Take.
        self.once_tag: str | None = None
        self.once_cancelled: Callable[[], None] | None = None
        self.once_delivery: Callable[[P.Delivery], None] | None = None
        self.ch: Any = io.conn.channel(on_open_callback=self._opened)

    def _opened(self, ch: Any) -> None:
        ch.add_on_close_callback(self._on_close)
        ch.add_on_return_callback(self._on_return)
        ch.add_on_cancel_callback(self._on_broker_cancel)
        ch.add_callback(self._on_get_empty, [pika.spec.Basic.GetEmpty], one_shot=False)
        ch.tx_select(callback=self._tx_ok)

    def _tx_ok(self, _frame: Any) -> None:
        ready, self._ready = self._ready, None
        if ready is not None:
            ready(self, None)

    def _on_close(self, _ch: Any, reason: object) -> None:
        self.closed = True
        self.close_reason = reason
        ready, self._ready = self._ready, None
        if ready is not None:
            ready(None, reason)
        pending, self._pending = self._pending, []
        for fail in pending:
            fail(reason)
        # A credit wait registered its failure handler above: it has been told already.
        self.stream_waiter = None
        listeners, self._after_close = self._after_close, []
        for listener in listeners:
            listener()

    def _on_return(self, _ch: Any, method: Any, _properties: Any, _body: bytes) -> None:
        if self._commits:
            self._commits[0].append(method.routing_key)

    def _on_broker_cancel(self, frame: Any) -> None:
        # RabbitMQ cancels the consumers of a queue that is deleted.
        tag = frame.method.consumer_tag
        if tag == self.stream_tag:
            self.stream_tag = None
            self.stream_gone = True
            waiter, self.stream_waiter = self.stream_waiter, None
            if waiter is not None:
                waiter(P.GONE)
        elif tag == self.once_tag:
            self.once_tag = None
            cancelled, self.once_cancelled = self.once_cancelled, None
            if cancelled is not None:
                cancelled()

    def _on_get_empty(self, _frame: Any) -> None:
        done, self._get = self._get, None
        if done is not None:
            done(None)

    def when_ready(self, operation: Callable[[], None]) -> None:
        """Start ``operation`` now, or once the commits sent without waiting are answered."""
        if self._deferred:
            self._held.append(operation)
        else:
            operation()

    def commit_unwaited(self, actions: tuple[P.Action, ...]) -> None:
        """Commit ``actions`` without anyone waiting for the answer.

        Behind a commit still unanswered, they join the next one instead (one transaction for
        several: a consumer giving credits back faster than the broker commits them).
        """
        if self._deferred:
            if self._merged is None:
                self._merged = []
                self._held.append(self._send_merged)
            self._merged.extend(actions)
            return
        self._send_unwaited(actions)

    def _send_merged(self) -> None:
        actions, self._merged = tuple(self._merged or ()), None
        if actions:
            self._send_unwaited(actions)

    def _send_unwaited(self, actions: tuple[P.Action, ...]) -> None:
        self._deferred += 1

        def answered(_returned: tuple[str, ...] | None = None) -> None:
            self._deferred -= 1
            while self._held and not self._deferred:
                self._held.popleft()()

        def failed(reason: object) -> None:
            log.debug("a commit sent without waiting failed: %r", reason)
            answered()

        self.commit(actions, answered, failed)

    def after_close(self, callback: Callable[[], None]) -> None:
        if self.closed:
            callback()
        else:
            self._after_close.append(callback)

    def close(self) -> None:
        if not self.closed and self.ch.is_open:
            self.ch.close()

    def _failing(self, fail: Callable[[object], None]) -> Callable[[], None]:
        """Register ``fail`` for a channel close; returns the function that unregisters it."""
        self._pending.append(fail)

        def forget() -> None:
            if fail in self._pending:
                self._pending.remove(fail)

        return forget

    # -- operations -----------------------------------------------------------------------------

    def basic_get(
        self,
        queue: str,
        done: Callable[[P.Delivery | None], None],
        fail: Callable[[object], None],
    ) -> None:
        forget = self._failing(fail)

        def got(_ch: Any, method: Any, properties: Any, body: bytes) -> None:
            self._get = None
            forget()
            done(_delivery(method, properties, body))

        def empty(result: P.Delivery | None) -> None:
            forget()
            done(result)

        self._get = empty
        self.ch.basic_get(queue, got, auto_ack=False)

    def subscribe(
        self, queue: str, prefetch: int, done: Callable[[], None], fail: Callable[[object], None]
    ) -> None:
        forget = self._failing(fail)

        def credit(_ch: Any, method: Any, properties: Any, body: bytes) -> None:
            delivery = _delivery(method, properties, body)
            waiter, self.stream_waiter = self.stream_waiter, None
            if waiter is not None:
                waiter(delivery)
            else:
                self.buffer.append(delivery)

        def consuming(_frame: Any) -> None:
            forget()
            done()

        self.ch.basic_qos(prefetch_count=prefetch)
        self.stream_tag = self.ch.basic_consume(queue, credit, auto_ack=False, callback=consuming)

    def consume_once(
        self,
        queue: str,
        wait: float | None,
        done: Callable[[P.Delivery | P.Gone | None], None],
        fail: Callable[[object], None],
    ) -> None:
        """Consume until one delivery or ``wait`` seconds; always report after the cancel."""
        forget = self._failing(fail)
        got: list[P.Delivery] = []
        timer: list[Any] = [None]
        finished = [False]

        def finish(result: P.Delivery | P.Gone | None) -> None:
            if finished[0]:
                return
            finished[0] = True
            forget()
            if timer[0] is not None:
                self.io.remove_timeout(timer[0])
                timer[0] = None
            self.once_cancelled = None
            done(result)

        def cancel() -> None:
            tag, self.once_tag = self.once_tag, None
            if tag is None or self.closed:
                return
            self.ch.basic_cancel(tag, callback=lambda _f: finish(got[0] if got else None))

        def on_message(_ch: Any, method: Any, properties: Any, body: bytes) -> None:
            if got:  # cannot happen with prefetch 1 and nothing acked; be safe
                self.ch.basic_reject(method.delivery_tag, requeue=True)
                return
            got.append(_delivery(method, properties, body))
            cancel()

        def expired() -> None:
            timer[0] = None
            cancel()

        self.once_cancelled = lambda: finish(got[0] if got else P.GONE)
        self.ch.basic_qos(prefetch_count=1)
        self.once_tag = self.ch.basic_consume(queue, on_message, auto_ack=False)
        if wait is not None:
            timer[0] = self.io.call_later(wait, expired)

    def commit(
        self,
        actions: tuple[P.Action, ...],
        done: Callable[[tuple[str, ...]], None],
        fail: Callable[[object], None],
    ) -> None:
        if self.closed or not self.ch.is_open:
            fail(self.close_reason)
            return
        forget = self._failing(fail)
        returned: list[str] = []
        self._commits.append(returned)
        for action in actions:
            if isinstance(action, P.Publish):
                properties = pika.BasicProperties(
                    delivery_mode=2,
                    type=action.kind,
                    message_id=action.message_id,
                    headers=action.headers,
                )
                self.ch.basic_publish(
                    exchange="",
                    routing_key=action.queue,
                    body=action.body,
                    properties=properties,
                    mandatory=True,
                )
            elif isinstance(action, P.Ack):
                self.ch.basic_ack(action.tag)
            else:
                self.ch.basic_reject(action.tag, requeue=True)

        def committed(_frame: Any) -> None:
            forget()
            if self._commits and self._commits[0] is returned:
                self._commits.popleft()
            done(tuple(returned))

        self.ch.tx_commit(callback=committed)


# -- dispatch from _IO.execute -------------------------------------------------------------------


def _channel_error(reason: object, queue: str | None) -> BrokerError:
    from ._driver import map_close

    return map_close(reason, queue)


def execute(io: _IO, run: _Run, op: P.Op) -> bool:
    """Run a pressure operation; False if ``op`` is not one (the caller handles it)."""
    if isinstance(op, P.OpenSession):
        run.arm("a session channel open")

        def ready(session: _Session | None, reason: object) -> None:
            if session is None:
                run.abort(_channel_error(reason, None))
                return
            if run.finished:
                session.close()
                return
            run.sessions.append(session)
            run.step(session)

        _Session(io, ready)
        return True
    if isinstance(op, P.CloseSession):
        session: _Session = op.session
        if session in run.sessions:
            run.sessions.remove(session)
        if session.closed:
            run.later(None)
        else:
            run.arm("a session channel close")
            session.after_close(lambda: run.step(None))
            session.when_ready(session.close)
        return True
    if isinstance(op, (P.Subscribe, P.Take, P.Commit)):
        _session_op(io, run, op)
        return True
    if isinstance(op, (P.Inspect, P.ReadAll, P.PublishConfirmed)):
        io.with_channel(run, lambda channel: _pool_op(io, run, channel, op))
        return True
    return False


def _session_op(io: _IO, run: _Run, op: P.Subscribe | P.Take | P.Commit) -> None:
    session: _Session = op.session
    if isinstance(op, P.Commit) and not op.wait:
        if session.closed:
            # Nobody waits for it: what it would have done is left for the records to tell
            # (a consumer's owed credits are paid by the next one).
            log.debug("a commit sent without waiting found its session closed")
        else:
            session.commit_unwaited(op.actions)
        run.later(())
        return
    if session._deferred:
        run.arm("the answer to an earlier transaction commit")

        def resume() -> None:
            if not run.finished:
                run.disarm()
                _session_op_now(io, run, op)

        session.when_ready(resume)
    else:
        _session_op_now(io, run, op)


def _session_op_now(io: _IO, run: _Run, op: P.Subscribe | P.Take | P.Commit) -> None:
    session: _Session = op.session

    def fail(reason: object) -> None:
        if isinstance(op, (P.Take, P.Subscribe)) and _is_not_found(reason):
            run.step(P.GONE)
        else:
            # Not a declare: a 406 here is no argument mismatch (e.g. the broker's
            # consumer_timeout closing a session that held deliveries for too long).
            run.abort(_channel_error(reason, None))

    if session.closed:
        fail(session.close_reason)
        return
    if isinstance(op, P.Subscribe):
        run.arm(f"a consume of {op.queue!r}")
        session.subscribe(op.queue, op.prefetch, lambda: run.step(None), fail)
    elif isinstance(op, P.Commit):
        run.arm("a transaction commit")
        session.commit(op.actions, run.step, fail)
    elif op.stream:
        _take_stream(io, run, session, op, fail)
    else:
        run.arm(f"a get from {op.queue!r}")

        def got(delivery: P.Delivery | None) -> None:
            if delivery is not None or op.wait == 0:
                run.step(delivery)
                return
            run.disarm()
            session.consume_once(op.queue, op.wait, run.step, fail)

        session.basic_get(op.queue, got, fail)


def _take_stream(
    io: _IO, run: _Run, session: _Session, op: P.Take, fail: Callable[[object], None]
) -> None:
    if session.buffer:
        run.later(session.buffer.popleft())
        return
    if session.stream_gone:
        run.later(P.GONE)
        return
    if op.wait == 0:
        run.arm(f"a get from {op.queue!r}")

        def got(delivery: P.Delivery | None) -> None:
            # A credit pushed to our consumer before the broker answered the get arrived
            # before its answer (one channel, in order).
            if delivery is None and session.buffer:
                delivery = session.buffer.popleft()
            run.step(delivery)

        session.basic_get(op.queue, got, fail)
        return
    timer: list[Any] = [None]

    def abandon() -> None:
        forget()
        if session.stream_waiter is arrived:
            session.stream_waiter = None
        if timer[0] is not None:
            io.remove_timeout(timer[0])
            timer[0] = None

    def arrived(delivery: P.Delivery | P.Gone | None) -> None:
        abandon()
        run.step(delivery)

    def expired() -> None:
        timer[0] = None
        if session.stream_waiter is arrived:
            abandon()
            run.step(None)

    def closed(reason: object) -> None:
        # The session's channel closed while we waited: GONE on a 404, else a broker error
        # (never a false "no room in time").
        abandon()
        fail(reason)

    forget = session._failing(closed)
    session.stream_waiter = arrived
    if op.wait is not None:
        timer[0] = io.call_later(op.wait, expired)
    run.on_finish.append(abandon)


def _pool_op(
    io: _IO, run: _Run, channel: _Channel, op: P.Inspect | P.ReadAll | P.PublishConfirmed
) -> None:
    queue = op.queue

    def lost_channel(reason: object) -> None:
        run.channel = None  # closed by the broker: never reuse it
        if _is_not_found(reason) and not isinstance(op, P.PublishConfirmed):
            run.step(None)
        else:
            run.abort(_channel_error(reason, queue))

    if isinstance(op, P.Inspect):
        run.arm(f"a passive declare of {queue!r}")
        channel.passive_declare(
            queue,
            ok=lambda frame: run.step(
                P.QueueInfo(frame.method.message_count, frame.method.consumer_count)
            ),
            fail=lost_channel,
        )
    elif isinstance(op, P.ReadAll):
        run.arm(f"a read of {queue!r}")
        channel.read_all(queue, ok=run.step, fail=lost_channel)
    else:
        run.arm(f"confirmed publishes to {queue!r}")

        def confirmed(found: tuple[bool | None, ...] | None, error: BaseException | None) -> None:
            if error is not None:
                run.abort(error)
            elif found is not None and not all(found):
                run.abort(
                    BrokerUnavailableError(
                        f"the broker did not take the publishes to {queue!r} (queue missing, "
                        "or a nack); retry the operation"
                    )
                )
            else:
                run.step(None)

        channel.publish_persistent(queue, op.bodies, confirmed)
