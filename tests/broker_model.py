"""An in-memory model of the broker semantics the flows rely on, and drivers that run flows on it.

Like h11's ``ConnectionPair``, this wires the pure core (:mod:`amqp_locks._flows`) to a fake peer
so tests can assert on algorithms without a broker. It models exactly what the flows assume of
RabbitMQ (see ``/work/shared/rabbitmq-facts.md``), and no more:

* durable queues (A queues, the wake queue) with their declare arguments; re-declaring one with
  other arguments is 406 PRECONDITION_FAILED, reported as :class:`errors.QueueMismatchError`;
* exclusive queues (B queues, the admin mutex) owned by a connection id. ``DeclareHolder``
  answers ``Claim.LOST`` when the queue exists already -- owned by another connection (405
  RESOURCE_LOCKED) *or by this same connection*: the real drivers keep per-connection claims,
  because the broker itself would accept a second exclusive declare from the owner. Otherwise
  the calling connection now holds it, and the answer is ``Claim.HELD``, or ``Claim.STALE`` when
  the operation's ``verify`` queue does not exist (declare and verify probe are atomic here: an
  admin acting between them would give the same answer as one acting just before the declare);
* ``Delete`` is idempotent (deleting a missing queue is fine, as in RabbitMQ 3+); deleting another
  connection's exclusive queue is 405, which the flows never attempt (it fails loudly here);
* ``Probe`` answers existence per name, whoever owns the queue (publishing to another
  connection's exclusive queue is allowed); probes leave no messages behind (x-max-length 0);
* ``Notify`` adds wake tokens to an existing queue, capped by its ``x-max-length`` (drop-head);
  to a missing queue they are dropped (unroutable, not mandatory);
* time is a fake clock: ``Sleep`` advances it, ``AwaitWake`` consumes a token if one is waiting
  (``True``) or else advances the clock by its timeout (``False``).

A broker failure (the 406 above) aborts the flow with ``close()`` and is raised to the caller, as
the real drivers do: they never throw into a flow. Unlike the real drivers, the model does not
delete the exclusive queues an aborted flow had claimed; call :meth:`BrokerModel.close_connection`
to model the connection going away.

Every executed operation is appended to :attr:`BrokerModel.log`, so tests can assert on order and
on round-trip counts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from amqp_locks import _flows, errors
from amqp_locks._flows import (
    AwaitWake,
    Claim,
    DeclareDurable,
    DeclareHolder,
    Delete,
    Flow,
    Notify,
    Op,
    Probe,
    Sleep,
)
from amqp_locks._naming import SemaphoreNames

__all__ = [
    "BrokerModel",
    "FlowRun",
    "Interleaver",
    "Record",
    "ResourceLockedError",
    "run",
]

_SLOT_QUEUE = re.compile(r"-([0-9]+)-([AB])\Z")


class ResourceLockedError(errors.BrokerError):
    """405 RESOURCE_LOCKED on something other than a declare: the flows should never cause it."""


@dataclass(frozen=True)
class Record:
    """One operation the model executed: who ran it, what it was, and what it answered."""

    seq: int
    conn: str
    op: Op
    result: Any = None
    error: BaseException | None = None
    #: Name of the flow in an :class:`Interleaver`, or ``None`` when run directly.
    flow: str | None = None


@dataclass
class BrokerModel:
    """The broker's queues, a fake clock and the log of every operation executed."""

    now_: float = 1000.0
    #: Durable queues by name, with the arguments they were declared with.
    durable: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Exclusive queues by name, with the id of the connection that owns them.
    exclusive: dict[str, str] = field(default_factory=dict)
    #: Holder id given when each exclusive queue was declared (x-amqp-locks-holder).
    holder_ids: dict[str, str] = field(default_factory=dict)
    #: Ready messages (wake tokens) per queue: how many.
    messages: dict[str, int] = field(default_factory=dict)
    #: The slot each ready token names (0: any), oldest first.
    tokens: dict[str, list[int]] = field(default_factory=dict)
    log: list[Record] = field(default_factory=list)

    # -- time ------------------------------------------------------------------------------------

    def now(self) -> float:
        """The fake clock; pass as a flow's ``clock``."""
        return self.now_

    # -- executing operations --------------------------------------------------------------------

    def execute(self, op: Op, conn: str, *, flow: str | None = None) -> Any:
        """Run one operation for connection ``conn``; log it; return the flow's answer."""
        try:
            result = self._execute(op, conn)
        except errors.BrokerError as exc:
            self.log.append(Record(len(self.log), conn, op, error=exc, flow=flow))
            raise
        self.log.append(Record(len(self.log), conn, op, result, flow=flow))
        return result

    def _execute(self, op: Op, conn: str) -> Any:
        if isinstance(op, Probe):
            return tuple(self.exists(q) for q in op.queues)
        if isinstance(op, DeclareHolder):
            if op.queue in self.exclusive:
                return Claim.LOST  # RESOURCE_LOCKED, or already ours (the drivers' claims)
            if op.queue in self.durable:
                raise errors.QueueMismatchError(op.queue, "durable queue declared as exclusive")
            self.exclusive[op.queue] = conn
            self.holder_ids[op.queue] = op.holder_id
            if op.verify is not None and not self.exists(op.verify):
                return Claim.STALE
            return Claim.HELD
        if isinstance(op, DeclareDurable):
            if op.queue in self.exclusive:
                raise errors.QueueMismatchError(op.queue, "exclusive queue declared as durable")
            existing = self.durable.get(op.queue)
            if existing is not None and existing != op.arguments:
                raise errors.QueueMismatchError(
                    op.queue, f"inequivalent arguments {existing!r} vs {op.arguments!r}"
                )
            self.durable[op.queue] = dict(op.arguments)
            return None
        if isinstance(op, Delete):
            owner = self.exclusive.get(op.queue)
            if owner is not None and owner != conn:
                raise ResourceLockedError(f"{op.queue!r} is exclusive to connection {owner!r}")
            self._drop(op.queue)
            return None
        if isinstance(op, Notify):
            if self.exists(op.queue):
                cap = self.durable.get(op.queue, {}).get("x-max-length")
                queued = self.tokens.setdefault(op.queue, []) + [op.slot] * op.count
                if cap is not None:
                    queued = queued[len(queued) - cap :] if cap else []  # drop-head
                self.tokens[op.queue] = queued
                self.messages[op.queue] = len(queued)
            return None
        if isinstance(op, Sleep):
            assert op.seconds >= 0, op
            self.now_ += op.seconds
            return None
        if isinstance(op, AwaitWake):
            assert op.seconds >= 0, op
            if self.messages.get(op.queue, 0) > 0:
                self.messages[op.queue] -= 1
                queued = self.tokens.get(op.queue) or [0]
                return queued.pop(0)
            self.now_ += op.seconds
            return None
        raise TypeError(f"unknown operation {op!r}")

    def _drop(self, queue: str) -> None:
        self.durable.pop(queue, None)
        self.exclusive.pop(queue, None)
        self.holder_ids.pop(queue, None)
        self.messages.pop(queue, None)
        self.tokens.pop(queue, None)

    # -- connections -----------------------------------------------------------------------------

    def close_connection(self, conn: str) -> None:
        """The connection closed or died: the broker deletes its exclusive queues."""
        for queue in [q for q, owner in self.exclusive.items() if owner == conn]:
            self._drop(queue)

    # -- setting up and inspecting state ---------------------------------------------------------

    def exists(self, queue: str) -> bool:
        return queue in self.durable or queue in self.exclusive

    def add_slots(self, names: SemaphoreNames, slots: Iterable[int]) -> None:
        """Create A queues directly (e.g. strays an external tool left), as the library would."""
        for k in slots:
            self.durable[names.slot(k)] = dict(_flows.SLOT_ARGUMENTS)

    def hold(self, names: SemaphoreNames, slot: int, conn: str) -> None:
        """Make ``conn`` hold B[slot] (a rival client outside any flow)."""
        self.take(names.holder(slot), conn)

    def take(self, queue: str, conn: str) -> None:
        assert queue not in self.exclusive, f"{queue} already held by {self.exclusive[queue]}"
        self.exclusive[queue] = conn
        self.holder_ids[queue] = conn

    def slots(self, names: SemaphoreNames) -> list[int]:
        """Slot numbers whose A queue exists, ascending."""
        return self._numbers(names, "A", self.durable)

    def holders(self, names: SemaphoreNames) -> dict[int, str]:
        """Slot number -> owning connection, for every B queue that exists."""
        return {
            k: self.exclusive[names.holder(k)] for k in self._numbers(names, "B", self.exclusive)
        }

    @staticmethod
    def _numbers(names: SemaphoreNames, kind: str, queues: Iterable[str]) -> list[int]:
        found = []
        for queue in queues:
            m = _SLOT_QUEUE.search(queue)
            if m and m.group(2) == kind and queue == f"{names.base}-{m.group(1)}-{kind}":
                found.append(int(m.group(1)))
        return sorted(found)

    # -- reading the log -------------------------------------------------------------------------

    def ops(
        self, kind: type | tuple[type, ...] = object, *, conn: str | None = None, since: int = 0
    ) -> list[Op]:
        """Executed operations of type ``kind`` (optionally of one connection), in order."""
        return [
            r.op
            for r in self.log[since:]
            if isinstance(r.op, kind) and (conn is None or r.conn == conn)
        ]

    def mark(self) -> int:
        """A position in the log, for ``ops(since=...)``."""
        return len(self.log)


