"""What the sync and async faces share above the drivers: argument checking, which flow each
public method runs, and the state of a lease. Nothing here does I/O."""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from . import _flows
from ._config import check_timeout
from ._naming import MAX_SLOTS, SemaphoreNames, check_count
from .errors import InvalidArgumentError, LockLostError, ReleaseTimeoutError

log = logging.getLogger("amqp_locks")
T = TypeVar("T")
L = TypeVar("L")


def make_policy(
    *,
    overshoot: int = 8,
    poll_interval: float = 1.0,
    max_collisions: int = 64,
    admin_attempts: int = 100,
) -> _flows.Policy:
    check_count(overshoot, "overshoot", minimum=0)
    check_count(max_collisions, "max_collisions")
    check_count(admin_attempts, "admin_attempts")
    if isinstance(poll_interval, bool) or not isinstance(poll_interval, (int, float)):
        raise InvalidArgumentError(f"poll_interval must be a number, got {poll_interval!r}")
    if not 0 < poll_interval <= 3600:
        raise InvalidArgumentError(f"poll_interval must be in (0, 3600] s, got {poll_interval}")
    return _flows.Policy(
        overshoot=overshoot,
        poll_interval=float(poll_interval),
        max_collisions=max_collisions,
        admin_attempts=admin_attempts,
    )


