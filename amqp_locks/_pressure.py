"""The pressure-queue algorithms, written once, with no I/O.

The pressure protocol (``pressure-protocol-0.15``, written for Redis lists) on RabbitMQ. Each
operation is a flow, as in :mod:`amqp_locks._flows`: a generator that yields broker operations
and receives their results from a driver (pika in :mod:`amqp_locks._sync`, aio-pika in
:mod:`amqp_locks._async`, or the tests' scripted broker).

How the Redis keys map to RabbitMQ (``B`` is ``<prefix>:<name>``; ``docs/pressure.md`` is the
protocol document for other clients):

=====================  ===================================  ======================================
Redis key              RabbitMQ                             why
=====================  ===================================  ======================================
``B`` (list)           durable queue ``B``, persistent      FIFO; a consumer's unacknowledged item
                       items; quorum when replicated        comes back to the head if it dies
``:bound``             ``B:bound`` (``x-max-length`` 0)     declared last, deleted first: the
                       exists; the value is in the          queue exists while it does (probed
                       producer record                      by a mandatory publish, no 404)
``:not_full``          ``B:space``: one *credit* per free   ``bound`` credits at create; a put
                       place; ``x-max-length`` = bound      spends one, a get returns one, both in
                                                            one AMQP transaction with the item
``:producer_free``     one-slot semaphore ``B:producer``    freed when the holder's connection
``:consumer_free``     one-slot semaphore ``B:consumer``    dies: no deadlock (the original's flaw)
``:producer``,         record queues ``B:stats:produced``   one JSON record each (``x-max-length``
``:consumer``,         and ``B:stats:consumed``             1), rewritten by the role holder in
``:stats:*``                                                the same transaction as each item
``:closed``            ``closed`` in the producer record,   consumers drain what came before the
                       and an end marker queued last        marker; the marker stays for the next
=====================  ===================================  ======================================

Beyond the spec: ``B:dead`` (items delivered more than the delivery limit), ``B:attempts``
(the consumer's delivery count of the item at the head), ``B:lock`` (exclusive: serialises
create and delete).

Why transactions: the invariant is *credits + items = bound*, so that the broker never holds
more items than the bound, counting items a consumer has taken but not acknowledged (RabbitMQ's
own ``x-max-length`` counts only ready messages, and lets a requeue exceed it). A put acks a
credit and publishes the item and the new producer record in one ``tx.commit``; a get acks the
item and publishes a credit and the new consumer record in one. A client that dies before its
commit changes nothing: its credit or item goes back to its queue.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, TypeVar

import tenacity

from . import _flows
from ._flows import Claim, DeclareDurable, DeclareHolder, Delete, Sleep, backoff
from ._naming import SemaphoreNames
from .errors import (
    AdminBusyError,
    AmqpLocksError,
    InvalidArgumentError,
    InvalidNameError,
    QueueAlreadyExistsError,
    QueueClosedError,
    QueueDoesNotExistError,
)

T = TypeVar("T")
Clock = Callable[[], float]

DEFAULT_PREFIX = "__pressure__"
#: Largest bound accepted: create() publishes one credit per place.
MAX_BOUND = 1_000_000
#: Message ``type`` of items, and of the end marker close() queues last.
ITEM = "pressure.item"
CLOSED = "pressure.closed"
KICKS_HEADER = "x-pressure-kicks"
DELIVERIES_HEADER = "x-pressure-deliveries"

_RESERVED_ENDINGS = re.compile(
    r"(:bound|:space|:dead|:lock|:attempts|:producer|:consumer|:stats:[a-z]+"
    r"|-[0-9]+-[A-Z])\Z"
)
_LONGEST_SUFFIX = ":consumer-100000-B"


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PressureNames:
    """The queue names of one pressure queue. Build with :meth:`of`, which validates."""

    name: str
    base: str

    @classmethod
    def of(cls, name: object, prefix: object = None) -> PressureNames:
        if not isinstance(name, str):
            raise InvalidNameError(f"queue name must be a str, got {type(name).__name__}")
        if prefix is None:
            prefix = DEFAULT_PREFIX
        if not isinstance(prefix, str):
            raise InvalidNameError(f"prefix must be a str, got {type(prefix).__name__}")
        if not name:
            raise InvalidNameError("queue name must not be empty")
        base = f"{prefix}:{name}" if prefix else name
        if base.startswith("amq."):
            raise InvalidNameError(f"queue name {base!r} starts with 'amq.', reserved by RabbitMQ")
        if any(ord(c) < 32 or ord(c) == 127 for c in base):
            raise InvalidNameError(f"queue name {base!r} contains control characters")
        if _RESERVED_ENDINGS.search(name):
            raise InvalidNameError(
                f"queue name {name!r} ends like one of a pressure queue's own queues (':space', "
                "':producer', '-1-A', ...); it could collide with another queue's — rename it"
            )
        room = 255 - len(_LONGEST_SUFFIX)
        if len(base.encode()) > room:
            raise InvalidNameError(
                f"queue name is {len(base.encode())} bytes of UTF-8 with its prefix; at most "
                f"{room} fit in RabbitMQ queue names once suffixed"
            )
        return cls(name, base)

    @property
    def data(self) -> str:
        return self.base

    @property
    def bound(self) -> str:
        return f"{self.base}:bound"

    @property
    def space(self) -> str:
        return f"{self.base}:space"

    @property
    def produced(self) -> str:
        return f"{self.base}:stats:produced"

    @property
    def consumed(self) -> str:
        return f"{self.base}:stats:consumed"

    @property
    def producing(self) -> str:
        """The producer record's private copy, read only by the next producer."""
        return f"{self.base}:stats:producing"

    @property
    def consuming(self) -> str:
        """The consumer record's private copy, read only by the next consumer."""
        return f"{self.base}:stats:consuming"

    @property
    def credited(self) -> str:
        return f"{self.base}:stats:credited"

    @property
    def attempts(self) -> str:
        return f"{self.base}:attempts"

    @property
    def dead(self) -> str:
        return f"{self.base}:dead"

    @property
    def lock(self) -> str:
        return f"{self.base}:lock"

    @property
    def kept(self) -> tuple[str, ...]:
        """The queues a delete removes only once both roles are free: the records, the
        attempts record and the dead letters (the data and credits go first)."""
        return (
            self.produced,
            self.producing,
            self.consumed,
            self.consuming,
            self.credited,
            self.attempts,
            self.dead,
        )

    @property
    def producer(self) -> SemaphoreNames:
        return SemaphoreNames(f"{self.base}:producer")

    @property
    def consumer(self) -> SemaphoreNames:
        return SemaphoreNames(f"{self.base}:consumer")

    def role(self, role: str) -> SemaphoreNames:
        return self.producer if role == "producer" else self.consumer


