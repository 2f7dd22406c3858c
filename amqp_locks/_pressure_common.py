"""What the sync and async pressure-queue faces share: validation, role bookkeeping, the
translation of semaphore outcomes into queue errors. Nothing here does I/O."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from . import _pressure as P
from ._config import check_timeout
from .errors import (
    AcquireTimeoutError,
    InvalidArgumentError,
    LockLostError,
    OperationTimeoutError,
    QueueDoesNotExistError,
    QueueFullError,
    SemaphoreNotFoundError,
)


def resolve_prefix(prefix: str | None) -> str:
    """The key prefix: the argument, else ``$PRESSURE_PREFIX``, else ``__pressure__``."""
    if prefix is not None:
        return prefix
    return os.environ.get("PRESSURE_PREFIX", P.DEFAULT_PREFIX)


class Deadline:
    """One timeout shared by the steps of an operation (role wait, then room or item wait)."""

    def __init__(self, timeout: object, what: str = "timeout") -> None:
        self.timeout = check_timeout(timeout, what)
        self._end = None if self.timeout is None else time.monotonic() + self.timeout

    def left(self) -> float | None:
        if self._end is None:
            return None
        return max(self._end - time.monotonic(), 0.0)

    @contextlib.contextmanager
    def overall(self) -> Iterator[None]:
        """Report a timeout of any step as one of the whole operation's timeout."""
        try:
            yield
        except OperationTimeoutError as exc:
            if self.timeout is None or exc.timeout == self.timeout:
                raise
            raise OperationTimeoutError(exc.queue, exc.what, self.timeout, done=exc.done) from None


def role_error(names: P.PressureNames, role: str, what: str, exc: BaseException) -> BaseException:
    """A semaphore error met while taking a role, as the queue error it means."""
    if isinstance(exc, SemaphoreNotFoundError):
        return QueueDoesNotExistError(names.name)
    if isinstance(exc, AcquireTimeoutError):
        return OperationTimeoutError(
            names.name, f"{what} (waiting for the {role} role)", exc.timeout
        )
    return exc


def role_lost(names: P.PressureNames, role: str, reason: str | None) -> LockLostError:
    return LockLostError(f"{names.name} ({role} role)", 1, reason or "the role's lease was lost")


@dataclass(frozen=True)
class Stats:
    produced_messages: int
    produced_bytes: int
    consumed_messages: int
    consumed_bytes: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def stats(records: tuple[P.ProducerRecord, P.ConsumerRecord]) -> dict[str, int]:
    produced, consumed = records
    return Stats(produced.messages, produced.nbytes, consumed.messages, consumed.nbytes).as_dict()


def check_client_id(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value):
        return value
    raise InvalidArgumentError(f"client_id must be a non-empty str or None, got {value!r}")


# --------------------------------------------------------------------------------------------
# The operations of the faces, written once: each function checks its arguments at once (no
# I/O yet) and returns the flow whose result is the public method's result, with "no room" or
# "no item in time" already turned into the error the method raises. Faces only run them.
# --------------------------------------------------------------------------------------------


def create(
    names: P.PressureNames,
    policy: P.Policy,
    holder: str,
    bound: object,
    replicated: object,
    delivery_limit: object,
) -> P.Flow[None]:
    checked_bound = P.check_bound(bound)
    limit = P.check_limit(delivery_limit)
    if not isinstance(replicated, bool):
        raise TypeError(f"replicated must be a bool, got {type(replicated).__name__}")
    return P.create(
        names,
        bound=checked_bound,
        replicated=replicated,
        delivery_limit=limit,
        holder_id=holder,
        policy=policy,
    )


def read_stats(names: P.PressureNames, policy: P.Policy) -> P.Flow[dict[str, int]]:
    return stats((yield from P.records(names, policy)))


def put(producer: P.Producer, data: object, timeout: object) -> P.Flow[None]:
    body = P.check_data(data)
    wait = check_timeout(timeout)

    def flow() -> P.Flow[None]:
        if not (yield from P.put(producer, body, wait)):
            assert wait is not None
            raise OperationTimeoutError(producer.names.name, "put (waiting for room)", wait)

    return flow()


def put_nowait(producer: P.Producer, data: object) -> P.Flow[None]:
    body = P.check_data(data)

    def flow() -> P.Flow[None]:
        if not (yield from P.put(producer, body, 0.0)):
            raise QueueFullError(producer.names.name, producer.record.bound)

    return flow()


def put_many(producer: P.Producer, items: Iterable[object], timeout: object) -> P.Flow[None]:
    bodies = [P.check_data(item) for item in items]
    wait = check_timeout(timeout)

    def flow() -> P.Flow[None]:
        done = yield from P.put_many(producer, bodies, wait, time.monotonic)
        if done < len(bodies):
            assert wait is not None
            raise OperationTimeoutError(
                producer.names.name,
                f"put_many of {len(bodies)} items (waiting for room)",
                wait,
                done=done,
            )

    return flow()


def kick(producer: P.Producer, count: object, timeout: object) -> P.Flow[int]:
    return P.kick(producer, P.check_count(count, "count"), check_timeout(timeout))


def take(consumer: P.Consumer, policy: P.Policy, timeout: object, what: str) -> P.Flow[P.Delivery]:
    """The oldest item, unacknowledged (for ``receive``), or OperationTimeoutError."""
    wait = check_timeout(timeout)

    def flow() -> P.Flow[P.Delivery]:
        item = yield from P.take(consumer, wait, policy, time.monotonic)
        if item is None:
            assert wait is not None
            raise OperationTimeoutError(consumer.names.name, what, wait)
        return item

    return flow()


def get(consumer: P.Consumer, policy: P.Policy, timeout: object) -> P.Flow[bytes]:
    wait = check_timeout(timeout)

    def flow() -> P.Flow[bytes]:
        item = yield from P.get(consumer, wait, policy, time.monotonic)
        if item is None:
            assert wait is not None
            raise OperationTimeoutError(consumer.names.name, "get (waiting for an item)", wait)
        return item

    return flow()


def get_nowait(consumer: P.Consumer, policy: P.Policy) -> P.Flow[bytes | None]:
    return P.get(consumer, 0.0, policy, time.monotonic)


def get_many(
    consumer: P.Consumer, policy: P.Policy, most: object, timeout: object
) -> P.Flow[list[bytes]]:
    n = P.check_count(most, "most")
    if n == 0:
        raise InvalidArgumentError("most must be at least 1")
    wait = check_timeout(timeout)

    def flow() -> P.Flow[list[bytes]]:
        items = yield from P.get_many(consumer, n, wait, policy, time.monotonic)
        if not items:
            assert wait is not None
            raise OperationTimeoutError(consumer.names.name, "get_many", wait)
        return items

    return flow()