class SemaphorePlan:
    """Which flow each public method runs, for one semaphore name; shared by both faces."""

    def __init__(self, name: object, namespace: object, policy: _flows.Policy) -> None:
        self.names = SemaphoreNames.of(name, namespace)
        self.policy = policy
        # Last slot count seen: the next acquire probes that many slots in its first round
        # trip. Racy updates are harmless: it is only a hint.
        self.hint = 0
        # Slot to declare without probing on the next acquire, while the semaphore looks idle.
        self.speculate: int | None = None
        # Did our last acquire wait or lose a race? When did we last release a slot?
        self.contended = False
        self.released_at = -math.inf
        # Slots this admin object removed: the default of wait_released().
        self.removed: set[int] = set()

    @property
    def name(self) -> str:
        return self.names.base

    # -- clients ------------------------------------------------------------------------------

    def acquire(
        self, holder_id: str, *, blocking: bool, timeout: object
    ) -> _flows.Flow[_flows.Acquired]:
        return _flows.acquire(
            self.names,
            holder_id=holder_id,
            policy=self.policy,
            clock=time.monotonic,
            rng=random.random,
            blocking=blocking,
            timeout=check_timeout(timeout),
            hint=self.hint,
            speculate=self.speculate,
            defer=self._defer() if blocking else 0.0,
        )

    def _defer(self) -> float:
        if not self.contended:
            return 0.0
        return max(0.0, self.policy.defer - (time.monotonic() - self.released_at))

    def released(self) -> None:
        self.released_at = time.monotonic()

    def acquired(self, outcome: _flows.Acquired) -> None:
        self.hint = outcome.count
        # Not on a one-slot semaphore (a mutex): there our own release has just woken a
        # waiter, who goes for that very slot, and a guessed declare would only race it.
        self.speculate = outcome.slot if outcome.idle and outcome.count >= 2 else None
        self.contended = bool(outcome.waits or outcome.collisions)

    # -- administration -----------------------------------------------------------------------

    def create(self, holder_id: str, slots: object) -> _flows.Flow[_flows.Resized]:
        n = check_count(slots, "slots")
        return self._resize(holder_id, lambda _: n, must_not_exist=True)

    def ensure(self, holder_id: str, slots: object) -> _flows.Flow[_flows.Resized]:
        n = check_count(slots, "slots")
        return self._resize(holder_id, lambda _: n)

    def add(self, holder_id: str, slots: object) -> _flows.Flow[_flows.Resized]:
        n = check_count(slots, "slots to add")
        return self._resize(holder_id, lambda c: min(c + n, MAX_SLOTS), must_exist=True)

    def remove(self, holder_id: str, slots: object) -> _flows.Flow[_flows.Resized]:
        n = check_count(slots, "slots to remove")
        return self._resize(holder_id, lambda c: max(c - n, 0), must_exist=True)

    def resize(self, holder_id: str, slots: object) -> _flows.Flow[_flows.Resized]:
        n = check_count(slots, "slots")
        return self._resize(holder_id, lambda _: n, must_exist=True)

    def _resize(
        self,
        holder_id: str,
        target: Callable[[int], int],
        *,
        must_exist: bool = False,
        must_not_exist: bool = False,
    ) -> _flows.Flow[_flows.Resized]:
        return _flows.resize(
            self.names,
            holder_id=holder_id,
            policy=self.policy,
            target=target,
            must_exist=must_exist,
            must_not_exist=must_not_exist,
        )

    def destroy(self, holder_id: str) -> _flows.Flow[_flows.Resized]:
        return _flows.destroy(self.names, holder_id=holder_id, policy=self.policy)

    def resized(self, outcome: _flows.Resized) -> int:
        self.removed.update(outcome.removed)
        self.removed.difference_update(range(1, outcome.after + 1))
        log.info(
            "semaphore %r resized from %d to %d slot(s)", self.name, outcome.before, outcome.after
        )
        return outcome.after

    def count(self) -> _flows.Flow[int]:
        scan = yield from _flows.scan_slots(self.names, self.policy, self.hint)
        return scan.count

    def exists(self) -> _flows.Flow[bool]:
        (found,) = yield from _flows.probe((self.names.slot(1),))
        return bool(found)

    def held(self) -> _flows.Flow[tuple[int, ...]]:
        return _flows.held_slots(self.names, self.policy)

    def wait_released(self, slots: Iterable[object] | None, timeout: object) -> _flows.Flow[bool]:
        seconds = check_timeout(timeout)
        chosen: list[int] | None = None
        if slots is not None:
            if isinstance(slots, (str, bytes)) or not isinstance(slots, Iterable):
                raise InvalidArgumentError(f"slots must be an iterable of ints, got {slots!r}")
            chosen = sorted({check_count(k, "slot") for k in slots})
        return self._wait_released(chosen, seconds)

    def _wait_released(self, chosen: list[int] | None, seconds: float | None) -> _flows.Flow[bool]:
        if chosen is None:
            chosen = yield from self._slots_above_count()
        return (
            yield from _flows.wait_released(
                self.names,
                chosen,
                policy=self.policy,
                clock=time.monotonic,
                rng=random.random,
                timeout=seconds,
            )
        )

    def _slots_above_count(self) -> _flows.Flow[list[int]]:
        scan = yield from _flows.scan_slots(self.names, self.policy)
        window = range(scan.count + 1, scan.top + self.policy.overshoot + 1)
        return sorted({k for k in self.removed if k > scan.count} | set(window))

    def removal_wait(self, outcome: _flows.Resized, timeout: float | None) -> _flows.Flow[None]:
        """After remove/resize/destroy with wait=True: wait for holders of removed slots."""
        released = yield from _flows.wait_released(
            self.names,
            list(outcome.removed),
            policy=self.policy,
            clock=time.monotonic,
            rng=random.random,
            timeout=timeout,
        )
        if not released:
            raise ReleaseTimeoutError(self.name, outcome.removed, timeout or 0.0)


HELD, RELEASED, LOST = "held", "released", "lost"