def check_bound(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"bound must be an int, got {type(value).__name__}")
    if not 0 <= value <= MAX_BOUND:
        raise InvalidArgumentError(
            f"bound must be between 0 (unbounded) and {MAX_BOUND}, got {value}"
        )
    return value


def check_limit(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(
            f"delivery_limit must be an int or None, got {type(value).__name__}"
        )
    if value < 1:
        raise InvalidArgumentError(f"delivery_limit must be at least 1, got {value}")
    return value


def check_data(value: object) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"pressure queues carry bytes; got {type(value).__name__} — encode it first "
            "(str.encode(), json.dumps(...).encode(), pickle.dumps(...))"
        )
    return bytes(value)


def check_count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{what} must be an int, got {type(value).__name__}")
    if value < 0:
        raise InvalidArgumentError(f"{what} must not be negative, got {value}")
    return value


# --------------------------------------------------------------------------------------------
# Queue arguments and records
# --------------------------------------------------------------------------------------------


def item_arguments(replicated: bool) -> dict[str, Any]:
    return {"x-queue-type": "quorum" if replicated else "classic"}


def space_arguments(bound: int, replicated: bool) -> dict[str, Any]:
    # The cap makes an extra credit (a bug, or a broker replaying a half-applied transaction)
    # drop the oldest credit rather than let the queue grow past its bound.
    return {**item_arguments(replicated), "x-max-length": bound}


# Readers put a record back (nack) after reading it; meanwhile the holder may write newer
# ones. Drop-head at length 1 then discards the older records at the next write, and readers
# take the highest version among what they see.
RECORD_ARGUMENTS: dict[str, Any] = {"x-max-length": 1}
# The existence marker keeps nothing, so probing it (a mandatory publish) is harmless.
BOUND_ARGUMENTS: dict[str, Any] = {"x-max-length": 0}


class _Record:
    """A record's wire form: its fields as a compact JSON object (see docs/pressure.md)."""

    def encode(self) -> bytes:
        return json.dumps(self.__dict__, separators=(",", ":")).encode()


@dataclass(frozen=True)
class ProducerRecord(_Record):
    v: int = 0
    id: str | None = None
    messages: int = 0
    nbytes: int = 0
    closed: bool = False
    bound: int = 0
    replicated: bool = False

    def put(self, size: int) -> ProducerRecord:
        return replace(self, v=self.v + 1, messages=self.messages + 1, nbytes=self.nbytes + size)


@dataclass(frozen=True)
class ConsumerRecord(_Record):
    v: int = 0
    id: str | None = None
    messages: int = 0
    nbytes: int = 0
    dead: int = 0

    def got(self, size: int) -> ConsumerRecord:
        return replace(self, v=self.v + 1, messages=self.messages + 1, nbytes=self.nbytes + size)


