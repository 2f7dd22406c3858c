"""How a semaphore name maps to RabbitMQ queue names.

Given the base name ``N`` (namespace prefix + name) and slot ``k >= 1``:

* ``N-k-A`` — slot queue ("A"), durable, exists while slot k exists;
* ``N-k-B`` — holder queue ("B"), exclusive, exists while some connection holds slot k;
* ``N``     — admin mutex, exclusive, held while an administrator changes the semaphore;
* ``N-0-W`` — wake queue, durable, carries one token per release to exactly one waiter.

The mapping must be injective across *all* semaphores, or one semaphore's admin mutex could
be another's slot. Every derived name ends in ``-<digits>-<capital letter>``, so base names
ending that way are rejected; then no admin name equals a derived name, and derived names of
two different bases differ because the suffix is parsed back unambiguously.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import InvalidArgumentError, InvalidNameError

__all__ = ["MAX_SLOTS", "SemaphoreNames", "check_count"]

#: Largest slot number supported; bounds the suffix length when validating names.
MAX_SLOTS = 100_000

_MAX_QUEUE_NAME_BYTES = 255
_RESERVED_SUFFIX = re.compile(r"-[0-9]+-[A-Z]\Z")
_LONGEST_SUFFIX = f"-{MAX_SLOTS}-B"


def check_count(value: object, what: str, *, minimum: int = 1) -> int:
    """Validate a slot count or slot number given by the caller."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{what} must be an int, got {type(value).__name__}")
    if value < minimum or value > MAX_SLOTS:
        raise InvalidArgumentError(f"{what} must be between {minimum} and {MAX_SLOTS}, got {value}")
    return value


@dataclass(frozen=True)
class SemaphoreNames:
    """The queue names of one semaphore. Build with :meth:`of`, which validates."""

    base: str

    @classmethod
    def of(cls, name: object, namespace: object = "") -> SemaphoreNames:
        if not isinstance(name, str):
            raise InvalidNameError(f"semaphore name must be a str, got {type(name).__name__}")
        if namespace is None:
            namespace = ""
        if not isinstance(namespace, str):
            raise InvalidNameError(f"namespace must be a str, got {type(namespace).__name__}")
        if not name:
            raise InvalidNameError("semaphore name must not be empty")
        base = namespace + name
        if base.startswith("amq."):
            raise InvalidNameError(
                f"semaphore name {base!r} starts with 'amq.', which RabbitMQ reserves"
            )
        if any(ord(c) < 32 or ord(c) == 127 for c in base):
            raise InvalidNameError(f"semaphore name {base!r} contains control characters")
        if _RESERVED_SUFFIX.search(base):
            raise InvalidNameError(
                f"semaphore name {base!r} ends like a slot queue ('-<digits>-<capital>'); such "
                "names could collide with another semaphore's queues — rename it"
            )
        size = len((base + _LONGEST_SUFFIX).encode())
        if size > _MAX_QUEUE_NAME_BYTES:
            room = _MAX_QUEUE_NAME_BYTES - len(_LONGEST_SUFFIX)
            raise InvalidNameError(
                f"semaphore name is {len(base.encode())} bytes of UTF-8 (namespace included); "
                f"at most {room} fit in a RabbitMQ queue name once suffixed"
            )
        return cls(base)

    @property
    def admin(self) -> str:
        return self.base

    @property
    def wake(self) -> str:
        return f"{self.base}-0-W"

    def slot(self, k: int) -> str:
        return f"{self.base}-{k}-A"

    def holder(self, k: int) -> str:
        return f"{self.base}-{k}-B"