def run(flow: Flow[Any], conn: str, broker: BrokerModel, *, limit: int = 100_000) -> Any:
    """Drive ``flow`` to completion for connection ``conn``; return its value or raise its error.

    A flow still running after ``limit`` operations fails the test instead of hanging it.
    """
    handle = FlowRun("run", flow, conn)
    for _ in range(limit):
        if handle.done:
            return handle.value()
        handle.step(broker)
    raise AssertionError(f"flow did not finish in {limit} operations; last: {handle!r}")


class FlowRun:
    """One flow and the operation it waits to have executed next."""

    def __init__(self, name: str, flow: Flow[Any], conn: str) -> None:
        self.name = name
        self.flow = flow
        self.conn = conn
        self.pending: Op | None = None
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._advance(lambda: next(flow))

    def step(self, broker: BrokerModel) -> None:
        """Execute the pending operation and feed its answer back to the flow."""
        assert not self.done and self.pending is not None, f"{self.name} has finished"
        try:
            answer = broker.execute(self.pending, self.conn, flow=self.name)
        except errors.BrokerError as exc:
            self.abort(exc)
            return
        self._advance(lambda: self.flow.send(answer))

    def abort(self, error: BaseException) -> None:
        """What a driver does on a broker failure: close the flow, report the error."""
        if self.done:
            return
        self.flow.close()
        self.pending = None
        self.done = True
        self.error = error

    def value(self) -> Any:
        assert self.done, f"{self.name} has not finished"
        if self.error is not None:
            raise self.error
        return self.result

    def _advance(self, resume: Callable[[], Op]) -> None:
        try:
            self.pending = resume()
        except StopIteration as stop:
            self.pending = None
            self.done = True
            self.result = stop.value
        except Exception as exc:  # the flow's own verdict
            self.pending = None
            self.done = True
            self.error = exc

    def __repr__(self) -> str:
        state = "done" if self.done else f"next {self.pending!r}"
        return f"<FlowRun {self.name} on {self.conn}: {state}>"