@dataclass(frozen=True)
class CreditRecord(_Record):
    """Credits the consumers gave back in all (see :func:`_return_credit`)."""

    v: int = 0
    paid: int = 0


@dataclass(frozen=True)
class Attempts(_Record):
    """Deliveries counted so far of ``message`` (the item at the head), and the limit."""

    v: int = 0
    limit: int | None = None
    message: str | None = None
    deliveries: int = 0

    def counting(self, message: str | None, deliveries: int) -> Attempts:
        return replace(self, v=self.v + 1, message=message, deliveries=deliveries)


R = TypeVar("R", ProducerRecord, ConsumerRecord, CreditRecord, Attempts)


def _both(
    public: str, private: str, record: ProducerRecord | ConsumerRecord
) -> tuple[Publish, Publish]:
    """A role record, written twice: for readers, and for the next holder of the role.

    Readers take a record out of its queue for a moment (basic.get, then nack); a holder
    writing meanwhile can leave an older one as the only one visible. The next holder must
    never start from that, so it reads a copy no reader touches.
    """
    body = record.encode()
    return Publish(public, body), Publish(private, body)


def decode(kind: type[R], bodies: Sequence[bytes]) -> R | None:
    """The newest well-formed record among ``bodies`` (None if none is)."""
    best: R | None = None
    for body in bodies:
        try:
            fields = json.loads(body)
            record = kind(**{k: fields[k] for k in kind.__dataclass_fields__ if k in fields})
        except (ValueError, TypeError):
            continue
        if best is None or record.v > best.v:
            best = record
    return best


# --------------------------------------------------------------------------------------------
# Operations (besides _flows' DeclareHolder, DeclareDurable, Delete, Sleep, Probe)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueInfo:
    messages: int  # ready messages (not those delivered and unacknowledged)
    consumers: int


@dataclass(frozen=True)
class Inspect:
    """Passive declare. Result: a QueueInfo, or None when the queue does not exist."""

    queue: str


@dataclass(frozen=True)
class ReadAll:
    """Read every message of a (small) queue and put them all back.

    basic.get until get-empty, then nack(requeue) them all. Result: the bodies, oldest first,
    or None when the queue does not exist.
    """

    queue: str


@dataclass(frozen=True)
class PublishConfirmed:
    """Persistent publishes, all confirmed before the result (None) comes back."""

    queue: str
    bodies: tuple[bytes, ...] = field(hash=False)


class Gone(Enum):
    """A session operation found its queue deleted (404, or the broker cancelled us)."""

    GONE = "gone"


GONE = Gone.GONE


@dataclass(frozen=True)
class Delivery:
    tag: int
    body: bytes
    redelivered: bool
    kind: str
    message_id: str | None
    headers: dict[str, Any] = field(hash=False, compare=False, default_factory=dict)


@dataclass(frozen=True)
class OpenSession:
    """Open a transactional channel owned by a role holder. Result: an opaque session handle."""


@dataclass(frozen=True)
class CloseSession:
    """Close the session's channel: anything delivered and not acknowledged goes back."""

    session: Any


@dataclass(frozen=True)
class Subscribe:
    """Keep consuming ``queue`` on the session with this prefetch; deliveries are buffered
    for ``Take(stream=True)``. Result: None, or GONE."""

    session: Any
    queue: str
    prefetch: int


@dataclass(frozen=True)
class Take:
    """One delivery from ``queue``, unacknowledged, on the session.

    ``stream=True``: from the Subscribe buffer (``basic.get`` when it is empty and
    ``wait == 0``). ``stream=False``: ``basic.get``; if empty and ``wait != 0``, a consumer
    with prefetch 1, cancelled after one delivery or when ``wait`` passes (a delivery that
    arrives before the cancel-ok is still returned). ``wait=None`` waits forever.
    Result: a Delivery, None (none within ``wait``), or GONE.
    """

    session: Any
    queue: str
    wait: float | None
    stream: bool = False
    #: If the flow is aborted with the delivery in hand, give it back by closing the session
    #: (a quorum queue requeues a rejected message at its tail, a closed channel's at its
    #: head); else by a reject, which keeps the session.
    close_to_give_back: bool = False


@dataclass(frozen=True)
class Publish:
    queue: str
    body: bytes = field(hash=False)
    kind: str = ITEM
    message_id: str | None = None
    headers: dict[str, Any] | None = field(default=None, hash=False, compare=False)


@dataclass(frozen=True)
class Ack:
    tag: int


@dataclass(frozen=True)
class Reject:
    tag: int


Action = Publish | Ack | Reject


