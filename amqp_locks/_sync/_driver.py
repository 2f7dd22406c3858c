"""The pika driver: runs flows on a SelectConnection owned by a dedicated I/O thread.

Why a thread: pika's BlockingConnection services heartbeats only while the caller is inside a
pika call, so a holder working for a minute inside ``with lease:`` would be dropped by the broker
and its slot taken by another client without anyone noticing (pika #418, #564, #752, #1104).
Here the I/O thread runs the ioloop all the time: heartbeats flow, the broker's connection close
reaches us at once, and held leases are re-verified every ``verify_interval`` seconds.

Every flow runs entirely inside the I/O thread, stepped from pika callbacks; the calling thread
waits for one future per public call. All state below is touched only by the I/O thread, except
where a method says it is thread-safe.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import pika
import pika.exceptions

from .. import _flows
from .._common import LeaseState
from .._config import ConnectionSettings
from ..errors import (
    AccessRefusedError,
    AmqpLocksError,
    BrokerError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    QueueMismatchError,
)
from . import _session

log = logging.getLogger("amqp_locks.sync")
T = TypeVar("T")
Done = Callable[[Any, BaseException | None], None]

_RESOURCE_LOCKED = 405
_WAKE_RETRY = 5.0  # after a failed consume (no wake queue), fall back to polling this long


def _describe(error: object) -> str:
    """An error's text, or its type's name when pika gives none."""
    text = str(error).strip()
    return text or type(error).__name__


class OperationCancelled(AmqpLocksError):
    """The caller stopped waiting for a flow (e.g. KeyboardInterrupt); it was aborted."""


def map_close(reason: object, queue: str | None) -> BrokerError:
    """Turn pika's reason for a channel or connection closing into our error."""
    if isinstance(reason, pika.exceptions.ChannelClosedByBroker):
        code, text = reason.reply_code, reason.reply_text
        if code == 406 and queue is not None:
            return QueueMismatchError(queue, text)
        if code == 403:
            return AccessRefusedError(f"broker refused access: {text}")
        return BrokerUnavailableError(f"broker closed the channel: {code} {text}")
    return BrokerUnavailableError(f"connection to the broker lost: {reason!r}")


ProbeDone = Callable[[tuple[bool | None, ...] | None, BaseException | None], None]


class _ProbeBatch:
    def __init__(self, size: int, done: ProbeDone) -> None:
        self.found: list[bool | None] = [True] * size
        self.remaining = size
        self.done = done
        self.finished = False

    def settle(self, index: int, error: BaseException | None) -> None:
        if self.finished:
            return
        if error is not None:
            self.finished = True
            self.done(None, error)
            return
        self.remaining -= 1
        if self.remaining == 0:
            self.finished = True
            self.done(tuple(self.found), None)


