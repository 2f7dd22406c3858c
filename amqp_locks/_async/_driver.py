"""The aio-pika driver: runs flows as coroutines on one aio-pika connection.

A plain (not robust) connection: ``connect_robust`` would re-declare exclusive queues after a
reconnect and hide the window in which another client held the slot. Every connection loss
marks every lease held over it lost instead.

Probes, declares and deletes go through the aiormq channel under each aio-pika channel: a
confirmed mandatory publish there costs one frame and one future, and ``asyncio.gather`` of
N of them costs about one round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable
from typing import Any, TypeVar, cast

import aio_pika
import aiormq
import aiormq.exceptions as amqp_errors
from pamqp.commands import Basic

from .. import _flows
from .._common import LeaseState
from .._config import ConnectionSettings
from ..errors import (
    AccessRefusedError,
    BrokerError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    QueueMismatchError,
)
from . import _session

log = logging.getLogger("amqp_locks.aio")
T = TypeVar("T")

_WAKE_RETRY = 5.0
# Channel numbers are handed out in rotation below this (RabbitMQ's default channel_max is
# 2047; see _AIO._next_channel_number).
_CHANNEL_SPAN = 1000


def map_error(exc: BaseException, queue: str | None) -> BaseException:
    """Turn an aiormq/aio-pika error into ours (anything else passes through)."""
    if isinstance(exc, asyncio.TimeoutError):  # also an OSError on Python 3.11+: check first
        return BrokerTimeoutError(f"the broker did not answer in time: {exc!r}")
    if isinstance(exc, amqp_errors.ChannelPreconditionFailed) and queue is not None:
        return QueueMismatchError(queue, str(exc))
    if isinstance(exc, amqp_errors.ChannelAccessRefused):
        return AccessRefusedError(f"broker refused access: {exc}")
    if isinstance(
        exc,
        (amqp_errors.AMQPError, amqp_errors.ChannelInvalidStateError, ConnectionError, OSError),
    ):
        return BrokerUnavailableError(f"broker connection or channel failed: {exc!r}")
    return exc


class _Wake:
    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.waiters: deque[asyncio.Future[int]] = deque()
        self.channel: aiormq.Channel | None = None
        self.tag: str | None = None
        self.busy = False
        self.failed_until = 0.0


class _AIO:
    """One aio-pika connection, its channel pool, wake consumers and watched leases."""

    def __init__(self, settings: ConnectionSettings) -> None:
        self.settings = settings
        self.conn: aio_pika.abc.AbstractConnection | None = None
        self.dead = False
        self.dead_reason = ""
        self.claims: set[str] = set()
        self.leases: set[LeaseState[Any]] = set()
        self._pool: list[aiormq.Channel] = []
        self._plain: aiormq.Channel | None = None
        self._wakes: dict[str, _Wake] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._verifier: asyncio.Task[None] | None = None
        self._last_channel = 0

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            self.conn = await asyncio.wait_for(
                aio_pika.connect(
                    self.settings.url,
                    timeout=self.settings.connect_timeout,
                    client_properties={
                        "connection_name": self.settings.connection_name,
                        "product": "amqp_locks",
                    },
                    heartbeat=self.settings.heartbeat,
                ),
                self.settings.connect_timeout + 1.0,
            )
        except (asyncio.TimeoutError, TimeoutError) as exc:
            self.dead = True
            raise BrokerUnavailableError(
                f"could not connect to {self.settings.url_for_humans} within "
                f"{self.settings.connect_timeout:g} s; is the broker running and reachable?"
            ) from exc
        except Exception as exc:
            self.dead = True
            raise BrokerUnavailableError(
                f"could not connect to {self.settings.url_for_humans}: "
                f"{str(exc).strip() or type(exc).__name__}; is the broker "
                "running, and are the credentials and vhost right?"
            ) from exc
        self.conn.close_callbacks.add(self._on_close)
        self._verifier = asyncio.get_running_loop().create_task(self._verify_forever())

    def _on_close(self, _sender: Any, exc: BaseException | None = None) -> None:
        self._connection_lost(f"connection closed: {exc!r}" if exc else "connection closed")

    def _connection_lost(self, reason: str) -> None:
        if self.dead and not self.leases:
            return
        self.dead = True
        self.dead_reason = self.dead_reason or reason
        for lease in list(self.leases):
            lease.mark_lost(reason)
        self.leases.clear()
        for wake in self._wakes.values():
            for waiter in wake.waiters:
                if not waiter.done():
                    waiter.set_result(0)

    async def close(self) -> None:
        for lease in list(self.leases):
            lease.mark_released()
        self.leases.clear()
        self.dead = True
        self.dead_reason = self.dead_reason or "closed by the client"
        if self._verifier is not None:
            self._verifier.cancel()
        if self.conn is not None and not self.conn.is_closed:
            with contextlib.suppress(Exception):
                await self.conn.close()

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run a cleanup in the background, keeping a reference until it ends."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def track(self, lease: LeaseState[Any]) -> None:
        if self.dead:
            lease.mark_lost(self.dead_reason or "connection closed")
        else:
            self.leases.add(lease)

    def untrack(self, lease: LeaseState[Any]) -> None:
        self.leases.discard(lease)

    def _unavailable(self) -> BrokerUnavailableError:
        return BrokerUnavailableError(f"lost the broker connection: {self.dead_reason}")

    # -- channels -------------------------------------------------------------------------------

    async def _open_channel(self, *, confirms: bool) -> aiormq.Channel:
        if self.conn is None or self.dead:
            raise self._unavailable()
        try:
            channel = await asyncio.wait_for(
                self.conn.channel(
                    channel_number=self._next_channel_number(),
                    publisher_confirms=confirms,
                    on_return_raises=confirms,
                ),
                self.settings.operation_timeout,
            )
            return cast(aiormq.Channel, await channel.get_underlay_channel())
        except Exception as exc:
            raise map_error(exc, None) from exc

    def _next_channel_number(self) -> int | None:
        """A channel number not used recently.

        aiormq reuses the highest number as soon as a channel closes; after a broker-side
        close (every RESOURCE_LOCKED) its Channel.Open for the same number can reach the
        broker before the Close-Ok, and the broker then closes the whole connection (504
        "second 'channel.open' seen"), losing every lease on it. Rotating through the numbers
        leaves each one idle long after its close.
        """
        try:
            in_use = self.conn.transport.connection.channels  # type: ignore[union-attr]
        except AttributeError:
            return None
        for _ in range(_CHANNEL_SPAN):
            self._last_channel = self._last_channel % _CHANNEL_SPAN + 1
            if self._last_channel not in in_use:
                return self._last_channel
        return None

    async def _channel(self) -> aiormq.Channel:
        while self._pool:
            channel = self._pool.pop()
            if not channel.is_closed:
                return channel
        return await self._open_channel(confirms=True)

    def _give_back(self, channel: aiormq.Channel | None) -> None:
        if channel is not None and not channel.is_closed and not self.dead:
            self._pool.append(channel)

    async def _plain_channel(self) -> aiormq.Channel:
        if self._plain is None or self._plain.is_closed:
            self._plain = await self._open_channel(confirms=False)
        return self._plain

    # -- running flows --------------------------------------------------------------------------

    async def run(self, flow: _flows.Flow[T]) -> T:
        if self.dead:
            raise self._unavailable()
        claimed: set[str] = set()
        channel: list[aiormq.Channel | None] = [None]
        value: Any = None
        pressure = _session.RunState()
        try:
            while True:
                try:
                    op = flow.send(value)
                except StopIteration as stop:
                    pressure.check()  # a cancellation that waited for a session RPC
                    return stop.value  # type: ignore[no-any-return]
                pressure.check()
                value = await self._execute(op, channel, claimed, pressure)
        except BaseException:
            flow.close()
            # An aborted or cancelled flow must not leave an exclusive queue held by this
            # live connection: that would be a leaked slot until the connection closes. The
            # names stay claimed until the delete is done, so no other task of this
            # connection re-declares them meanwhile.
            for queue in claimed:
                self.spawn(self._delete_quietly(queue, channel[0]))
            # Nor a pressure session it opened, nor a delivery it took and did not settle.
            await _session.abort(self, pressure)
            pressure.check()  # a cancellation that waited wins over the flow's own error
            raise
        finally:
            self._give_back(channel[0])

    async def _delete_quietly(self, queue: str, used: aiormq.Channel | None) -> None:
        try:
            if used is not None and not used.is_closed:
                # A declare cancelled mid-flight makes aiormq close its channel; let that
                # finish, so the declare's outcome is settled before we delete.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(used.close(), self.settings.operation_timeout)
            with contextlib.suppress(Exception):
                fresh = await self._open_channel(confirms=False)
                await fresh.queue_delete(queue, timeout=self.settings.operation_timeout)
                await fresh.close()
        finally:
            self.claims.discard(queue)

    async def _execute(
        self,
        op: _flows.Op,
        slot: list[aiormq.Channel | None],
        claimed: set[str],
        pressure: _session.RunState | None = None,
    ) -> Any:
        if pressure is not None and _session.handles(op):
            return await _session.execute(self, op, slot, pressure)
        if isinstance(op, _flows.Sleep):
            await asyncio.sleep(op.seconds)
            return None
        if isinstance(op, _flows.AwaitWake):
            return await self._await_wake(op)
        if isinstance(op, _flows.Notify):
            await self._notify(op.queue, op.count, _flows.wake_token(op.slot))
            return None
        if isinstance(op, _flows.DeclareHolder):
            if op.queue in self.claims:
                # Held by this connection already (another task's lease): to the broker that
                # would be a successful re-declare, so the exclusivity is ours to keep.
                return _flows.Claim.LOST
            # Claimed before any await: another task must see it taken from here on.
            self.claims.add(op.queue)
            claimed.add(op.queue)
        channel = slot[0]
        if channel is None or channel.is_closed:
            channel = slot[0] = await self._channel()
        timeout = self.settings.operation_timeout
        queue: str | None = None
        try:
            if isinstance(op, _flows.Probe):
                return await asyncio.wait_for(self._probe(channel, op.queues), timeout)
            if isinstance(op, _flows.DeclareHolder):
                queue = op.queue
                try:
                    await channel.queue_declare(
                        queue,
                        exclusive=True,
                        arguments={
                            **_flows.HOLDER_ARGUMENTS,
                            _flows.HOLDER_ID_ARGUMENT: op.holder_id,
                        },
                        timeout=timeout,
                    )
                except amqp_errors.ChannelLockedResource:
                    self.claims.discard(queue)
                    claimed.discard(queue)
                    slot[0] = None  # RESOURCE_LOCKED closed the channel: take another
                    return _flows.Claim.LOST
                if op.verify is None:
                    return _flows.Claim.HELD
                # aiormq holds publishes behind a pending RPC, so this costs a round trip.
                # (Pipelining a no-wait declare instead makes aiormq write the probe after
                # its Channel.CloseOk when the declare fails: the broker then closes the
                # whole connection with 504 CHANNEL_ERROR.) A nacked verify counts as stale.
                (exists,) = await asyncio.wait_for(self._probe(channel, (op.verify,)), timeout)
                return _flows.Claim.HELD if exists else _flows.Claim.STALE
            if isinstance(op, _flows.DeclareDurable):
                queue = op.queue
                await channel.queue_declare(
                    queue, durable=True, arguments=op.arguments, timeout=timeout
                )
                return None
            if isinstance(op, _flows.Delete):
                queue = op.queue
                await channel.queue_delete(queue, timeout=timeout)
                self.claims.discard(queue)
                claimed.discard(queue)
                return None
        except BrokerError:
            raise
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            raise map_error(exc, queue) from exc
        raise AssertionError(f"unknown operation {op!r}")  # pragma: no cover

    async def _probe(
        self, channel: aiormq.Channel, queues: tuple[str, ...]
    ) -> tuple[bool | None, ...]:
        results = await asyncio.gather(
            *(
                channel.basic_publish(b"", exchange="", routing_key=q, mandatory=True, wait=False)
                for q in queues
            ),
            return_exceptions=True,
        )
        found: list[bool | None] = []
        for result in results:
            if isinstance(result, amqp_errors.PublishError):
                found.append(False)  # Basic.Return NO_ROUTE: no queue by that name
            elif isinstance(result, (amqp_errors.DeliveryError, Basic.Nack)):
                found.append(None)  # nacked: unknown, not missing; the flow asks again
            elif isinstance(result, BaseException):
                raise result
            else:
                found.append(True)
        return tuple(found)

    async def _notify(self, queue: str, count: int, body: bytes) -> None:
        try:
            channel = await self._plain_channel()
            for _ in range(count):
                await channel.basic_publish(body, exchange="", routing_key=queue, wait=False)
        except Exception:
            # A lost token only delays a waiter until its poll; never fail a release for it.
            log.debug("could not publish a wake token to %r", queue, exc_info=True)

    # -- waking ---------------------------------------------------------------------------------

    async def _await_wake(self, op: _flows.AwaitWake) -> int | None:
        wake = self._wakes.get(op.queue)
        if wake is None:
            wake = self._wakes[op.queue] = _Wake(op.queue)
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        wake.waiters.append(waiter)
        self._sync_consumer(wake)
        try:
            return await asyncio.wait_for(waiter, op.seconds)
        except (asyncio.TimeoutError, TimeoutError):
            return None
        finally:
            with contextlib.suppress(ValueError):
                wake.waiters.remove(waiter)
            self._sync_consumer(wake)

    def _sync_consumer(self, wake: _Wake) -> None:
        if not wake.busy and not self.dead:
            wake.busy = True
            self.spawn(self._consumer_loop(wake))

    async def _consumer_loop(self, wake: _Wake) -> None:
        """Consume the wake queue exactly while someone here waits on it."""
        try:
            while not self.dead:
                want = bool(wake.waiters) and time.monotonic() >= wake.failed_until
                if want and wake.tag is None:
                    if wake.channel is None or wake.channel.is_closed:
                        wake.channel = await self._open_channel(confirms=False)
                    try:
                        ok = await wake.channel.basic_consume(
                            wake.queue,
                            lambda message: self._token(wake, message),
                            no_ack=True,
                        )
                    except amqp_errors.ChannelNotFoundEntity:
                        # No wake queue (destroyed, or made by an older admin): poll only.
                        wake.channel = None
                        wake.failed_until = time.monotonic() + _WAKE_RETRY
                        return
                    wake.tag = ok.consumer_tag
                elif not want and wake.tag is not None:
                    tag, wake.tag = wake.tag, None
                    if wake.channel is not None and not wake.channel.is_closed:
                        await wake.channel.basic_cancel(tag)
                else:
                    return
        except Exception:
            log.debug(
                "wake consumer of %r failed; waiters fall back to polling",
                wake.queue,
                exc_info=True,
            )
            wake.channel = None
            wake.tag = None
        finally:
            wake.busy = False

    async def _token(self, wake: _Wake, message: aiormq.abc.DeliveredMessage) -> None:
        slot, hops = _flows.parse_wake_token(message.body or b"")
        for waiter in wake.waiters:
            if not waiter.done():
                waiter.set_result(slot)
                return
        if hops < _flows.WAKE_HOPS:
            await self._notify(wake.queue, 1, _flows.wake_token(slot, hops + 1))

    # -- lease verification ---------------------------------------------------------------------

    async def _verify_forever(self) -> None:
        while not self.dead:
            await asyncio.sleep(self.settings.verify_period)
            groups: dict[Any, list[LeaseState[Any]]] = {}
            for lease in self.leases:
                groups.setdefault(lease.plan, []).append(lease)
            for plan, leases in groups.items():
                try:
                    result = await self.run(_flows.verify(plan.names, [x.slot for x in leases]))
                except Exception:
                    continue  # connection errors mark leases lost by themselves
                for lease, ok in zip(leases, result):
                    if not ok and lease in self.leases:
                        self.leases.discard(lease)
                        lease.mark_lost(
                            "its slot queue was deleted (slot removed by an admin)",
                            still_ours=True,
                        )