@dataclass(frozen=True)
class Commit:
    """Send the actions (persistent, mandatory publishes; acks; rejects with requeue), then
    ``tx.commit``. Result: the queues of the publishes the broker returned as unroutable.

    ``wait=False``: the result (``()``) comes back once the commit is sent, not answered; the
    session's later operations queue behind it, and a failure shows on them. A driver may
    always wait instead.
    """

    session: Any
    actions: tuple[Action, ...]
    wait: bool = True


Op = (
    _flows.Op
    | Inspect
    | ReadAll
    | PublishConfirmed
    | OpenSession
    | CloseSession
    | Subscribe
    | Take
    | Commit
)
Flow = Generator[Op, Any, T]


@dataclass(frozen=True)
class Policy:
    #: Credits a producer keeps delivered ahead (one round trip per put, not two).
    credit_prefetch: int = 128
    #: A record briefly held by a reader: read again this many times before giving up.
    record_attempts: int = 100
    record_wait: tenacity.wait.wait_base = field(
        default_factory=lambda: tenacity.wait_random_exponential(multiplier=0.002, max=0.05)
    )
    lock_attempts: int = 200
    lock_wait: tenacity.wait.wait_base = field(
        default_factory=lambda: tenacity.wait_random_exponential(multiplier=0.01, max=0.25)
    )
    semaphore: _flows.Policy = field(default_factory=_flows.Policy)


# --------------------------------------------------------------------------------------------
# Reading state (no role needed)
# --------------------------------------------------------------------------------------------


def read_record(names: PressureNames, queue: str, kind: type[R], policy: Policy) -> Flow[R]:
    for attempt in range(1, policy.record_attempts + 1):
        bodies = yield ReadAll(queue)
        if bodies is None:
            raise QueueDoesNotExistError(names.name)
        record = decode(kind, bodies)
        if record is not None:
            return record
        # Another reader holds it for a moment (between its get and its nack).
        yield Sleep(backoff(policy.record_wait, attempt))
    raise QueueDoesNotExistError(names.name)


def exists(names: PressureNames) -> Flow[bool]:
    (found,) = yield from _flows.probe((names.bound,))
    return found


def require(names: PressureNames) -> Flow[None]:
    if not (yield from exists(names)):
        raise QueueDoesNotExistError(names.name)


def length(names: PressureNames, policy: Policy) -> Flow[int]:
    yield from require(names)
    info = yield Inspect(names.data)
    if info is None:
        raise QueueDoesNotExistError(names.name)
    assert isinstance(info, QueueInfo)
    if info.messages == 0:
        return 0
    record = yield from read_record(names, names.produced, ProducerRecord, policy)
    # Once closed, the end marker sits behind the items; it is not an item.
    return max(info.messages - (1 if record.closed else 0), 0)


def closed(names: PressureNames, policy: Policy) -> Flow[bool]:
    yield from require(names)
    record = yield from read_record(names, names.produced, ProducerRecord, policy)
    return record.closed


def records(names: PressureNames, policy: Policy) -> Flow[tuple[ProducerRecord, ConsumerRecord]]:
    yield from require(names)
    produced = yield from read_record(names, names.produced, ProducerRecord, policy)
    consumed = yield from read_record(names, names.consumed, ConsumerRecord, policy)
    return produced, consumed


def dead_length(names: PressureNames) -> Flow[int]:
    yield from require(names)
    info = yield Inspect(names.dead)
    return 0 if info is None else int(info.messages)


# --------------------------------------------------------------------------------------------
# Create and delete (under B:lock)
# --------------------------------------------------------------------------------------------


def lock(names: PressureNames, holder_id: str, policy: Policy) -> Flow[None]:
    attempt = 0
    while (yield DeclareHolder(names.lock, holder_id)) is Claim.LOST:
        attempt += 1
        if attempt >= policy.lock_attempts:
            raise AdminBusyError(names.base, attempt)
        yield Sleep(backoff(policy.lock_wait, attempt))


def unlock(names: PressureNames) -> Flow[None]:
    yield Delete(names.lock)


def _ensure_role(names: SemaphoreNames, holder_id: str, policy: Policy) -> Flow[None]:
    yield from _flows.resize(
        names, holder_id=holder_id, policy=policy.semaphore, target=lambda _n: 1, must_exist=False
    )