class _Channel:
    """A confirm-mode channel: any number of probes in flight; RPCs answered in order."""

    def __init__(self, io: _IO, on_ready: Callable[[_Channel], None]) -> None:
        self.io = io
        self.usable = False
        self.closed = False
        self._tags = itertools.count(1)
        self._probes: dict[int, tuple[_ProbeBatch, int, str] | None] = {}
        # Tags of probes in flight per queue name, oldest first: a basic.return names the
        # routing key, and the broker answers publishes in order.
        self._in_flight: dict[str, deque[int]] = {}
        # Failure handlers of RPCs sent and not yet answered, oldest first (pika sends a
        # channel's RPCs one after another, and the broker answers them in order).
        self._rpcs: deque[Callable[[object], None]] = deque()
        self._after_close: list[Callable[[], None]] = []
        self._on_ready: Callable[[_Channel], None] | None = on_ready
        self._get: Callable[[None], None] | None = None
        self.ch: Any = io.conn.channel(on_open_callback=self._opened)

    def _opened(self, ch: Any) -> None:
        ch.add_on_close_callback(self._closed)
        ch.add_on_return_callback(self._returned)
        ch.add_callback(self._get_empty, [pika.spec.Basic.GetEmpty], one_shot=False)
        ch.confirm_delivery(ack_nack_callback=self._confirmed, callback=self._confirm_ok)

    def _confirm_ok(self, _frame: Any) -> None:
        self.usable = True
        ready, self._on_ready = self._on_ready, None
        if ready is not None:
            ready(self)

    def _closed(self, _ch: Any, reason: object) -> None:
        self.usable = False
        self.closed = True
        self.io.channel_closed(self)
        rpcs, self._rpcs = self._rpcs, deque()
        for fail in rpcs:
            fail(reason)
        probes, self._probes = self._probes, {}
        self._in_flight.clear()
        error = map_close(reason, None)
        for entry in probes.values():
            if entry is not None:
                entry[0].settle(entry[1], error)
        listeners, self._after_close = self._after_close, []
        for listener in listeners:
            listener()

    def after_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the channel is closed (at once if it is)."""
        if self.closed:
            callback()
        else:
            self._after_close.append(callback)

    @property
    def busy(self) -> bool:
        """An RPC is still unanswered: not fit for another run."""
        return bool(self._rpcs)

    def close(self) -> None:
        self.usable = False
        if not self.closed and self.ch.is_open:
            self.ch.close()

    # -- probes and notifications --------------------------------------------------------------

    def probe(
        self,
        queues: tuple[str, ...],
        done: ProbeDone,
    ) -> None:
        batch = _ProbeBatch(len(queues), done)
        publish = self.ch.basic_publish
        for index, queue in enumerate(queues):
            tag = next(self._tags)
            self._probes[tag] = (batch, index, queue)
            self._in_flight.setdefault(queue, deque()).append(tag)
            publish(exchange="", routing_key=queue, body=b"", mandatory=True)

    def notify(self, queue: str, count: int, slot: int) -> None:
        body = _flows.wake_token(slot)
        for _ in range(count):
            self._probes[next(self._tags)] = None
            self.ch.basic_publish(exchange="", routing_key=queue, body=body)

    def publish_persistent(self, queue: str, bodies: tuple[bytes, ...], done: ProbeDone) -> None:
        """Persistent mandatory publishes, reported like a probe batch once all confirm."""
        batch = _ProbeBatch(len(bodies), done)
        properties = pika.BasicProperties(delivery_mode=2)
        for index, body in enumerate(bodies):
            tag = next(self._tags)
            self._probes[tag] = (batch, index, queue)
            self._in_flight.setdefault(queue, deque()).append(tag)
            self.ch.basic_publish(
                exchange="", routing_key=queue, body=body, properties=properties, mandatory=True
            )
        if not bodies:
            done((), None)

    def _get_empty(self, _frame: Any) -> None:
        done, self._get = self._get, None
        if done is not None:
            done(None)

    def read_all(
        self,
        queue: str,
        *,
        ok: Callable[[tuple[bytes, ...]], None],
        fail: Callable[[object], None],
    ) -> None:
        """basic.get until empty, then give every message back (nack, requeue)."""
        bodies: list[bytes] = []
        last_tag = [0]
        self._rpcs.append(fail)

        def next_get() -> None:
            self._get = finished
            self.ch.basic_get(queue, got, auto_ack=False)

        def got(_ch: Any, method: Any, _properties: Any, body: bytes) -> None:
            self._get = None
            bodies.append(body)
            last_tag[0] = method.delivery_tag
            next_get()

        def finished(_none: None) -> None:
            self._rpcs.popleft()
            if last_tag[0]:
                self.ch.basic_nack(delivery_tag=last_tag[0], multiple=True, requeue=True)
            ok(tuple(bodies))

        next_get()

    def passive_declare(
        self, queue: str, *, ok: Callable[[Any], None], fail: Callable[[object], None]
    ) -> None:
        self._rpcs.append(fail)

        def declared(frame: Any) -> None:
            self._rpcs.popleft()
            ok(frame)

        self.ch.queue_declare(queue=queue, passive=True, callback=declared)

    def _returned(self, _ch: Any, method: Any, _properties: Any, _body: bytes) -> None:
        # A mandatory publish nobody could route comes back before its ack (AMQP 0-9-1).
        tags = self._in_flight.get(method.routing_key)
        if not tags:
            return
        entry = self._probes.get(tags.popleft())
        if not tags:
            del self._in_flight[method.routing_key]
        if entry is not None:
            entry[0].found[entry[1]] = False

    def _confirmed(self, frame: Any) -> None:
        method = frame.method
        tag = method.delivery_tag
        tags = [t for t in self._probes if t <= tag] if method.multiple else [tag]
        nacked = isinstance(method, pika.spec.Basic.Nack)
        for t in tags:
            entry = self._probes.pop(t, None)
            if entry is None:
                continue
            in_flight = self._in_flight.get(entry[2])
            if in_flight and in_flight[0] == t:  # routed: no return consumed its tag
                in_flight.popleft()
                if not in_flight:
                    del self._in_flight[entry[2]]
            if nacked:
                entry[0].found[entry[1]] = None  # unknown, not missing: the flow asks again
            entry[0].settle(entry[1], None)

    # -- RPCs -----------------------------------------------------------------------------------

    def declare(
        self,
        queue: str,
        *,
        durable: bool,
        exclusive: bool,
        arguments: dict[str, Any],
        ok: Callable[[], None],
        fail: Callable[[object], None],
    ) -> None:
        self._rpcs.append(fail)

        def declared(_frame: Any) -> None:
            self._rpcs.popleft()
            ok()

        self.ch.queue_declare(
            queue=queue,
            durable=durable,
            exclusive=exclusive,
            arguments=arguments,
            callback=declared,
        )

    def delete(self, queue: str, *, ok: Callable[[], None], fail: Callable[[object], None]) -> None:
        self._rpcs.append(fail)

        def deleted(_frame: Any) -> None:
            self._rpcs.popleft()
            ok()

        self.ch.queue_delete(queue=queue, callback=deleted)


class _Run:
    """One flow being stepped by the I/O thread."""

    def __init__(self, io: _IO, flow: _flows.Flow[Any], done: Done) -> None:
        self.io = io
        self.flow = flow
        self.done = done
        self.channel: _Channel | None = None
        self.claimed: set[str] = set()
        self.timer: Any = None
        self.waiting: tuple[_Wake, _Waiter] | None = None
        self.finished = False
        self.cancelled = False
        # Pressure sessions opened by this run and not yet handed over (closed on failure),
        # and cleanups of waits it may leave behind.
        self.sessions: list[_session._Session] = []
        self.on_finish: list[Callable[[], None]] = []

    def step(self, value: Any) -> None:
        if self.finished:
            return
        self.disarm()
        if self.cancelled:
            self.abort(OperationCancelled("the caller stopped waiting"))
            return
        try:
            op = self.flow.send(value)
        except StopIteration as stop:
            self._finish(stop.value, None)
        except BaseException as exc:  # the flow's own verdict, passed to the caller
            self._finish(None, exc)
        else:
            try:
                self.io.execute(self, op)
            except Exception as exc:
                # pika refusing a call (a channel in the wrong state, a get already pending):
                # this run fails; the I/O thread, and every lease it services, must not.
                log.warning("could not send %r", op, exc_info=True)
                self.abort(BrokerUnavailableError(f"could not send {type(op).__name__}: {exc!r}"))

    def later(self, value: Any) -> None:
        self.io.call_later(0, lambda: self.step(value))

    def abort(self, error: BaseException) -> None:
        if self.finished:
            return
        self.flow.close()
        self._finish(None, error)

    def arm(self, what: str) -> None:
        seconds = self.io.settings.operation_timeout

        def expired() -> None:
            self.timer = None
            if self.channel is not None:
                # The channel's state is unknown now; never reuse it. (It stays the run's
                # channel so that claim cleanup waits for it to close.)
                self.channel.close()
            self.abort(BrokerTimeoutError(f"the broker did not answer {what} in {seconds:g} s"))

        self.timer = self.io.call_later(seconds, expired)

    def disarm(self) -> None:
        if self.timer is not None:
            self.io.remove_timeout(self.timer)
            self.timer = None

    def _finish(self, result: Any, error: BaseException | None) -> None:
        self.finished = True
        self.disarm()
        if self.waiting is not None:
            wake, waiter = self.waiting
            self.io.unwait(wake, waiter)
        cleanups, self.on_finish = self.on_finish, []
        for cleanup in cleanups:
            cleanup()
        if error is not None:
            for session in self.sessions:
                session.close()
        self.sessions = []
        if error is not None and self.claimed:
            # Whatever exclusive queue the aborted flow holds, or may still get from a declare
            # in flight, would stay held by this live connection: a leaked slot.
            self.io.release_claims(set(self.claimed), self.channel)
            self.claimed.clear()
            self.channel = None
        self.io.run_finished(self)
        try:
            self.done(result, error)
        except Exception:
            log.exception("flow completion callback raised")


class _Waiter:
    def __init__(self, run: _Run) -> None:
        self.run = run
        self.timer: Any = None


class _Wake:
    """The consumer of one semaphore's wake queue, active only while someone here waits."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.waiters: deque[_Waiter] = deque()
        self.channel: Any = None
        self.tag: str | None = None
        self.busy = False
        self.failed_until = 0.0