class LeaseState(Generic[L]):
    """One held slot: its status and loss callbacks. Thread-safe; shared by both faces.

    The status moves once, from ``held`` to ``released`` or ``lost``; whichever comes first
    wins, so a release racing a connection loss reports one outcome.
    """

    def __init__(
        self,
        plan: SemaphorePlan,
        slot: int,
        holder_id: str,
        outcome: _flows.Acquired,
        on_lost: Callable[[L], Any] | None,
    ) -> None:
        self.plan = plan
        self.slot = slot
        self.holder_id = holder_id
        self.collisions = outcome.collisions
        self.waits = outcome.waits
        self.acquired_at = time.time()
        self.status = HELD
        self.reason = ""
        self.owner: L | None = None
        self._cleanup = False
        self._callbacks: list[Callable[[L], Any]] = [on_lost] if on_lost else []
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        return self.status == HELD

    def add_callback(self, callback: Callable[[L], Any]) -> None:
        with self._lock:
            if self.status != LOST:
                self._callbacks.append(callback)
                return
        self._fire(callback)

    def mark_released(self) -> bool:
        """Move held → released; True if this call did it (and should free the slot)."""
        with self._lock:
            if self.status != HELD:
                return False
            self.status = RELEASED
        self.plan.released()
        return True

    def mark_lost(self, reason: str, *, still_ours: bool = False) -> bool:
        """Move held → lost. ``still_ours``: the connection lives, so our B queue may still
        exist; the eventual ``release()`` must delete it (see ``take_cleanup``)."""
        with self._lock:
            if self.status != HELD:
                return False
            self.status = LOST
            self.reason = reason
            self._cleanup = still_ours
            callbacks = list(self._callbacks)
        log.warning(
            "lost slot %d of semaphore %r (holder %s): %s",
            self.slot,
            self.plan.name,
            self.holder_id,
            reason,
        )
        for callback in callbacks:
            self._fire(callback)
        return True

    def take_cleanup(self) -> bool:
        """True once for a lease lost while its connection lived: its holder queue may still
        be ours, and is deleted when the holder lets go (so ``wait_released`` means what it
        says: the holder stopped)."""
        with self._lock:
            cleanup, self._cleanup = self._cleanup, False
            return cleanup

    def _fire(self, callback: Callable[[L], Any]) -> None:
        try:
            if self.owner is not None:
                callback(self.owner)
        except Exception:
            log.exception("on_lost callback of slot %d of %r raised", self.slot, self.plan.name)

    def lost_error(self) -> LockLostError:
        return LockLostError(self.plan.name, self.slot, self.reason or "unknown reason")

    def describe(self) -> str:
        detail = f", {self.reason}" if self.status == LOST else ""
        return f"slot {self.slot} of {self.plan.name!r}, {self.status}{detail}"


C = TypeVar("C")


def adopt_connection(
    connection: object, url: str | None, kind: type[C], make: Callable[[], C]
) -> tuple[C, bool]:
    """The connection a Semaphore/SemaphoreAdmin uses, and whether it owns (closes) it."""
    if connection is None:
        return make(), True
    if not isinstance(connection, kind):
        raise InvalidArgumentError(
            f"connection must be an {kind.__module__}.{kind.__qualname__}, "
            f"got {type(connection).__name__}"
        )
    if url is not None:
        raise InvalidArgumentError("pass either url or connection, not both")
    return connection, False


class LeaseFacts:
    """What a lease says about itself; shared by the sync and async ``Lease`` classes."""

    _state: LeaseState[Any]

    @property
    def name(self) -> str:
        """The semaphore's name (namespace included)."""
        return self._state.plan.name

    @property
    def slot(self) -> int:
        """The slot number held, from 1."""
        return self._state.slot

    @property
    def held(self) -> bool:
        """True until released or lost."""
        return self._state.held

    @property
    def lost(self) -> bool:
        """True once the lease was lost (connection died, slot removed)."""
        return self._state.status == LOST

    @property
    def lost_reason(self) -> str | None:
        """Why the lease was lost, or None."""
        return self._state.reason if self.lost else None

    @property
    def holder_id(self) -> str:
        """Who holds it, as shown on the broker: ``host:pid:thread`` (or ``:task``)."""
        return self._state.holder_id

    @property
    def collisions(self) -> int:
        """Declares lost to other clients (RESOURCE_LOCKED) while acquiring this lease."""
        return self._state.collisions

    @property
    def waits(self) -> int:
        """Times the acquire blocked waiting for a release before it got this lease."""
        return self._state.waits

    def on_lost(self, callback: Callable[[Any], Any]) -> None:
        """Call ``callback(lease)`` when the lease is lost (at once if it already is)."""
        self._state.add_callback(callback)


def holder_thread_id(client_id: str) -> str:
    return f"{client_id}:{threading.current_thread().name}"