class Interleaver:
    """Several flows against one broker, advanced one operation at a time in a chosen order.

    Each flow runs on a connection id; several flows may share one (like threads sharing a
    connection). ``step(name)`` executes exactly one operation of that flow, so a test can stop a
    flow right before, say, its declare, and let another flow act in between.
    """

    def __init__(self, broker: BrokerModel) -> None:
        self.broker = broker
        self.runs: dict[str, FlowRun] = {}

    def start(self, name: str, flow: Flow[Any], conn: str) -> FlowRun:
        assert name not in self.runs or self.runs[name].done, f"{name} is still running"
        self.runs[name] = handle = FlowRun(name, flow, conn)
        return handle

    def __getitem__(self, name: str) -> FlowRun:
        return self.runs[name]

    def pending(self, name: str) -> Op | None:
        return self.runs[name].pending

    def runnable(self) -> list[str]:
        return [name for name, r in self.runs.items() if not r.done]

    def step(self, name: str) -> FlowRun:
        handle = self.runs[name]
        handle.step(self.broker)
        return handle

    def step_until(self, name: str, predicate: Callable[[Op], bool], *, limit: int = 1000) -> Op:
        """Step ``name`` until its *pending* operation satisfies ``predicate`` (not executed)."""
        handle = self.runs[name]
        for _ in range(limit):
            assert not handle.done, f"{name} finished before reaching the operation: {handle!r}"
            assert handle.pending is not None
            if predicate(handle.pending):
                return handle.pending
            handle.step(self.broker)
        raise AssertionError(f"{name} did not reach the operation in {limit} steps")

    def finish(self, name: str, *, limit: int = 10_000) -> Any:
        """Step ``name`` to completion; return its value or raise its error."""
        handle = self.runs[name]
        for _ in range(limit):
            if handle.done:
                return handle.value()
            handle.step(self.broker)
        raise AssertionError(f"{name} did not finish in {limit} steps")

    def crash(self, conn: str, reason: str = "connection lost") -> list[FlowRun]:
        """The connection dies: its flows are aborted and the broker drops its exclusive queues."""
        aborted = [r for r in self.runs.values() if r.conn == conn and not r.done]
        for handle in aborted:
            handle.abort(errors.BrokerUnavailableError(reason))
        self.broker.close_connection(conn)
        return aborted