class _IO:
    """One pika SelectConnection and the thread that services it."""

    def __init__(self, settings: ConnectionSettings) -> None:
        self.settings = settings
        self.conn: Any = None
        self.dead = False
        self.dead_reason = ""
        self.claims: set[str] = set()
        self.leases: set[LeaseState[Any]] = set()
        self._runs: set[_Run] = set()
        self._pool: list[_Channel] = []
        self._wakes: dict[str, _Wake] = {}
        self._verify_timer: Any = None
        self.pid = os.getpid()
        # Runs submitted but not yet started by the I/O thread; guarded by _submit_lock, so a
        # run can never slip between "the loop is alive" and "the loop has stopped".
        self._submit_lock = threading.Lock()
        self._pending: set[_Run] = set()
        self._opened = threading.Event()
        self._open_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._main, name=f"amqp_locks-io-{settings.client_id}", daemon=True
        )

    # -- lifecycle (thread-safe) ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        if not self._opened.wait(self.settings.connect_timeout + 1.0):
            self._threadsafe(self._force_close)
            raise BrokerUnavailableError(
                f"could not connect to {self.settings.url_for_humans} within "
                f"{self.settings.connect_timeout:g} s; is the broker running and reachable?"
            )
        if self._open_error is not None:
            raise self._open_error

    def _main(self) -> None:
        params = pika.URLParameters(self.settings.url)
        params.heartbeat = self.settings.heartbeat
        params.socket_timeout = self.settings.connect_timeout
        params.stack_timeout = self.settings.connect_timeout
        params.blocked_connection_timeout = self.settings.operation_timeout
        params.connection_attempts = 1
        params.client_properties = {
            "connection_name": self.settings.connection_name,
            "product": "amqp_locks",
        }
        try:
            self.conn = pika.SelectConnection(
                params,
                on_open_callback=self._on_open,
                on_open_error_callback=self._on_open_error,
                on_close_callback=self._on_close,
            )
            self.conn.ioloop.start()
        except BaseException as exc:  # the thread must never die with callers waiting on it
            log.exception("amqp_locks I/O thread crashed")
            self._open_error = self._open_error or BrokerUnavailableError(
                f"I/O thread crashed: {exc!r}"
            )
            self._opened.set()
            self._connection_lost(f"I/O thread crashed: {exc!r}")
        finally:
            # However the loop ended, nobody may be left waiting on a run it will never step.
            with self._submit_lock:
                self.dead = True
                pending, self._pending = self._pending, set()
            self._connection_lost(self.dead_reason or "the I/O loop stopped")
            for run in pending:
                run.abort(self._unavailable())

    def _on_open(self, _conn: Any) -> None:
        log.debug(
            "connected to %s as %r", self.settings.url_for_humans, self.settings.connection_name
        )
        self._opened.set()
        self._schedule_verify()

    def _on_open_error(self, _conn: Any, error: object) -> None:
        self.dead = True
        self._open_error = BrokerUnavailableError(
            f"could not connect to {self.settings.url_for_humans}: {_describe(error)}; "
            "is the broker running, and are the credentials and vhost right?"
        )
        self._opened.set()
        self.conn.ioloop.stop()

    def _on_close(self, _conn: Any, reason: object) -> None:
        self._connection_lost(f"connection closed: {reason}")
        self.conn.ioloop.stop()

    def _connection_lost(self, reason: str) -> None:
        self.dead = True
        self.dead_reason = self.dead_reason or reason
        for lease in list(self.leases):
            lease.mark_lost(reason)
        self.leases.clear()
        error = BrokerUnavailableError(f"lost the broker connection: {reason}")
        for run in list(self._runs):
            run.abort(error)

    def _force_close(self) -> None:
        self.dead = True
        if self.conn is not None and not (self.conn.is_closed or self.conn.is_closing):
            self.conn.close()
        elif self.conn is not None:
            self.conn.ioloop.stop()

    def close(self, timeout: float = 5.0) -> None:
        """Close the connection (frees every slot it held) and stop the thread."""

        def shutdown() -> None:
            # In the I/O thread, after any pending track(): every lease is seen here.
            for lease in list(self.leases):
                lease.mark_released()
            self.leases.clear()
            self._force_close()

        self._threadsafe(shutdown)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _threadsafe(self, callback: Callable[[], None]) -> None:
        try:
            self.conn.ioloop.add_callback_threadsafe(callback)
        except Exception:  # loop already gone: nothing left to do there
            log.debug("I/O loop gone; dropped a callback", exc_info=True)

    @property
    def in_io_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(
        self,
        flow: _flows.Flow[Any],
        *,
        before: Callable[[], None] | None = None,
        after: Callable[[Any], Any] | None = None,
    ) -> tuple[concurrent.futures.Future[Any], Callable[[], None]]:
        """Start ``flow`` in the I/O thread (thread-safe). Returns its future and a canceller.

        ``before()`` runs in the I/O thread first; ``after(result)`` runs there on success and
        its value becomes the future's result. Bookkeeping done there (tracking a new lease,
        forgetting a released one) cannot race a connection loss, and costs no extra wake-up.
        """
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def done(result: Any, error: BaseException | None) -> None:
            if error is None and after is not None:
                try:
                    result = after(result)
                except BaseException as exc:
                    error = exc
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        run = _Run(self, flow, done)

        def start() -> None:
            with self._submit_lock:
                if run not in self._pending:
                    return  # already aborted by the loop's shutdown
                self._pending.discard(run)
            if before is not None:
                before()
            if self.dead:
                run.abort(self._unavailable())
                return
            self._runs.add(run)
            run.step(None)

        def cancel() -> None:
            run.cancelled = True
            self._threadsafe(lambda: run.abort(OperationCancelled("the caller stopped waiting")))

        with self._submit_lock:
            accepted = not self.dead
            if accepted:
                self._pending.add(run)
        if accepted:
            self._threadsafe(start)
        else:
            if before is not None:
                before()
            done(None, self._unavailable())
        return future, cancel

    def _unavailable(self) -> BrokerUnavailableError:
        return BrokerUnavailableError(f"lost the broker connection: {self.dead_reason}")

    def track(self, lease: LeaseState[Any]) -> None:
        """Watch a new lease for loss. I/O thread only (pass it as ``after`` work)."""
        if self.dead:
            lease.mark_lost(self.dead_reason or "connection closed")
        else:
            self.leases.add(lease)

    # -- helpers for runs (I/O thread) ----------------------------------------------------------

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Any:
        return self.conn.ioloop.call_later(max(seconds, 0.0), callback)

    def remove_timeout(self, handle: Any) -> None:
        self.conn.ioloop.remove_timeout(handle)

    def run_finished(self, run: _Run) -> None:
        self._runs.discard(run)
        channel, run.channel = run.channel, None
        if channel is not None and channel.usable and not channel.busy:
            self._pool.append(channel)

    def channel_closed(self, channel: _Channel) -> None:
        if channel in self._pool:
            self._pool.remove(channel)

    def release_claims(self, queues: set[str], channel: _Channel | None) -> None:
        """Delete exclusive queues an aborted run claimed, then forget the claims.

        The names stay claimed until the broker confirms the delete, so no other run of this
        connection can re-declare them meanwhile. The delete goes on the run's own channel,
        behind any declare still in flight there (the broker answers a channel's methods in
        order); if that channel is closed or closing, on a fresh one once it has closed,
        when whatever was in flight on it is settled.
        """
        if self.dead:
            self.claims.difference_update(queues)
            return

        def delete_on(target: _Channel) -> None:
            for queue in queues:

                def forget(_reason: object = None, queue: str = queue) -> None:
                    self.claims.discard(queue)

                target.delete(queue, ok=forget, fail=forget)
            target.after_close(lambda: self.claims.difference_update(queues))

            def close_when_idle() -> None:
                if not target.busy:
                    target.close()
                else:
                    self.call_later(0.01, close_when_idle)

            close_when_idle()

        if channel is not None and channel.usable:
            delete_on(channel)
        else:

            def on_fresh_channel() -> None:
                _Channel(self, delete_on)

            if channel is not None:
                channel.after_close(on_fresh_channel)  # at once if already closed
            else:
                on_fresh_channel()

    def with_channel(self, run: _Run, then: Callable[[_Channel], None]) -> None:
        """Call ``then`` with the run's pooled channel, opening one if needed."""
        self._with_channel(run, then)

    def _with_channel(self, run: _Run, then: Callable[[_Channel], None]) -> None:
        if run.channel is not None and run.channel.usable:
            then(run.channel)
            return
        while self._pool:
            channel = self._pool.pop()
            if channel.usable:
                run.channel = channel
                then(channel)
                return
        run.arm("a channel open")

        def ready(channel: _Channel) -> None:
            if run.finished:
                self._pool.append(channel)  # fresh: no RPC was sent on it
                return
            run.disarm()
            run.channel = channel
            then(channel)

        _Channel(self, ready)

    # -- operations -----------------------------------------------------------------------------

    def execute(self, run: _Run, op: Any) -> None:
        if _session.execute(self, run, op):
            return
        if isinstance(op, _flows.Sleep):
            run.timer = self.call_later(op.seconds, lambda: run.step(None))
        elif isinstance(op, _flows.AwaitWake):
            self._await_wake(run, op)
        elif isinstance(op, _flows.DeclareHolder) and op.queue in self.claims:
            # This connection holds it already (another thread's lease): to the broker that
            # would be a successful re-declare, so the exclusivity is ours to keep.
            run.later(_flows.Claim.LOST)
        else:
            if isinstance(op, _flows.DeclareHolder):
                # Claimed now, not once a channel is ready: between the check above and the
                # declare, another run of this connection must already see it taken.
                self.claims.add(op.queue)
                run.claimed.add(op.queue)
            self._with_channel(run, lambda channel: self._send(run, channel, op))

    def _send(self, run: _Run, channel: _Channel, op: _flows.Op) -> None:
        if isinstance(op, _flows.Probe):
            run.arm("an existence probe")

            def probed(found: tuple[bool | None, ...] | None, error: BaseException | None) -> None:
                if error is not None:
                    run.abort(error)
                else:
                    run.step(found)

            channel.probe(op.queues, probed)
        elif isinstance(op, _flows.DeclareHolder):
            self._declare_holder(run, channel, op)
        elif isinstance(op, _flows.DeclareDurable):
            durable_queue = op.queue
            run.arm(f"the declare of {durable_queue!r}")
            channel.declare(
                durable_queue,
                durable=True,
                exclusive=False,
                arguments=op.arguments,
                ok=lambda: run.step(None),
                fail=lambda reason: run.abort(map_close(reason, durable_queue)),
            )
        elif isinstance(op, _flows.Delete):
            doomed = op.queue

            def deleted() -> None:
                self.claims.discard(doomed)
                run.claimed.discard(doomed)
                run.step(None)

            run.arm(f"the delete of {doomed!r}")
            channel.delete(
                doomed, ok=deleted, fail=lambda reason: run.abort(map_close(reason, doomed))
            )
        elif isinstance(op, _flows.Notify):
            channel.notify(op.queue, op.count, op.slot)
            run.later(None)
        else:  # pragma: no cover - the Op union is closed
            raise AssertionError(f"unknown operation {op!r}")

    def _declare_holder(self, run: _Run, channel: _Channel, op: _flows.DeclareHolder) -> None:
        queue, verify = op.queue, op.verify
        declared = False

        def lost_race(reason: object) -> None:
            self.claims.discard(queue)
            run.claimed.discard(queue)
            run.channel = None
            if (
                isinstance(reason, pika.exceptions.ChannelClosedByBroker)
                and reason.reply_code == _RESOURCE_LOCKED
            ):
                run.step(_flows.Claim.LOST)
            else:
                run.abort(map_close(reason, queue))

        def ok() -> None:
            nonlocal declared
            declared = True
            if verify is None:
                run.step(_flows.Claim.HELD)

        def verified(found: tuple[bool | None, ...] | None, error: BaseException | None) -> None:
            if error is not None:
                if declared:  # a lost race is reported by lost_race, not here
                    run.abort(error)
            elif found is not None:
                # A nack leaves A[k] unknown: call it stale, so the flow gives B[k] back and
                # rescans, rather than hand out a slot it could not verify.
                run.step(_flows.Claim.HELD if found[0] else _flows.Claim.STALE)

        run.arm(f"the declare of {queue!r}")
        channel.declare(
            queue,
            durable=False,
            exclusive=True,
            arguments={**_flows.HOLDER_ARGUMENTS, _flows.HOLDER_ID_ARGUMENT: op.holder_id},
            ok=ok,
            fail=lost_race,
        )
        if verify is not None:
            # Pipelined behind the declare on the same channel: the broker answers it after
            # the declare, and pika does not hold publishes back behind a pending RPC.
            channel.probe((verify,), verified)

    # -- waking ---------------------------------------------------------------------------------

    def _await_wake(self, run: _Run, op: _flows.AwaitWake) -> None:
        wake = self._wakes.get(op.queue)
        if wake is None:
            wake = self._wakes[op.queue] = _Wake(op.queue)
        waiter = _Waiter(run)
        wake.waiters.append(waiter)
        run.waiting = (wake, waiter)

        def timed_out() -> None:
            waiter.timer = None
            self._resume(wake, waiter, None)

        waiter.timer = self.call_later(op.seconds, timed_out)
        self._sync_consumer(wake)

    def _resume(self, wake: _Wake, waiter: _Waiter, token: int | None) -> None:
        self.unwait(wake, waiter)
        waiter.run.step(token)

    def unwait(self, wake: _Wake, waiter: _Waiter) -> None:
        if waiter.timer is not None:
            self.remove_timeout(waiter.timer)
            waiter.timer = None
        if waiter in wake.waiters:
            wake.waiters.remove(waiter)
        waiter.run.waiting = None
        self._sync_consumer(wake)

    def _sync_consumer(self, wake: _Wake) -> None:
        """Consume the wake queue exactly while someone here waits on it."""
        if wake.busy or self.dead:
            return
        want = bool(wake.waiters) and time.monotonic() >= wake.failed_until
        if want and wake.tag is None:
            wake.busy = True
            if wake.channel is None or not wake.channel.is_open:
                wake.channel = None
                self.conn.channel(on_open_callback=lambda ch: self._wake_channel_open(wake, ch))
            else:
                self._consume(wake)
        elif not want and wake.tag is not None:
            wake.busy = True

            def cancelled(_frame: Any) -> None:
                wake.tag = None
                wake.busy = False
                self._sync_consumer(wake)

            wake.channel.basic_cancel(wake.tag, callback=cancelled)

    def _wake_channel_open(self, wake: _Wake, channel: Any) -> None:
        wake.channel = channel

        def closed(_ch: Any, reason: object) -> None:
            wake.channel = None
            wake.tag = None
            wake.busy = False
            if (
                isinstance(reason, pika.exceptions.ChannelClosedByBroker)
                and reason.reply_code == 404
            ):
                # No wake queue (created by an older admin, or destroyed): poll only.
                wake.failed_until = time.monotonic() + _WAKE_RETRY

        channel.add_on_close_callback(closed)
        channel.add_on_cancel_callback(lambda _frame: self._wake_cancelled(wake))
        self._consume(wake)

    def _consume(self, wake: _Wake) -> None:
        def consuming(_frame: Any) -> None:
            wake.busy = False
            self._sync_consumer(wake)

        def token(ch: Any, _method: Any, _props: Any, body: bytes) -> None:
            slot, hops = _flows.parse_wake_token(body)
            if wake.waiters:
                self._resume(wake, wake.waiters[0], slot)
            elif hops < _flows.WAKE_HOPS:
                body = _flows.wake_token(slot, hops + 1)
                ch.basic_publish(exchange="", routing_key=wake.queue, body=body)

        wake.tag = wake.channel.basic_consume(wake.queue, token, auto_ack=True, callback=consuming)

    def _wake_cancelled(self, wake: _Wake) -> None:
        # The broker cancels consumers of a deleted queue: the semaphore was destroyed.
        wake.tag = None
        wake.busy = False
        for waiter in list(wake.waiters):
            self._resume(wake, waiter, 0)

    # -- lease verification ---------------------------------------------------------------------

    def _schedule_verify(self) -> None:
        self._verify_timer = self.call_later(self.settings.verify_period, self._verify_leases)

    def _verify_leases(self) -> None:
        if self.dead:
            return
        groups: dict[Any, list[LeaseState[Any]]] = {}
        for lease in self.leases:
            groups.setdefault(lease.plan, []).append(lease)
        for plan, leases in groups.items():
            slots = [lease.slot for lease in leases]

            def checked(
                result: Any, error: BaseException | None, leases: list[LeaseState[Any]] = leases
            ) -> None:
                if error is not None:
                    return  # connection errors mark leases lost by themselves
                for lease, ok in zip(leases, result):
                    if not ok and lease in self.leases:
                        self.leases.discard(lease)
                        lease.mark_lost(
                            "its slot queue was deleted (slot removed by an admin)",
                            still_ours=True,
                        )

            run = _Run(self, _flows.verify(plan.names, slots), checked)
            self._runs.add(run)
            run.step(None)
        self._schedule_verify()