def create(
    names: PressureNames,
    *,
    bound: int,
    replicated: bool,
    delivery_limit: int | None,
    holder_id: str,
    policy: Policy,
) -> Flow[None]:
    """Under the lock: fail if the queue exists; else build every part, ``B:bound`` last."""
    yield from lock(names, holder_id, policy)
    try:
        if (yield from exists(names)):
            raise QueueAlreadyExistsError(names.name)
        # A delete that stopped midway while a role was held: the holder would go on with its
        # records in the new queue (stats and bound overwritten). delete() again finishes it.
        if any((yield from _flows.probe((names.producer.holder(1), names.consumer.holder(1))))):
            raise QueueAlreadyExistsError(names.name)
        # Whatever a delete that stopped midway left behind must not leak into the new queue.
        for queue in (names.data, names.space, *names.kept):
            yield Delete(queue)
        yield from _ensure_role(names.producer, holder_id, policy)
        yield from _ensure_role(names.consumer, holder_id, policy)
        first = ProducerRecord(bound=bound, replicated=replicated).encode()
        for queue in (names.produced, names.producing):
            yield DeclareDurable(queue, RECORD_ARGUMENTS)
            yield PublishConfirmed(queue, (first,))
        for queue in (names.consumed, names.consuming):
            yield DeclareDurable(queue, RECORD_ARGUMENTS)
            yield PublishConfirmed(queue, (ConsumerRecord().encode(),))
        yield DeclareDurable(names.credited, RECORD_ARGUMENTS)
        yield PublishConfirmed(names.credited, (CreditRecord().encode(),))
        yield DeclareDurable(names.attempts, RECORD_ARGUMENTS)
        yield PublishConfirmed(names.attempts, (Attempts(limit=delivery_limit).encode(),))
        if bound:
            yield DeclareDurable(names.space, space_arguments(bound, replicated))
            chunk = 1000
            for start in range(0, bound, chunk):
                yield PublishConfirmed(names.space, (b"",) * min(chunk, bound - start))
        yield DeclareDurable(names.dead, item_arguments(replicated))
        yield DeclareDurable(names.data, item_arguments(replicated))
        yield DeclareDurable(names.bound, BOUND_ARGUMENTS)
    except AmqpLocksError:
        # (A driver that aborts the flow deletes the lock it claimed by itself.)
        yield from unlock(names)
        raise
    yield from unlock(names)


def delete_begin(names: PressureNames, holder_id: str, policy: Policy) -> Flow[None]:
    """Take the lock, then delete the existence marker, the data and the credit queues.

    Deleting them wakes every blocked client: the broker cancels consumers of a deleted queue,
    and a ``basic.get`` on it fails; they raise QueueDoesNotExistError and give up their
    roles, which the caller then waits for before :func:`delete_end`. A queue whose data
    marker is gone but whose roles remain (a delete that stopped midway) is deleted again.
    """
    yield from lock(names, holder_id, policy)
    try:
        if not (yield from exists(names)):
            found = yield from _flows.probe((names.producer.slot(1), names.consumer.slot(1)))
            if not any(found):
                raise QueueDoesNotExistError(names.name)
        yield Delete(names.bound)
        yield Delete(names.data)
        yield Delete(names.space)
    except AmqpLocksError:
        yield from unlock(names)
        raise


def delete_end(names: PressureNames, holder_id: str, policy: Policy) -> Flow[None]:
    """With both roles held by the caller (or gone): delete every remaining part, unlock."""
    try:
        for queue in names.kept:
            yield Delete(queue)
        for role in (names.producer, names.consumer):
            yield from _flows.destroy(role, holder_id=holder_id, policy=policy.semaphore)
    except AmqpLocksError:
        yield from unlock(names)
        raise
    yield from unlock(names)


# --------------------------------------------------------------------------------------------
# The producer role
# --------------------------------------------------------------------------------------------


@dataclass
class Producer:
    """What a producer-role holder knows; only it writes the producer record."""

    names: PressureNames
    session: Any
    record: ProducerRecord

    @property
    def bounded(self) -> bool:
        return self.record.bound > 0

    @property
    def sessions(self) -> tuple[Any, ...]:
        return (self.session,)


def _open(names: PressureNames) -> Flow[Any]:
    return (yield OpenSession())


def start_producer(names: PressureNames, holder_id: str, policy: Policy) -> Flow[Producer]:
    """Run right after taking the producer role: load the record, subscribe to credits, and
    record who holds the role."""
    yield from require(names)
    record = yield from read_record(names, names.producing, ProducerRecord, policy)
    session = yield from _open(names)
    try:
        if record.bound:
            prefetch = min(record.bound, policy.credit_prefetch)
            if (yield Subscribe(session, names.space, prefetch)) is GONE:
                raise QueueDoesNotExistError(names.name)
        record = replace(record, v=record.v + 1, id=holder_id)
        yield Commit(session, _both(names.produced, names.producing, record))
    except AmqpLocksError:
        yield CloseSession(session)
        raise
    return Producer(names, session, record)


