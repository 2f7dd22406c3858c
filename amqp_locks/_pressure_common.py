"""What the sync and async pressure-queue faces share: validation, role bookkeeping, the
translation of semaphore outcomes into queue errors. Nothing here does I/O."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
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
    SemaphoreNotFoundError,
)

ROLES = ("producer", "consumer")


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


def holder_id(client_id: str | None, connection_id: str) -> str:
    """The id recorded for a role holder: ``client_id``, else ``host:pid:thread``."""
    if client_id is not None:
        return client_id
    return f"{connection_id}:{threading.current_thread().name}"


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
