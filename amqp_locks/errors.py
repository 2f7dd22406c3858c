"""Every error amqp_locks raises, in one tree.

Errors split by whose fault they are (the habit is h11's): the caller's mistakes, outcomes of
contention that a correct program must expect, and faults of the broker or the network::

    AmqpLocksError
    ├── InvalidArgumentError (also ValueError)   the caller passed a bad value
    │   └── InvalidNameError                     a semaphore name that cannot be mapped to queues
    ├── ClosedError                              the Semaphore/Connection was closed
    ├── SemaphoreNotFoundError                   no A queues: the semaphore does not exist
    ├── SemaphoreExistsError                     create() on a semaphore that exists
    ├── AcquireTimeoutError (also TimeoutError)  no slot became free in time
    ├── ReleaseTimeoutError (also TimeoutError)  holders of removed slots kept them too long
    ├── ContentionError                          acquire lost too many declare races in a row
    ├── AdminBusyError                           another administrator kept the admin mutex
    ├── LockLostError                            a held lease stopped being held
    ├── PressureError                            pressure queues (amqp_locks.PressureQueue)
    │   ├── QueueDoesNotExistError               no such queue (never created, or deleted)
    │   ├── QueueAlreadyExistsError              create() on a queue that exists
    │   ├── QueueInUseError                      another client holds the producer/consumer role
    │   ├── QueueFullError                       put_nowait() on a full queue
    │   ├── QueueClosedError                     put after close; get once closed and drained
    │   └── OperationTimeoutError (also TimeoutError) a blocking queue operation timed out
    └── BrokerError                              the broker or the network failed us
        ├── BrokerUnavailableError               cannot connect, or the connection died
        ├── BrokerTimeoutError (also TimeoutError) the broker did not answer in time
        ├── QueueMismatchError                   a queue exists with other arguments (406)
        ├── AccessRefusedError                   the user may not do this (403)
        └── ProbeNackedError                     the broker nacked an existence probe

Every message says what happened and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "AccessRefusedError",
    "AcquireTimeoutError",
    "AdminBusyError",
    "AmqpLocksError",
    "BrokerError",
    "BrokerTimeoutError",
    "BrokerUnavailableError",
    "ClosedError",
    "ContentionError",
    "InvalidArgumentError",
    "InvalidNameError",
    "LockLostError",
    "OperationTimeoutError",
    "PressureError",
    "ProbeNackedError",
    "QueueAlreadyExistsError",
    "QueueClosedError",
    "QueueDoesNotExistError",
    "QueueFullError",
    "QueueInUseError",
    "QueueMismatchError",
    "ReleaseTimeoutError",
    "SemaphoreExistsError",
    "SemaphoreNotFoundError",
]


class AmqpLocksError(Exception):
    """Base class of every error raised by amqp_locks."""


class InvalidArgumentError(AmqpLocksError, ValueError):
    """A value passed by the caller is out of range or of the wrong type."""


class InvalidNameError(InvalidArgumentError):
    """A semaphore name that cannot be mapped to RabbitMQ queue names unambiguously."""


class ClosedError(AmqpLocksError):
    """The object was closed; create a new one."""


class SemaphoreNotFoundError(AmqpLocksError):
    """The semaphore has no slots (its first A queue is missing).

    Distinct from "all slots busy": nobody will ever release a slot of a semaphore that does
    not exist, so waiting would be pointless.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"semaphore {name!r} does not exist (no slot queue {name}-1-A); create it first "
            f"with SemaphoreAdmin({name!r}).create(n) or `amqp-locks create`"
        )


class SemaphoreExistsError(AmqpLocksError):
    """``create()`` was called for a semaphore that already has slots."""

    def __init__(self, name: str, slots: int) -> None:
        self.name = name
        self.slots = slots
        super().__init__(
            f"semaphore {name!r} already exists with {slots} slot(s); to set its size "
            "whether or not it exists, use ensure (SemaphoreAdmin.ensure() or "
            "`amqp-locks ensure`), or resize it"
        )


