"""The sync face of semaphore administration."""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

from .. import _flows
from .._common import SemaphorePlan, adopt_connection, holder_thread_id, make_policy
from .._config import check_timeout
from .connection import Connection

__all__ = ["SemaphoreAdmin"]


class SemaphoreAdmin:
    """Create, resize and destroy one semaphore, following the spec's admin rules.

    ::

        with SemaphoreAdmin("reports", url=url) as admin:
            admin.ensure(3)                 # create, or resize to 3
            admin.remove(1, wait=True)      # returns when the holder of slot 3 let go
            count, held = admin.slots(), admin.held()

    Guarantees:

    * Every change holds the semaphore's admin mutex (an exclusive queue), so concurrent
      administrators — on any host — serialise; one that cannot get it within
      ``admin_attempts`` jittered retries raises :class:`~amqp_locks.errors.AdminBusyError`.
    * Slots are added in ascending order and removed in descending order, each delete
      confirmed before the next, so A queues stay contiguous even if an admin dies midway.
    * Every change also scans ``overshoot`` slots past the count and deletes stray A queues
      it finds (left by manual deletions or crashed admins).

    Not guaranteed: removing a slot does not stop its holder. Use ``wait=True`` (or
    :meth:`wait_released`) to wait until holders of removed slots let go; the holders' own
    leases learn of the removal at their next verification (``lease.held`` turns False).
    Read-only calls (``exists``, ``slots``, ``held``) take no mutex.
    """

    def __init__(
        self,
        name: str,
        url: str | None = None,
        *,
        namespace: str | None = None,
        connection: Connection | None = None,
        heartbeat: int = 10,
        connect_timeout: float = 5.0,
        client_id: str | None = None,
        overshoot: int = 8,
        admin_attempts: int = 100,
    ) -> None:
        self._plan = SemaphorePlan(
            name, namespace, make_policy(overshoot=overshoot, admin_attempts=admin_attempts)
        )
        self.connection, self._owns_connection = adopt_connection(
            connection,
            url,
            Connection,
            lambda: Connection(
                url, heartbeat=heartbeat, connect_timeout=connect_timeout, client_id=client_id
            ),
        )

    @property
    def name(self) -> str:
        return self._plan.name

    def _holder(self) -> str:
        return holder_thread_id(self.connection.client_id) + ":admin"

    def _change(self, flow: _flows.Flow[_flows.Resized], wait: bool, timeout: float | None) -> int:
        outcome, _ = self.connection._run(flow)
        after = self._plan.resized(outcome)
        if wait:
            self.connection._run(self._plan.removal_wait(outcome, timeout))
        return after

    def create(self, slots: int) -> int:
        """Create the semaphore with ``slots`` slots; SemaphoreExistsError if it exists."""
        return self._change(self._plan.create(self._holder(), slots), False, None)

    def ensure(self, slots: int) -> int:
        """Create the semaphore, or resize it to ``slots``. Idempotent. Returns ``slots``."""
        return self._change(self._plan.ensure(self._holder(), slots), False, None)

    def exists(self) -> bool:
        """True if slot 1 exists."""
        return self.connection._run(self._plan.exists())[0]

    def slots(self) -> int:
        """The current number of slots (0 if the semaphore does not exist)."""
        return self.connection._run(self._plan.count())[0]

    def add(self, slots: int) -> int:
        """Add ``slots`` slots (waking that many waiters); returns the new count."""
        return self._change(self._plan.add(self._holder(), slots), False, None)

    def remove(self, slots: int, wait: bool = False, timeout: float | None = None) -> int:
        """Remove the ``slots`` highest slots (down to 0); returns the new count.

        With ``wait=True``, then wait until their holders let go, up to ``timeout`` seconds
        (:class:`~amqp_locks.errors.ReleaseTimeoutError` after it; the removal stays done).
        """
        seconds = check_timeout(timeout)
        return self._change(self._plan.remove(self._holder(), slots), wait, seconds)

    def resize(self, slots: int, wait: bool = False, timeout: float | None = None) -> int:
        """Set the count to ``slots`` (the semaphore must exist); ``wait`` as for remove."""
        seconds = check_timeout(timeout)
        return self._change(self._plan.resize(self._holder(), slots), wait, seconds)

    def held(self) -> list[int]:
        """Sorted slot numbers that have a holder now (removed slots' holders included)."""
        return list(self.connection._run(self._plan.held())[0])

    def wait_released(
        self, slots: Iterable[int] | None = None, timeout: float | None = None
    ) -> bool:
        """Wait until the holders of ``slots`` let go; True, or False on timeout.

        ``slots=None`` means the slots above the current count: those this object removed,
        and any held within ``overshoot`` of the count.
        """
        return self.connection._run(self._plan.wait_released(slots, timeout))[0]

    def destroy(self, wait: bool = False, timeout: float | None = None) -> None:
        """Delete every slot (descending) and the wake queue. A missing semaphore is a no-op.

        Holders keep running until they let go; ``wait=True`` waits for them.
        """
        seconds = check_timeout(timeout)
        self._change(self._plan.destroy(self._holder()), wait, seconds)

    def close(self) -> None:
        if self._owns_connection:
            self.connection.close()

    def __enter__(self) -> SemaphoreAdmin:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SemaphoreAdmin {self.name!r}>"