def put(producer: Producer, data: bytes, wait: float | None) -> Flow[bool]:
    """Put one item, waiting up to ``wait`` s for a credit (None: forever). False: no room."""
    names = producer.names
    if producer.record.closed:
        raise QueueClosedError(names.name, "close() was called; nothing can be put any more")
    actions: list[Action] = []
    if producer.bounded:
        credit = yield Take(producer.session, names.space, wait, stream=True)
        if credit is GONE:
            raise QueueDoesNotExistError(names.name)
        if credit is None:
            return False
        actions.append(Ack(credit.tag))
    record = producer.record.put(len(data))
    actions.append(Publish(names.data, data, ITEM, str(record.messages)))
    actions.extend(_both(names.produced, names.producing, record))
    returned = yield Commit(producer.session, tuple(actions))
    if names.data in returned:
        raise QueueDoesNotExistError(names.name)
    producer.record = record
    return True


#: Most items one transaction carries (put_many on an unbounded queue, or many credits).
MAX_BATCH = 256


def put_many(
    producer: Producer, items: Sequence[bytes], wait: float | None, clock: Clock
) -> Flow[int]:
    """Put ``items`` in order, as many per transaction as there are credits in hand (one
    round trip for a batch instead of one per item). Waits up to ``wait`` s in all for room;
    returns how many were put (fewer only when the time ran out)."""
    names = producer.names
    if producer.record.closed:
        raise QueueClosedError(names.name, "close() was called; nothing can be put any more")
    deadline = None if wait is None else clock() + wait
    done = 0
    while done < len(items):
        want = min(len(items) - done, MAX_BATCH)
        actions: list[Action] = []
        if producer.bounded:
            left = None if deadline is None else max(deadline - clock(), 0.0)
            credit = yield Take(producer.session, names.space, left, stream=True)
            while credit is not None:
                if credit is GONE:
                    raise QueueDoesNotExistError(names.name)
                actions.append(Ack(credit.tag))
                if len(actions) == want:
                    break
                # Only credits already here (or one more get): never wait with some in hand.
                credit = yield Take(producer.session, names.space, 0.0, stream=True)
            if not actions:
                return done
        count = len(actions) if producer.bounded else want
        record = producer.record
        for data in items[done : done + count]:
            record = record.put(len(data))
            actions.append(Publish(names.data, data, ITEM, str(record.messages)))
        actions.extend(_both(names.produced, names.producing, record))
        returned = yield Commit(producer.session, tuple(actions))
        if names.data in returned:
            raise QueueDoesNotExistError(names.name)
        producer.record = record
        done += count
    return done


def close(producer: Producer) -> Flow[None]:
    names = producer.names
    if producer.record.closed:
        raise QueueClosedError(names.name, "it was closed before; a queue closes only once")
    record = replace(producer.record, v=producer.record.v + 1, closed=True)
    returned = yield Commit(
        producer.session,
        (Publish(names.data, b"", CLOSED), *_both(names.produced, names.producing, record)),
    )
    if names.data in returned:
        raise QueueDoesNotExistError(names.name)
    producer.record = record


def kick(producer: Producer, count: int, wait: float | None) -> Flow[int]:
    """Move up to ``count`` dead items back to the tail of the queue; returns how many moved."""
    names = producer.names
    if producer.record.closed:
        raise QueueClosedError(names.name, "items cannot be kicked back into a closed queue")
    moved = 0
    while moved < count:
        item = yield Take(producer.session, names.dead, 0)
        if item is GONE:
            raise QueueDoesNotExistError(names.name)
        if item is None:
            break
        assert isinstance(item, Delivery)
        actions: list[Action] = [Ack(item.tag)]
        if producer.bounded:
            credit = yield Take(producer.session, names.space, wait, stream=True)
            if credit is None or credit is GONE:
                yield Commit(producer.session, (Reject(item.tag),))
                if credit is GONE:
                    raise QueueDoesNotExistError(names.name)
                break
            actions.append(Ack(credit.tag))
        kicks = int(item.headers.get(KICKS_HEADER, 0)) + 1
        headers = {KICKS_HEADER: kicks}
        # A new id, so the attempts record of its earlier life does not count against it.
        message_id = f"{item.message_id}~{kicks}"
        actions.append(Publish(names.data, item.body, ITEM, message_id, headers))
        returned = yield Commit(producer.session, tuple(actions))
        if names.data in returned:
            raise QueueDoesNotExistError(names.name)
        moved += 1
    return moved


# --------------------------------------------------------------------------------------------
# The consumer role
# --------------------------------------------------------------------------------------------


