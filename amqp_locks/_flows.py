"""The semaphore algorithms, written once, with no I/O.

Theory of operation
-------------------
Each algorithm is a generator (a "flow", as httpx calls its auth flows). It yields an *operation*
— a small frozen dataclass naming one broker action — and receives that operation's result back
from whichever driver runs it: the pika driver in :mod:`amqp_locks._sync`, the aio-pika driver in
:mod:`amqp_locks._async`, or a scripted in-memory broker in the tests. When the flow returns, its
return value is the result of the whole algorithm; when it raises, that is the error to report.

=================  =====================================  ===================================
operation          broker action                          result sent back
=================  =====================================  ===================================
``Probe``          confirmed mandatory publishes, all     ``tuple[bool | None, ...]``: routed,
                   in flight at once (one round trip)     unroutable, or nacked (unknown)
``DeclareHolder``  declare an exclusive queue, then       a ``Claim``: ``LOST`` on
                   probe ``verify`` (pipelined where the  RESOURCE_LOCKED or if this
                   driver can)                            connection already holds it;
                                                          ``HELD``, or ``STALE`` when the
                                                          ``verify`` queue is missing
``DeclareDurable`` declare a durable queue                ``None``
``Delete``         delete a queue, wait for delete-ok     ``None``
``Notify``         publish wake tokens (fire and forget)  ``None``
``Sleep``          wait                                   ``None``
``AwaitWake``      wait for a wake token or the timeout   ``None`` on timeout; else the slot
                                                          the token names (0: none)
=================  =====================================  ===================================

Drivers never throw into a flow: a broker failure aborts the flow (``close()``) and the driver
cleans up what the flow had claimed. Flows only raise :mod:`amqp_locks.errors` they decide on.

Time comes from the ``clock`` argument and jitter from tenacity's wait strategies, so tests can
drive every branch deterministically enough to assert on.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

import tenacity

from ._naming import MAX_SLOTS, SemaphoreNames
from .errors import (
    AcquireTimeoutError,
    AdminBusyError,
    AmqpLocksError,
    ContentionError,
    ProbeNackedError,
    SemaphoreExistsError,
    SemaphoreNotFoundError,
)

T = TypeVar("T")
Clock = Callable[[], float]

# Probes must not pile up messages in the queues they touch: x-max-length 0 drops each probe
# on arrival while the default overflow (drop-head) still acks it. Every declare of a given queue
# must use exactly these arguments, or RabbitMQ answers 406 PRECONDITION_FAILED.
SLOT_ARGUMENTS: dict[str, Any] = {"x-max-length": 0}
HOLDER_ARGUMENTS: dict[str, Any] = {"x-max-length": 0}
# One token is enough to wake one waiter; more stale tokens would only cost spurious scans.
WAKE_ARGUMENTS: dict[str, Any] = {"x-max-length": 1}
#: Queue argument carrying the holder's id on B queues and the admin mutex (shown by the
#: broker's tools; RabbitMQ keeps unknown x-arguments as given).
HOLDER_ID_ARGUMENT = "x-amqp-locks-holder"


@dataclass(frozen=True)
class Probe:
    queues: tuple[str, ...]


class Claim(Enum):
    """Outcome of DeclareHolder."""

    LOST = "lost"  # another connection (or this one, for another lease) holds the queue
    HELD = "held"  # declared, and the verify queue (if any) exists
    STALE = "stale"  # declared, but the verify queue is missing: the caller must delete it


@dataclass(frozen=True)
class DeclareHolder:
    queue: str
    holder_id: str
    #: Probed right after the declare succeeds, on the same channel, so the answer reflects
    #: the broker's state after the declare (a slot removed meanwhile is noticed).
    verify: str | None = None


@dataclass(frozen=True)
class DeclareDurable:
    queue: str
    arguments: dict[str, Any] = field(hash=False, compare=False)


@dataclass(frozen=True)
class Delete:
    queue: str


@dataclass(frozen=True)
class Notify:
    queue: str
    count: int = 1
    #: The slot just freed (0: none in particular), carried in the token to the waiter.
    slot: int = 0


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class AwaitWake:
    queue: str
    seconds: float


def wake_token(slot: int, hops: int = 0) -> bytes:
    """The body of a wake token: the slot it announces (0: any) and how often it was passed on."""
    return f"{slot}:{hops}".encode()


def parse_wake_token(body: bytes) -> tuple[int, int]:
    """``(slot, hops)`` of a token body; a malformed body counts as worn out."""
    try:
        slot, hops = body.split(b":")
        return max(int(slot), 0), int(hops)
    except ValueError:
        return 0, WAKE_HOPS


#: A token nobody waits for where it lands is passed on at most this many times.
WAKE_HOPS = 16

Op = Probe | DeclareHolder | DeclareDurable | Delete | Notify | Sleep | AwaitWake
Flow = Generator[Op, Any, T]


@dataclass(frozen=True)
class Policy:
    """Tunables shared by every flow. The defaults suit a LAN broker."""

    #: How far past the slot count admin operations look for stray A queues to prune.
    overshoot: int = 8
    #: Fallback poll period of a blocked acquire (jittered ±50 %): catches slots freed by
    #: holders that crashed, which send no wake token.
    poll_interval: float = 1.0
    #: After releasing a slot of a contended semaphore, an acquire made right away first
    #: waits up to this long: the waiter the release woke gets the slot, instead of racing
    #: us for it (a lost race costs a channel, and lets a re-acquiring client starve waiters).
    defer: float = 0.005
    #: Consecutive lost declare races before acquire gives up with ContentionError.
    max_collisions: int = 64
    #: Attempts at the admin mutex before AdminBusyError.
    admin_attempts: int = 100
    #: Period of polling B queues in wait_released.
    release_poll: float = 0.05
    #: Jittered pause after a lost declare race (full jitter, exponential).
    collision_wait: tenacity.wait.wait_base = field(
        default_factory=lambda: tenacity.wait_random_exponential(multiplier=0.002, max=0.05)
    )
    #: Jittered pause while another administrator holds the admin mutex.
    admin_wait: tenacity.wait.wait_base = field(
        default_factory=lambda: tenacity.wait_random_exponential(multiplier=0.01, max=0.25)
    )


#: A probe the broker nacked is asked again this many times in all before ProbeNackedError.
PROBE_ATTEMPTS = 3


def probe(queues: tuple[str, ...]) -> Flow[tuple[bool, ...]]:
    """Existence of ``queues``, one round trip; nacked probes are asked again.

    A nack means "unknown", never "missing": RabbitMQ nacks a message routed to a queue that
    dies before confirming it (a B queue deleted by a concurrent release). Asking again
    settles that race; a queue that nacks every time raises ProbeNackedError.
    """
    found: list[bool | None] = list((yield Probe(queues)))
    for _ in range(1, PROBE_ATTEMPTS):
        unknown = [i for i, f in enumerate(found) if f is None]
        if not unknown:
            break
        again = yield Probe(tuple(queues[i] for i in unknown))
        for i, f in zip(unknown, again):
            found[i] = f
    for queue, f in zip(queues, found):
        if f is None:
            raise ProbeNackedError(queue)
    return tuple(bool(f) for f in found)


def backoff(wait: tenacity.wait.wait_base, attempt: int) -> float:
    """Seconds to pause before retry number ``attempt`` (1-based), from a tenacity strategy."""
    state = tenacity.RetryCallState(None, None, (), {})  # type: ignore[arg-type]
    state.attempt_number = attempt
    return float(wait(state))


def _jittered(period: float, rng_value: float) -> float:
    return period * (0.5 + rng_value)


# --------------------------------------------------------------------------------------------
# Counting slots
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotScan:
    """What a scan of A queues found: the count (A[1..count] all exist) and strays above it."""

    count: int
    strays: tuple[int, ...]

    @property
    def top(self) -> int:
        return max((self.count, *self.strays))


def scan_slots(names: SemaphoreNames, policy: Policy, hint: int = 0) -> Flow[SlotScan]:
    """Find the slot count and every stray A queue above it.

    Probes go out in batches (one round trip each), doubling, starting from ``hint``. Scanning
    stops once ``policy.overshoot`` consecutive A queues past the last one found are missing.
    """
    exists: list[bool] = []
    upto = max(hint, 4) + 1 + policy.overshoot
    while True:
        batch = tuple(names.slot(k) for k in range(len(exists) + 1, upto + 1))
        exists.extend((yield from probe(batch)))
        last_found = max((k for k, e in enumerate(exists, 1) if e), default=0)
        if len(exists) >= last_found + max(policy.overshoot, 1) or len(exists) > MAX_SLOTS:
            break
        upto = max(2 * upto, last_found + policy.overshoot)
    count = exists.index(False) if False in exists else len(exists)
    strays = tuple(k for k, e in enumerate(exists, 1) if e and k > count)
    return SlotScan(count, strays)


# --------------------------------------------------------------------------------------------
# Lock clients
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Acquired:
    """Outcome of an acquire flow."""

    slot: int | None
    #: Declares lost to another client (RESOURCE_LOCKED) along the way.
    collisions: int
    #: Slot count seen by the last scan: where the next scan should start.
    count: int
    #: Times the flow blocked waiting for a release.
    waits: int
    #: Nobody else held a slot when we looked, and we neither waited nor lost a race: the
    #: next acquire may declare this slot straight away (see ``speculate``).
    idle: bool = False


@dataclass(frozen=True)
class _Attempt:
    slot: int | None
    count: int
    lost: int
    more_free: bool
    stale: bool = False
    idle: bool = False


def _attempt(names: SemaphoreNames, holder_id: str, hint: int) -> Flow[_Attempt]:
    """One pass of the spec's acquire loop.

    The spec probes A[L], then B[L], then declares B[L]. We probe every B of the slots we
    believe exist (``hint``) at once, plus A[1] (does the semaphore exist?), A[hint] (is the
    hint still true?) and A[hint + 1] (did it grow?); past the hint, A and B of a doubling
    range. Then we declare the lowest free B and check its A right behind the declare. A slot
    is handed out only if A[k] exists once B[k] is ours — what the spec's order plus its
    recommended verification give — at one probe round trip for any number of slots.
    """
    hi = max(hint, 1)
    ks = range(1, hi + 1)
    found = yield from probe(
        (*(names.holder(k) for k in ks), names.slot(hi + 1), names.slot(hi), names.slot(1))
    )
    if not found[-1]:
        raise SemaphoreNotFoundError(names.base)
    free = [k for k, held in zip(ks, found) if not held]
    idle = len(free) == hi
    grown, hint_holds = found[hi], found[hi + 1]
    while grown and not free and hi < MAX_SLOTS:
        lo, hi = hi + 1, min(2 * hi, MAX_SLOTS)
        ks = range(lo, hi + 1)
        n = len(ks)
        found = yield from probe(
            (
                *(names.slot(k) for k in ks),
                *(names.holder(k) for k in ks),
                names.slot(hi + 1),
            )
        )
        grown = found[2 * n]
        for k, slot_exists, held in zip(ks, found[:n], found[n:]):
            if not slot_exists:
                hi, grown = k - 1, False
                break
            if not held:
                free.append(k)
    # The count as far as we know: where the next acquire starts. A hint found too high
    # halves, so a semaphore that shrank is probed at its new size within a few acquires.
    count = hi + 1 if grown else (hi if hint_holds else max(hi // 2, 1))
    lost = 0
    for i, k in enumerate(free):
        claim = yield DeclareHolder(names.holder(k), holder_id, verify=names.slot(k))
        if claim is Claim.HELD:
            more = i + 1 < len(free) or grown
            return _Attempt(k, max(count, k), lost, more_free=more, idle=idle and not lost)
        if claim is Claim.LOST:
            lost += 1
            continue
        # A[k] is gone: the semaphore shrank below k since our hint. Give B[k] back; the
        # next pass scans with the smaller count.
        yield Delete(names.holder(k))
        return _Attempt(None, k - 1, lost, more_free=False, stale=True)
    return _Attempt(None, count, lost, more_free=False)


def acquire(
    names: SemaphoreNames,
    *,
    holder_id: str,
    policy: Policy,
    clock: Clock,
    rng: Callable[[], float],
    blocking: bool,
    timeout: float | None,
    hint: int = 0,
    speculate: int | None = None,
    defer: float = 0.0,
) -> Flow[Acquired]:
    """Acquire one slot: the spec's probe-A, probe-B, declare-B loop, then wait and repeat.

    Returns ``Acquired(slot=None)`` only when ``blocking`` is False and every slot is held.
    A blocked acquire sleeps on the wake queue (one token per release wakes one waiter) with a
    jittered poll as the fallback, until ``timeout`` seconds have passed.

    ``speculate``: a slot to declare before any probe — given only when the previous acquire
    found the semaphore idle (no holder anywhere). The probes exist to avoid the declare race
    that costs a channel (RESOURCE_LOCKED); on an idle semaphore there is nobody to race, and
    skipping them saves a round trip. The declare is verified as usual; if the guess was wrong
    (held after all, or gone) the flow falls back to the spec's scan.

    ``defer``: seconds to wait before the first attempt (see ``Policy.defer``).
    """
    deadline = None if timeout is None else clock() + timeout
    collisions = 0
    rounds_lost = 0
    waits = 0
    woken = False
    guess = speculate
    if defer > 0 and (timeout is None or timeout > defer):
        yield Sleep(defer)
    while True:
        if guess is not None:
            claim = yield DeclareHolder(names.holder(guess), holder_id, verify=names.slot(guess))
            if claim is Claim.HELD:
                idle = not woken and not collisions
                return Acquired(guess, collisions, max(hint, guess), waits, idle=idle)
            if claim is Claim.STALE:
                yield Delete(names.holder(guess))
            else:
                collisions += 1
            guess = None
        attempt = yield from _attempt(names, holder_id, hint)
        collisions += attempt.lost
        hint = attempt.count
        if attempt.slot is not None:
            if woken and attempt.more_free:
                # Tokens can be dropped (the wake queue keeps one); whoever is woken and sees
                # more free slots passes a token on, so other waiters are not left to the poll.
                yield Notify(names.wake)
            idle = attempt.idle and not collisions and not waits
            return Acquired(attempt.slot, collisions, hint, waits, idle=idle)
        if attempt.stale:
            continue  # the hint strictly shrank: rescan at once
        remaining = None if deadline is None else deadline - clock()
        if attempt.lost:
            rounds_lost += 1
            if rounds_lost >= policy.max_collisions:
                raise ContentionError(names.base, rounds_lost)
            if remaining is not None and remaining <= 0:
                raise AcquireTimeoutError(names.base, timeout if timeout is not None else 0.0)
            pause = backoff(policy.collision_wait, rounds_lost)
            if remaining is not None:
                pause = min(pause, remaining)
            yield Sleep(pause)
            continue
        rounds_lost = 0
        if not blocking:
            return Acquired(None, collisions, hint, waits)
        if remaining is not None and remaining <= 0:
            raise AcquireTimeoutError(names.base, timeout if timeout is not None else 0.0)
        pause = _jittered(policy.poll_interval, rng())
        if remaining is not None:
            pause = min(pause, remaining)
        waits += 1
        token = yield AwaitWake(names.wake, pause)
        woken = token is not None
        # A release's token names the slot it freed: declare it straight away. The releaser
        # (if it acquires again at once) has to probe first, so the woken waiter usually
        # gets there first instead of both racing for the slot.
        guess = token or None


def release(names: SemaphoreNames, slot: int) -> Flow[None]:
    """Give slot ``slot`` back: delete our B queue, then wake one waiter.

    The token goes out only after the delete-ok. Sent earlier (pipelined before the delete),
    it reaches the waiter, whose declare then beats the queue's deletion (about a millisecond
    on the broker) and fails with RESOURCE_LOCKED — measured: no fewer collisions.
    """
    yield Delete(names.holder(slot))
    yield Notify(names.wake, slot=slot)


def verify(names: SemaphoreNames, slots: Sequence[int]) -> Flow[tuple[bool, ...]]:
    """Still held? For each slot, A[k] and our B[k] must both exist (one round trip for all)."""
    if not slots:
        return ()
    found = yield from probe(
        tuple(names.slot(k) for k in slots) + tuple(names.holder(k) for k in slots)
    )
    n = len(slots)
    return tuple(a and b for a, b in zip(found[:n], found[n:]))


# --------------------------------------------------------------------------------------------
# Lock administration
# --------------------------------------------------------------------------------------------


def _with_admin_mutex(
    names: SemaphoreNames, holder_id: str, policy: Policy, body: Flow[T]
) -> Flow[T]:
    attempt = 0
    while (yield DeclareHolder(names.admin, holder_id)) is Claim.LOST:
        attempt += 1
        if attempt >= policy.admin_attempts:
            raise AdminBusyError(names.base, attempt)
        yield Sleep(backoff(policy.admin_wait, attempt))
    try:
        result = yield from body
    except AmqpLocksError:
        yield Delete(names.admin)
        raise
    yield Delete(names.admin)
    return result


def _delete_descending(names: SemaphoreNames, slots: Iterable[int]) -> Flow[None]:
    # Each delete waits for its delete-ok before the next (the driver returns only then), so
    # a crash midway leaves A[1..k] contiguous: the spec's defence against swiss cheese.
    for k in sorted(slots, reverse=True):
        yield Delete(names.slot(k))


def _declare_ascending(names: SemaphoreNames, first: int, last: int) -> Flow[None]:
    for k in range(first, last + 1):
        yield DeclareDurable(names.slot(k), SLOT_ARGUMENTS)


def _set_size(names: SemaphoreNames, scan: SlotScan, target: int) -> Flow[None]:
    """From a scan, make A[1..target] exist and nothing above it (within the overshoot)."""
    yield from _delete_descending(names, [k for k in scan.strays if k > target])
    if scan.count > target:
        yield from _delete_descending(names, range(target + 1, scan.count + 1))
    yield from _declare_ascending(names, scan.count + 1, target)
    if target:
        yield DeclareDurable(names.wake, WAKE_ARGUMENTS)
    else:
        yield Delete(names.wake)  # no slots left: as destroy() leaves it


@dataclass(frozen=True)
class Resized:
    before: int
    after: int
    #: Slots that existed before and not after: their holders, if any, may still run.
    removed: tuple[int, ...]


def _resize_body(
    names: SemaphoreNames,
    policy: Policy,
    target: Callable[[int], int],
    *,
    must_exist: bool,
    must_not_exist: bool = False,
) -> Flow[Resized]:
    scan = yield from scan_slots(names, policy)
    if must_exist and scan.count == 0:
        raise SemaphoreNotFoundError(names.base)
    if must_not_exist and scan.count > 0:
        raise SemaphoreExistsError(names.base, scan.count)
    after = target(scan.count)
    yield from _set_size(names, scan, after)
    if after > scan.count:
        yield Notify(names.wake, after - scan.count)
    return Resized(scan.count, after, tuple(range(after + 1, scan.count + 1)))


def resize(
    names: SemaphoreNames,
    *,
    holder_id: str,
    policy: Policy,
    target: Callable[[int], int],
    must_exist: bool,
    must_not_exist: bool = False,
) -> Flow[Resized]:
    """Under the admin mutex: scan, prune strays, then grow or shrink to ``target(count)``.

    ``create`` is ``must_not_exist``; ``ensure`` neither; ``add``/``remove``/``resize`` are
    ``must_exist``. New slots wake that many waiters.
    """
    body = _resize_body(names, policy, target, must_exist=must_exist, must_not_exist=must_not_exist)
    return (yield from _with_admin_mutex(names, holder_id, policy, body))


def _destroy_body(names: SemaphoreNames, policy: Policy) -> Flow[Resized]:
    scan = yield from scan_slots(names, policy)
    yield from _delete_descending(names, (*scan.strays, *range(1, scan.count + 1)))
    # Waiters consuming the wake queue get a consumer cancel from the broker: they rescan
    # and learn the semaphore is gone instead of sleeping until their poll.
    yield Delete(names.wake)
    return Resized(scan.count, 0, tuple(range(1, scan.top + 1)))


def destroy(names: SemaphoreNames, *, holder_id: str, policy: Policy) -> Flow[Resized]:
    """Under the admin mutex: delete every A queue (descending, strays first) and the wake queue."""
    return (yield from _with_admin_mutex(names, holder_id, policy, _destroy_body(names, policy)))


def held_slots(names: SemaphoreNames, policy: Policy) -> Flow[tuple[int, ...]]:
    """Slots whose B queue exists now, up to the count plus the overshoot (no mutex needed)."""
    scan = yield from scan_slots(names, policy)
    ks = range(1, scan.top + policy.overshoot + 1)
    found = yield from probe(tuple(names.holder(k) for k in ks))
    return tuple(k for k, e in zip(ks, found) if e)


def wait_released(
    names: SemaphoreNames,
    slots: Sequence[int],
    *,
    policy: Policy,
    clock: Clock,
    rng: Callable[[], float],
    timeout: float | None,
) -> Flow[bool]:
    """Poll B queues of ``slots`` until none exists (True) or ``timeout`` passes (False).

    Polling is the spec's method; it is only meaningful for slots whose A queue is gone,
    since elsewhere a slot may be released and taken again between two polls.
    """
    deadline = None if timeout is None else clock() + timeout
    while True:
        if not slots:
            return True
        found = yield from probe(tuple(names.holder(k) for k in slots))
        slots = [k for k, e in zip(slots, found) if e]
        if not slots:
            return True
        pause = _jittered(policy.release_poll, rng())
        if deadline is not None:
            remaining = deadline - clock()
            if remaining <= 0:
                return False
            pause = min(pause, remaining)
        yield Sleep(pause)