class AcquireTimeoutError(AmqpLocksError, TimeoutError):
    """No slot became free before the timeout passed."""

    def __init__(self, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = timeout
        super().__init__(
            f"no slot of semaphore {name!r} became free within {timeout:g} s; "
            "retry later, raise the timeout, or add slots"
        )


class ReleaseTimeoutError(AmqpLocksError, TimeoutError):
    """Holders of removed slots did not let go before the timeout passed.

    The removal itself is done; only the wait for the holders of removed slots gave up.
    """

    def __init__(self, name: str, slots: tuple[int, ...], timeout: float) -> None:
        self.name = name
        self.slots = slots
        self.timeout = timeout
        super().__init__(
            f"slots {list(slots)} of semaphore {name!r} are still held {timeout:g} s after "
            "their removal; their holders must release them (or exit) — wait again with "
            "wait_released()"
        )


class ContentionError(AmqpLocksError):
    """Acquire lost the declare race (RESOURCE_LOCKED) too many times in a row.

    The spec bounds these retries because two clients can in theory keep colliding forever.
    """

    def __init__(self, name: str, attempts: int) -> None:
        self.name = name
        self.attempts = attempts
        super().__init__(
            f"gave up acquiring semaphore {name!r} after {attempts} lost races for a free slot; "
            "the semaphore is heavily contended: retry, or raise max_collisions"
        )


class AdminBusyError(AmqpLocksError):
    """Another administrator held the semaphore's admin mutex for too long."""

    def __init__(self, name: str, attempts: int) -> None:
        self.name = name
        self.attempts = attempts
        super().__init__(
            f"the admin mutex of semaphore {name!r} stayed held by another client through "
            f"{attempts} attempts; another admin operation is running — retry later"
        )


class LockLostError(AmqpLocksError):
    """A lease that was held is no longer held.

    Raised when leaving a ``with lease:`` block whose lease was lost meanwhile: the connection
    died (network cut, broker restart, missed heartbeats) or the slot was removed by an admin.
    The work done inside the block was not protected for its whole duration.
    """

    def __init__(self, name: str, slot: int, reason: str) -> None:
        self.name = name
        self.slot = slot
        self.reason = reason
        super().__init__(
            f"lost slot {slot} of semaphore {name!r}: {reason}; the protected work may have "
            "overlapped with another holder — make it idempotent or check lease.held"
        )


class PressureError(AmqpLocksError):
    """Base class of the errors of pressure queues; ``queue`` is the queue's name."""

    def __init__(self, queue: str, message: str) -> None:
        self.queue = queue
        super().__init__(message)


class QueueDoesNotExistError(PressureError):
    """The pressure queue does not exist: it was never created, or it was deleted."""

    def __init__(self, queue: str) -> None:
        super().__init__(
            queue,
            f"pressure queue {queue!r} does not exist (never created, or deleted); create it "
            f"with PressureQueue({queue!r}).create(bound)",
        )


class QueueAlreadyExistsError(PressureError):
    """``create()`` was called for a pressure queue that exists."""

    def __init__(self, queue: str) -> None:
        super().__init__(
            queue,
            f"pressure queue {queue!r} already exists; use it as it is, or delete() it first",
        )


class QueueInUseError(PressureError):
    """Another client holds the role (producer or consumer) that a non-blocking call needs."""

    def __init__(self, queue: str, role: str, holder: str | None = None) -> None:
        self.role = role
        self.holder = holder
        who = f" ({holder})" if holder else ""
        super().__init__(
            queue,
            f"another client{who} is the {role} of pressure queue {queue!r}; queues have one "
            f"{role} at a time — use the blocking call, or retry later",
        )


class QueueFullError(PressureError):
    """``put_nowait()`` found the queue at its bound."""

    def __init__(self, queue: str, bound: int | None = None) -> None:
        self.bound = bound
        at = f" (bound {bound})" if bound else ""
        super().__init__(
            queue,
            f"pressure queue {queue!r} is full{at}; put() waits for room, or retry once a "
            "consumer has taken items",
        )


class QueueClosedError(PressureError):
    """The queue is closed: no more puts; gets fail once what was put before is drained."""

    def __init__(self, queue: str, detail: str) -> None:
        super().__init__(queue, f"pressure queue {queue!r} is closed: {detail}")


class OperationTimeoutError(PressureError, TimeoutError):
    """A blocking pressure-queue operation did not complete within its timeout.

    Nothing was put or taken, except by ``put_many``: its first ``done`` items were put.
    """

    def __init__(self, queue: str, what: str, timeout: float, *, done: int | None = None) -> None:
        self.what = what
        self.timeout = timeout
        #: put_many: how many of the items (the first ones) were put before the time ran out.
        self.done = done or 0
        outcome = (
            "nothing was put or taken — retry"
            if not done
            else f"the first {done} items were put — put the rest again"
        )
        super().__init__(
            queue,
            f"{what} on pressure queue {queue!r} did not complete within {timeout:g} s; "
            f"{outcome}, or raise the timeout",
        )


class BrokerError(AmqpLocksError):
    """The broker or the network failed."""


class BrokerUnavailableError(BrokerError):
    """The broker cannot be reached, or the connection to it died during an operation."""


class BrokerTimeoutError(BrokerError, TimeoutError):
    """The broker did not answer an operation in time (overloaded, blocked, or unreachable)."""


class QueueMismatchError(BrokerError):
    """A queue exists with arguments other than the ones amqp_locks declares (406)."""

    def __init__(self, queue: str, detail: str) -> None:
        self.queue = queue
        super().__init__(
            f"queue {queue!r} already exists with different properties ({detail}); it was "
            "not created by amqp_locks or by a compatible version — delete it or pick "
            "another semaphore name"
        )


class AccessRefusedError(BrokerError):
    """The broker refused the operation for lack of permissions (403)."""


class ProbeNackedError(BrokerError):
    """The broker nacked an existence probe: the answer is unknown, not "missing"."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        super().__init__(
            f"the broker nacked the existence probe of queue {queue!r} (internal error, or a "
            "queue with x-overflow=reject-publish); the queue state is unknown — retry"
        )