@dataclass
class Consumer:
    """What a consumer-role holder knows; only it writes the consumer and attempts records."""

    names: PressureNames
    session: Any
    record: ConsumerRecord
    bounded: bool
    attempts: Attempts | None = None
    #: Items on quorum queues: see :func:`_put_back`.
    replicated: bool = False
    #: A second session, where credits are given back (see :func:`_return_credit`).
    payer: Any = None
    credited: CreditRecord = field(default_factory=CreditRecord)

    @property
    def sessions(self) -> tuple[Any, ...]:
        return (self.session, self.payer) if self.payer is not None else (self.session,)


def start_consumer(names: PressureNames, holder_id: str, policy: Policy) -> Flow[Consumer]:
    yield from require(names)
    record = yield from read_record(names, names.consuming, ConsumerRecord, policy)
    # Only for what never changes (bound, replicated): any copy will do.
    produced = yield from read_record(names, names.produced, ProducerRecord, policy)
    bounded = produced.bound > 0
    credited = CreditRecord()
    if bounded:
        credited = yield from read_record(names, names.credited, CreditRecord, policy)
    session = yield from _open(names)
    consumer = Consumer(names, session, record, bounded, replicated=produced.replicated)
    try:
        consumer.record = replace(record, v=record.v + 1, id=holder_id)
        yield Commit(session, _both(names.consumed, names.consuming, consumer.record))
        if bounded:
            consumer.payer = yield from _open(names)
            consumer.credited = credited
            # Credits of items acknowledged by a consumer that died before giving them back.
            yield from _return_credit(consumer, wait=True)
    except AmqpLocksError:
        yield from stop(consumer)
        raise
    return consumer


def _return_credit(consumer: Consumer, *, wait: bool = False) -> Flow[None]:
    """Give back the credits of every item whose acknowledgement was committed.

    Never in the transaction of the acknowledgement: ``tx.commit`` routes a transaction's
    publishes before it applies its acks, so a producer waiting for the credit could publish
    while the acknowledged item still counts, and the broker would hold bound + 1 items for a
    moment. So credits go out on a second session (the payer), after the acknowledgement's
    Commit-Ok, each with the running total of credits given back (``B:stats:credited``); the
    consumer record counts the acknowledged items. What is owed is always recomputed from the
    two records, ``messages + dead - paid``: a payment that never went out (the consumer died,
    or its flow was cut off between the two commits) is made by the next one, or by the next
    consumer.

    The payer's commit is not waited for: the consumer's next get overlaps it (a session
    cannot send anything while its own commit is unanswered).
    """
    names = consumer.names
    record = consumer.record
    owed = record.messages + record.dead - consumer.credited.paid
    if owed <= 0:
        return
    paid = replace(consumer.credited, v=consumer.credited.v + 1, paid=consumer.credited.paid + owed)
    credits = tuple(Publish(names.space, b"") for _ in range(owed))
    yield Commit(consumer.payer, (*credits, Publish(names.credited, paid.encode())), wait=wait)
    consumer.credited = paid


def _attempts(consumer: Consumer, policy: Policy) -> Flow[Attempts]:
    if consumer.attempts is None:
        names = consumer.names
        consumer.attempts = yield from read_record(names, names.attempts, Attempts, policy)
    return consumer.attempts


def _counted(item: Delivery, attempts: Attempts) -> int:
    """Deliveries of ``item`` counted before this one.

    A first delivery has none. A redelivered item had at least one (its consumer died or gave
    it back); the attempts record knows more when it names this item.
    """
    if not item.redelivered:
        return 0
    return attempts.deliveries if attempts.message == item.message_id else 1


def _drained(names: PressureNames) -> QueueClosedError:
    return QueueClosedError(names.name, "it was closed and every item put before was taken")


def take(
    consumer: Consumer, wait: float | None, policy: Policy, clock: Clock
) -> Flow[Delivery | None]:
    """The next item, unacknowledged (None: none within ``wait``); poison items are moved to
    the dead-letter queue on the way."""
    names = consumer.names
    deadline = None if wait is None else clock() + wait
    while True:
        left = None if deadline is None else max(deadline - clock(), 0.0)
        item = yield Take(consumer.session, names.data, left, False, consumer.replicated)
        if item is GONE:
            raise QueueDoesNotExistError(names.name)
        if item is None:
            return None
        assert isinstance(item, Delivery)
        if item.kind == CLOSED:
            # Back to the head, for every later consumer to find.
            yield Commit(consumer.session, (Reject(item.tag),))
            raise _drained(names)
        if not item.redelivered:
            return item
        attempts = yield from _attempts(consumer, policy)
        deliveries = _counted(item, attempts) + 1
        if attempts.limit is not None and deliveries > attempts.limit:
            yield from _bury(consumer, item, deliveries - 1)
            continue
        consumer.attempts = attempts.counting(item.message_id, deliveries)
        # Durable before the caller sees the item: if this delivery kills the consumer, the
        # next one counts it.
        yield Commit(consumer.session, (Publish(names.attempts, consumer.attempts.encode()),))
        return item


def _bury(consumer: Consumer, item: Delivery, deliveries: int) -> Flow[None]:
    names = consumer.names
    assert consumer.attempts is not None
    consumer.attempts = consumer.attempts.counting(None, 0)
    record = replace(consumer.record, v=consumer.record.v + 1, dead=consumer.record.dead + 1)
    headers = {**item.headers, DELIVERIES_HEADER: deliveries}
    yield Commit(
        consumer.session,
        (
            Ack(item.tag),
            Publish(names.dead, item.body, ITEM, item.message_id, headers),
            *_both(names.consumed, names.consuming, record),
            Publish(names.attempts, consumer.attempts.encode()),
        ),
    )
    consumer.record = record
    if consumer.bounded:
        yield from _return_credit(consumer)


def _put_back(consumer: Consumer, item: Delivery, actions: tuple[Action, ...] = ()) -> Flow[None]:
    """Commit ``actions`` and put ``item`` back at the head of the queue.

    A classic queue requeues a rejected message at its place. A quorum queue requeues it at
    the tail (RabbitMQ 3.10, checked: ``basic.reject`` and ``basic.nack`` alike), which would
    break FIFO; it returns the unacknowledged messages of a closed channel to the head, so
    there the session's channel is closed and a fresh one replaces it.
    """
    if not consumer.replicated:
        yield Commit(consumer.session, (Reject(item.tag), *actions))
        return
    if actions:
        yield Commit(consumer.session, actions)
    yield CloseSession(consumer.session)
    consumer.session = yield from _open(consumer.names)


def settle(consumer: Consumer, item: Delivery, done: bool) -> Flow[None]:
    """Acknowledge ``item`` (done: it leaves the queue, a credit comes back) or put it back at
    the head (its next delivery counts as a redelivery)."""
    names = consumer.names
    if not done:
        yield from _put_back(consumer, item)
        return
    record = consumer.record.got(len(item.body))
    yield Commit(consumer.session, (Ack(item.tag), *_both(names.consumed, names.consuming, record)))
    consumer.record = record
    if consumer.bounded:
        yield from _return_credit(consumer)


def get_many(
    consumer: Consumer, most: int, wait: float | None, policy: Policy, clock: Clock
) -> Flow[list[bytes]]:
    """Up to ``most`` items, removed in one transaction: waits up to ``wait`` s for the first,
    then takes only what is there already. An empty list: nothing came in time."""
    first = yield from take(consumer, wait, policy, clock)
    if first is None:
        return []
    taken = [first]
    while len(taken) < min(most, MAX_BATCH):
        try:
            item = yield from take(consumer, 0.0, policy, clock)
        except QueueClosedError:
            break  # the end marker, back at the head: the items before it are ours
        if item is None:
            break
        taken.append(item)
    names = consumer.names
    record = consumer.record
    for item in taken:
        record = record.got(len(item.body))
    acks = tuple(Ack(item.tag) for item in taken)
    yield Commit(consumer.session, (*acks, *_both(names.consumed, names.consuming, record)))
    consumer.record = record
    if consumer.bounded:
        yield from _return_credit(consumer)
    return [item.body for item in taken]


def get(consumer: Consumer, wait: float | None, policy: Policy, clock: Clock) -> Flow[bytes | None]:
    item = yield from take(consumer, wait, policy, clock)
    if item is None:
        return None
    yield from settle(consumer, item, True)
    return item.body


def peek(consumer: Consumer, policy: Policy) -> Flow[bytes | None]:
    """The oldest item, left in place (None when empty; QueueClosedError once drained)."""
    names = consumer.names
    item = yield Take(consumer.session, names.data, 0, False, consumer.replicated)
    if item is GONE:
        raise QueueDoesNotExistError(names.name)
    if item is None:
        return None
    assert isinstance(item, Delivery)
    if item.kind == CLOSED:
        yield Commit(consumer.session, (Reject(item.tag),))
        raise _drained(names)
    attempts = yield from _attempts(consumer, policy)
    # Putting it back marks it redelivered; record that this look was no delivery.
    consumer.attempts = attempts.counting(item.message_id, _counted(item, attempts))
    yield from _put_back(consumer, item, (Publish(names.attempts, consumer.attempts.encode()),))
    return item.body


def stop(role: Producer | Consumer, *, pay: bool = True) -> Flow[None]:
    """Close the role holder's sessions (what they hold goes back; a credit payment in
    flight is answered first). A consumer first pays any credit still owed (``pay``)."""
    if pay and isinstance(role, Consumer) and role.bounded and role.payer is not None:
        yield from _return_credit(role, wait=True)
    for session in reversed(role.sessions):
        yield CloseSession(session)
