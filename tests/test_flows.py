"""The semaphore algorithms (``amqp_locks._flows``) against an in-memory broker model.

No broker and no real time: ``broker_model.BrokerModel`` answers the operations the flows yield
and keeps a fake clock; ``Interleaver`` advances several flows one operation at a time, so races
are staged deterministically or chosen by hypothesis. Each test states one behaviour.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pytest
from broker_model import BrokerModel, Interleaver, ResourceLockedError, run
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from amqp_locks import _flows, errors
from amqp_locks._common import SemaphorePlan, make_policy
from amqp_locks._flows import (
    Acquired,
    AwaitWake,
    Claim,
    DeclareDurable,
    DeclareHolder,
    Delete,
    Notify,
    Policy,
    Probe,
    Resized,
    Sleep,
)
from amqp_locks._naming import SemaphoreNames

ADMIN = "admin-conn"
CLIENT = "client-conn"


@pytest.fixture
def broker() -> BrokerModel:
    return BrokerModel()


@pytest.fixture
def plan() -> SemaphorePlan:
    return SemaphorePlan("jobs", "", Policy())


@pytest.fixture
def names(plan: SemaphorePlan) -> SemaphoreNames:
    return plan.names


def create(broker: BrokerModel, plan: SemaphorePlan, slots: int) -> Resized:
    return run(plan.create("admin", slots), ADMIN, broker)


def acquire_flow(
    broker: BrokerModel,
    names: SemaphoreNames,
    *,
    holder: str = "client",
    policy: Policy | None = None,
    blocking: bool = False,
    timeout: float | None = None,
    hint: int = 0,
    speculate: int | None = None,
    rng: Callable[[], float] = random.random,
) -> _flows.Flow[Acquired]:
    return _flows.acquire(
        names,
        holder_id=holder,
        policy=policy or Policy(),
        clock=broker.now,
        rng=rng,
        blocking=blocking,
        timeout=timeout,
        hint=hint,
        speculate=speculate,
    )


def acquire(broker: BrokerModel, names: SemaphoreNames, conn: str = CLIENT, **kw: Any) -> Acquired:
    return run(acquire_flow(broker, names, **kw), conn, broker)


def is_declare_of(queue: str) -> Callable[[object], bool]:
    return lambda op: isinstance(op, DeclareHolder) and op.queue == queue


def deleted_slots(broker: BrokerModel, names: SemaphoreNames, since: int = 0) -> list[int]:
    prefix = f"{names.base}-"
    return [
        int(op.queue[len(prefix) : -2])
        for op in broker.ops(Delete, since=since)
        if op.queue.startswith(prefix) and op.queue.endswith("-A")
    ]


def declared_slots(broker: BrokerModel, names: SemaphoreNames, since: int = 0) -> list[int]:
    prefix = f"{names.base}-"
    return [
        int(op.queue[len(prefix) : -2])
        for op in broker.ops(DeclareDurable, since=since)
        if op.queue.startswith(prefix) and op.queue.endswith("-A")
    ]


# ---------------------------------------------------------------------------------------------
# The model itself behaves like the broker facts the flows rely on
# ---------------------------------------------------------------------------------------------


def test_model_exclusive_declare_is_lost_for_another_connection_and_for_the_owner(
    broker: BrokerModel,
) -> None:
    assert broker.execute(DeclareHolder("q", "h1"), "c1") is Claim.HELD
    assert broker.execute(DeclareHolder("q", "h2"), "c2") is Claim.LOST
    assert broker.execute(DeclareHolder("q", "h3"), "c1") is Claim.LOST
    assert broker.exclusive == {"q": "c1"}


def test_model_declare_with_a_missing_verify_queue_holds_it_but_answers_stale(
    broker: BrokerModel,
) -> None:
    assert broker.execute(DeclareHolder("q", "h1", verify="gone"), "c1") is Claim.STALE
    assert broker.exclusive == {"q": "c1"}


def test_model_delete_is_idempotent_but_refuses_another_connections_exclusive_queue(
    broker: BrokerModel,
) -> None:
    broker.execute(Delete("missing"), "c1")
    broker.execute(DeclareHolder("q", "h1"), "c1")
    with pytest.raises(ResourceLockedError):
        broker.execute(Delete("q"), "c2")
    broker.close_connection("c1")
    assert not broker.exists("q")


def test_model_redeclare_with_other_arguments_is_a_queue_mismatch(broker: BrokerModel) -> None:
    broker.execute(DeclareDurable("q", {"x-max-length": 0}), "c1")
    broker.execute(DeclareDurable("q", {"x-max-length": 0}), "c2")
    with pytest.raises(errors.QueueMismatchError):
        broker.execute(DeclareDurable("q", {"x-max-length": 1}), "c1")


def test_model_wake_tokens_are_capped_by_max_length_and_missing_queues_drop_them(
    broker: BrokerModel,
) -> None:
    broker.execute(Notify("nowhere", 3), "c")
    broker.execute(DeclareDurable("w", _flows.WAKE_ARGUMENTS), "c")
    broker.execute(Notify("w", 4, slot=1), "c")
    broker.execute(Notify("w", 1, slot=2), "c")
    assert broker.execute(AwaitWake("w", 2.0), "c") == 2  # drop-head kept the newest
    before = broker.now()
    assert broker.execute(AwaitWake("w", 2.0), "c") is None
    assert broker.now() == before + 2.0


# ---------------------------------------------------------------------------------------------
# Acquire
# ---------------------------------------------------------------------------------------------


def test_acquire_takes_the_lowest_free_slot(broker, plan, names) -> None:
    create(broker, plan, 4)
    broker.hold(names, 1, "other")
    broker.hold(names, 3, "other")
    outcome = acquire(broker, names)
    assert outcome.slot == 2
    assert outcome.collisions == 0
    assert broker.holders(names) == {1: "other", 2: CLIENT, 3: "other"}
    assert broker.holder_ids[names.holder(2)] == "client"


def test_nonblocking_acquire_returns_no_slot_when_all_are_busy(broker, plan, names) -> None:
    create(broker, plan, 2)
    broker.hold(names, 1, "other")
    broker.hold(names, 2, "other")
    mark = broker.mark()
    assert acquire(broker, names) == Acquired(slot=None, collisions=0, count=2, waits=0)
    assert broker.ops((DeclareHolder, AwaitWake, Sleep), since=mark) == []


def test_acquire_raises_not_found_when_slot_one_is_missing_even_with_strays_above(
    broker, names
) -> None:
    broker.add_slots(names, [2, 3, 7])
    with pytest.raises(errors.SemaphoreNotFoundError):
        acquire(broker, names, blocking=True, timeout=None)
    assert broker.holders(names) == {}


def test_blocking_acquire_times_out_when_nothing_frees(broker, plan, names) -> None:
    policy = Policy(poll_interval=0.4)
    create(broker, plan, 2)
    broker.hold(names, 1, "other")
    broker.hold(names, 2, "other")
    start = broker.now()
    with pytest.raises(errors.AcquireTimeoutError) as excinfo:
        acquire(broker, names, policy=policy, blocking=True, timeout=3.0)
    assert excinfo.value.timeout == 3.0
    assert broker.now() - start == pytest.approx(3.0)
    waits = broker.ops(AwaitWake)
    assert len(waits) >= 3
    assert all(0 <= w.seconds <= 1.5 * policy.poll_interval for w in waits)
    assert broker.ops(DeclareHolder, conn=CLIENT) == []


def test_blocking_acquire_with_zero_timeout_fails_without_waiting(broker, plan, names) -> None:
    create(broker, plan, 1)
    broker.hold(names, 1, "other")
    with pytest.raises(errors.AcquireTimeoutError):
        acquire(broker, names, blocking=True, timeout=0.0)
    assert broker.ops(AwaitWake) == []


def test_acquire_probes_a_and_b_queues_of_a_small_semaphore_in_one_round_trip(
    broker, plan, names
) -> None:
    create(broker, plan, 3)
    broker.hold(names, 1, "other")
    broker.hold(names, 2, "other")
    mark = broker.mark()
    assert acquire(broker, names, hint=3).slot == 3
    # Every B of the known slots, the A just past them (grown?), the A of the hint (still
    # true?) and A[1] (exists?) at once; then the declare, which checks A[3] right after it
    # (no separate probe op).
    assert broker.ops(since=mark) == [
        Probe(
            (
                *(names.holder(k) for k in (1, 2, 3)),
                names.slot(4),
                names.slot(3),
                names.slot(1),
            )
        ),
        DeclareHolder(names.holder(3), "client", verify=names.slot(3)),
    ]


def test_acquire_with_a_good_hint_needs_constant_round_trips_on_a_big_busy_semaphore(
    broker, plan, names
) -> None:
    create(broker, plan, 64)
    for k in range(1, 64):
        broker.hold(names, k, "other")
    mark = broker.mark()
    assert acquire(broker, names, hint=64).slot == 64
    ops = broker.ops(since=mark)
    declare_at = ops.index(DeclareHolder(names.holder(64), "client", verify=names.slot(64)))
    assert sum(isinstance(op, Probe) for op in ops[:declare_at]) <= 2
    assert ops[declare_at + 1 :] == []  # the verify of A[64] rides on the declare


def test_acquire_without_a_hint_needs_logarithmically_many_round_trips(broker, plan, names) -> None:
    create(broker, plan, 64)
    for k in range(1, 64):
        broker.hold(names, k, "other")
    mark = broker.mark()
    outcome = acquire(broker, names)
    assert outcome.slot == 64
    assert outcome.count == 64  # the hint for the next acquire
    assert len(broker.ops(Probe, since=mark)) <= 2 + math.log2(64)


def test_a_lost_declare_race_is_retried_and_counted(broker, plan, names) -> None:
    create(broker, plan, 1)
    inter = Interleaver(broker)
    inter.start("x", acquire_flow(broker, names), CLIENT)
    inter.step_until("x", is_declare_of(names.holder(1)))
    broker.hold(names, 1, "rival")  # the rival's declare lands first
    inter.step("x")
    broker.close_connection("rival")  # and it lets go before our retry probes
    outcome = inter.finish("x")
    assert outcome.slot == 1
    assert outcome.collisions == 1
    (pause,) = broker.ops(Sleep)
    assert 0 <= pause.seconds <= 0.05  # Policy.collision_wait caps at 50 ms


def test_a_lost_race_moves_on_to_the_next_free_slot_in_the_same_round(broker, plan, names) -> None:
    create(broker, plan, 3)
    inter = Interleaver(broker)
    inter.start("x", acquire_flow(broker, names, hint=3), CLIENT)
    inter.step_until("x", is_declare_of(names.holder(1)))
    broker.hold(names, 1, "rival")
    outcome = inter.finish("x")
    assert (outcome.slot, outcome.collisions) == (2, 1)
    assert broker.ops(Sleep) == []


def test_acquire_gives_up_with_contention_error_after_max_collisions_lost_rounds(
    broker, plan, names
) -> None:
    policy = Policy(max_collisions=3)
    create(broker, plan, 1)
    inter = Interleaver(broker)
    inter.start("x", acquire_flow(broker, names, policy=policy, blocking=True), CLIENT)
    for _ in range(policy.max_collisions):
        inter.step_until("x", is_declare_of(names.holder(1)))
        broker.hold(names, 1, "rival")
        inter.step("x")
        broker.close_connection("rival")
    with pytest.raises(errors.ContentionError) as excinfo:
        inter.finish("x")
    assert excinfo.value.attempts == policy.max_collisions
    assert len(broker.ops(DeclareHolder, conn=CLIENT)) == policy.max_collisions
    assert broker.holders(names) == {}


def test_acquire_verifies_its_slot_and_gives_it_back_if_an_admin_removed_it_meanwhile(
    broker, plan, names
) -> None:
    create(broker, plan, 3)
    broker.hold(names, 1, "other")
    broker.hold(names, 2, "other")
    inter = Interleaver(broker)
    inter.start("x", acquire_flow(broker, names), CLIENT)
    inter.step_until("x", is_declare_of(names.holder(3)))
    assert run(plan.remove("admin", 1), ADMIN, broker).after == 2  # A[3] goes
    mark = broker.mark()
    outcome = inter.finish("x")
    assert outcome.slot is None
    assert outcome.count == 2
    assert names.holder(3) not in broker.exclusive
    declare, give_back, rescan = broker.ops(conn=CLIENT, since=mark)
    assert declare == DeclareHolder(names.holder(3), "client", verify=names.slot(3))
    assert broker.log[mark].result is Claim.STALE
    assert give_back == Delete(names.holder(3))
    assert rescan == Probe(
        (names.holder(1), names.holder(2), names.slot(3), names.slot(2), names.slot(1))
    )


def test_acquire_with_a_hint_above_the_count_never_hands_out_a_slot_above_it(
    broker, plan, names
) -> None:
    create(broker, plan, 2)
    broker.hold(names, 1, "other")
    broker.hold(names, 2, "other")
    outcome = acquire(broker, names, hint=10)
    assert (outcome.slot, outcome.count) == (None, 2)
    assert broker.holders(names) == {1: "other", 2: "other"}


def test_a_blocked_acquire_is_woken_by_a_release_and_takes_the_slot(broker, plan, names) -> None:
    create(broker, plan, 1)
    holder = acquire(broker, names, conn="holder-conn")
    inter = Interleaver(broker)
    inter.start("waiter", acquire_flow(broker, names, blocking=True, timeout=60.0), CLIENT)
    inter.step_until("waiter", lambda op: isinstance(op, AwaitWake))
    run(_flows.release(names, holder.slot), "holder-conn", broker)
    start = broker.now()
    outcome = inter.finish("waiter")
    assert (outcome.slot, outcome.waits) == (1, 1)
    assert broker.now() == start  # woken by the token, not by the poll


def wake_two_waiters_by_adding_two_slots(
    broker: BrokerModel, plan: SemaphorePlan, initial: int
) -> tuple[Acquired, Acquired, float]:
    """``initial`` slots, all held; two blocked waiters; add(2). Outcomes and time taken."""
    names = plan.names
    create(broker, plan, initial)
    for k in range(1, initial + 1):
        broker.hold(names, k, "other")
    inter = Interleaver(broker)
    for w in ("w1", "w2"):
        inter.start(w, acquire_flow(broker, names, holder=w, blocking=True, timeout=60.0), w)
        inter.step_until(w, lambda op: isinstance(op, AwaitWake))
    run(plan.add("admin", 2), ADMIN, broker)  # two slots, but the wake queue keeps one token
    assert broker.messages[names.wake] == 1
    start = broker.now()
    return inter.finish("w1"), inter.finish("w2"), broker.now() - start


def test_a_woken_waiter_that_sees_more_free_slots_passes_the_wake_token_on(
    broker, plan, names
) -> None:
    first, second, took = wake_two_waiters_by_adding_two_slots(broker, plan, initial=2)
    assert (first.slot, second.slot) == (3, 4)
    assert broker.ops(Notify, conn="w1") == [Notify(names.wake)]
    assert took == 0  # nobody fell back to the poll


def test_a_woken_waiter_passes_the_token_on_even_when_its_last_batch_had_one_free_slot(
    broker, plan, names
) -> None:
    first, second, took = wake_two_waiters_by_adding_two_slots(broker, plan, initial=1)
    assert (first.slot, second.slot) == (2, 3)
    assert took == 0


def test_verify_reports_per_slot_whether_a_and_b_still_exist_in_one_probe(
    broker, plan, names
) -> None:
    create(broker, plan, 3)
    broker.hold(names, 1, CLIENT)
    broker.hold(names, 3, CLIENT)
    run(plan.remove("admin", 1), ADMIN, broker)
    mark = broker.mark()
    assert run(_flows.verify(names, [1, 2, 3]), CLIENT, broker) == (True, False, False)
    assert len(broker.ops(Probe, since=mark)) == 1
    assert run(_flows.verify(names, []), CLIENT, broker) == ()


# ---------------------------------------------------------------------------------------------
# Release and waiting for holders
# ---------------------------------------------------------------------------------------------


def test_release_deletes_the_holder_queue_then_notifies_the_wake_queue(broker, plan, names) -> None:
    create(broker, plan, 2)
    slot = acquire(broker, names).slot
    broker.messages.clear()
    broker.tokens.clear()
    mark = broker.mark()
    run(_flows.release(names, slot), CLIENT, broker)
    assert broker.ops(since=mark) == [Delete(names.holder(slot)), Notify(names.wake, slot=slot)]
    assert broker.holders(names) == {}
    assert broker.messages[names.wake] == 1


def test_wait_released_returns_true_once_the_holder_queues_are_gone(broker, plan, names) -> None:
    create(broker, plan, 3)
    broker.hold(names, 2, "h2")
    broker.hold(names, 3, "h3")
    inter = Interleaver(broker)
    flow = _flows.wait_released(
        names, [2, 3], policy=plan.policy, clock=broker.now, rng=random.random, timeout=10.0
    )
    inter.start("admin", flow, ADMIN)
    for _ in range(4):
        inter.step("admin")
    broker.close_connection("h2")
    broker.close_connection("h3")
    assert inter.finish("admin") is True
    assert broker.ops(Probe)[-1] == Probe((names.holder(2), names.holder(3)))


def test_wait_released_with_nothing_held_answers_after_one_probe(broker, plan, names) -> None:
    create(broker, plan, 2)
    flow = _flows.wait_released(
        names, [1, 2], policy=plan.policy, clock=broker.now, rng=random.random, timeout=0.0
    )
    assert run(flow, ADMIN, broker) is True
    assert len(broker.ops(Probe)) == 1 + 1  # create's scan, then one poll


def test_wait_released_for_no_slots_is_true_at_once(broker, plan, names) -> None:
    flow = _flows.wait_released(
        names, [], policy=plan.policy, clock=broker.now, rng=random.random, timeout=None
    )
    assert run(flow, ADMIN, broker) is True
    assert broker.log == []


def test_wait_released_returns_false_at_the_timeout(broker, plan, names) -> None:
    create(broker, plan, 1)
    broker.hold(names, 1, "stubborn")
    start = broker.now()
    flow = _flows.wait_released(
        names, [1], policy=plan.policy, clock=broker.now, rng=random.random, timeout=2.0
    )
    assert run(flow, ADMIN, broker) is False
    assert broker.now() - start == pytest.approx(2.0)
    assert all(s.seconds <= 1.5 * plan.policy.release_poll for s in broker.ops(Sleep))


# ---------------------------------------------------------------------------------------------
# Administration
# ---------------------------------------------------------------------------------------------


def test_create_declares_slots_ascending_and_the_wake_queue(broker, plan, names) -> None:
    assert create(broker, plan, 4) == Resized(before=0, after=4, removed=())
    assert broker.slots(names) == [1, 2, 3, 4]
    assert declared_slots(broker, names) == [1, 2, 3, 4]
    assert broker.durable[names.slot(1)] == _flows.SLOT_ARGUMENTS
    assert broker.durable[names.wake] == _flows.WAKE_ARGUMENTS
    assert Notify(names.wake, 4) in broker.ops(Notify)


def test_create_on_an_existing_semaphore_raises_and_changes_nothing(broker, plan, names) -> None:
    create(broker, plan, 2)
    mark = broker.mark()
    with pytest.raises(errors.SemaphoreExistsError) as excinfo:
        create(broker, plan, 5)
    assert excinfo.value.slots == 2
    assert broker.slots(names) == [1, 2]
    assert broker.ops((DeclareDurable, Notify), since=mark) == []


def test_ensure_creates_grows_and_shrinks(broker, plan, names) -> None:
    assert run(plan.ensure("admin", 2), ADMIN, broker) == Resized(0, 2, ())
    assert run(plan.ensure("admin", 2), ADMIN, broker) == Resized(2, 2, ())
    assert run(plan.ensure("admin", 5), ADMIN, broker) == Resized(2, 5, ())
    assert run(plan.ensure("admin", 3), ADMIN, broker) == Resized(5, 3, (4, 5))
    assert broker.slots(names) == [1, 2, 3]


def test_add_remove_and_resize_change_the_count(broker, plan, names) -> None:
    create(broker, plan, 3)
    assert run(plan.add("admin", 2), ADMIN, broker) == Resized(3, 5, ())
    assert run(plan.remove("admin", 3), ADMIN, broker) == Resized(5, 2, (3, 4, 5))
    assert run(plan.resize("admin", 4), ADMIN, broker) == Resized(2, 4, ())
    assert broker.slots(names) == [1, 2, 3, 4]
    assert run(plan.remove("admin", 10), ADMIN, broker) == Resized(4, 0, (1, 2, 3, 4))
    assert broker.slots(names) == []


@pytest.mark.parametrize(
    "change",
    [lambda p: p.add("admin", 1), lambda p: p.remove("admin", 1), lambda p: p.resize("admin", 3)],
    ids=["add", "remove", "resize"],
)
def test_changing_a_missing_semaphore_raises_not_found(broker, plan, names, change) -> None:
    with pytest.raises(errors.SemaphoreNotFoundError):
        run(change(plan), ADMIN, broker)
    assert broker.slots(names) == []
    assert not broker.exists(names.admin)


def test_destroy_deletes_every_slot_descending_and_the_wake_queue(broker, plan, names) -> None:
    create(broker, plan, 4)
    broker.add_slots(names, [7])
    mark = broker.mark()
    assert run(plan.destroy("admin"), ADMIN, broker) == Resized(4, 0, tuple(range(1, 8)))
    assert deleted_slots(broker, names, mark) == [7, 4, 3, 2, 1]
    assert not broker.exists(names.wake)
    assert broker.slots(names) == []


def test_removal_deletes_slots_in_strictly_descending_order(broker, plan, names) -> None:
    create(broker, plan, 6)
    mark = broker.mark()
    run(plan.resize("admin", 2), ADMIN, broker)
    assert deleted_slots(broker, names, mark) == [6, 5, 4, 3]
    assert broker.slots(names) == [1, 2]


def test_growth_declares_slots_in_ascending_order(broker, plan, names) -> None:
    create(broker, plan, 2)
    mark = broker.mark()
    run(plan.add("admin", 4), ADMIN, broker)
    assert declared_slots(broker, names, mark) == [3, 4, 5, 6]


def test_admin_mutex_is_declared_first_and_deleted_last(broker, plan, names) -> None:
    create(broker, plan, 3)
    mark = broker.mark()
    run(plan.resize("admin", 1), ADMIN, broker)
    ops = broker.ops(since=mark)
    assert ops[0] == DeclareHolder(names.admin, "admin")
    assert ops[-1] == Delete(names.admin)
    assert not broker.exists(names.admin)


def test_admin_mutex_is_deleted_when_the_operation_fails(broker, plan, names) -> None:
    create(broker, plan, 3)
    mark = broker.mark()
    with pytest.raises(errors.SemaphoreExistsError):
        create(broker, plan, 3)
    ops = broker.ops(since=mark)
    assert ops[0] == DeclareHolder(names.admin, "admin")
    assert ops[-1] == Delete(names.admin)
    assert not broker.exists(names.admin)


def test_admin_busy_after_admin_attempts_when_another_connection_holds_the_mutex(
    broker, names
) -> None:
    plan = SemaphorePlan("jobs", "", Policy(admin_attempts=3))
    create(broker, plan, 2)
    broker.take(names.admin, "other-admin")
    mark = broker.mark()
    with pytest.raises(errors.AdminBusyError) as excinfo:
        run(plan.resize("admin", 5), ADMIN, broker)
    assert excinfo.value.attempts == 3
    ops = broker.ops(since=mark)
    assert ops.count(DeclareHolder(names.admin, "admin")) == 3
    assert [type(op) for op in ops] == [DeclareHolder, Sleep, DeclareHolder, Sleep, DeclareHolder]
    assert all(0 <= op.seconds <= 0.25 for op in ops if isinstance(op, Sleep))
    assert broker.slots(names) == [1, 2]
    assert broker.exclusive[names.admin] == "other-admin"


def test_a_second_admin_on_the_same_connection_waits_for_the_mutex(broker, plan, names) -> None:
    create(broker, plan, 2)
    inter = Interleaver(broker)
    inter.start("first", plan.add("first", 1), ADMIN)
    inter.step("first")  # holds the mutex now
    inter.start("second", plan.add("second", 1), ADMIN)
    inter.step("second")
    assert broker.log[-1].result is Claim.LOST  # connection-local claim: not ours to share
    assert inter.finish("first").after == 3
    assert inter.finish("second").after == 4


def test_an_a_queue_with_foreign_arguments_fails_the_admin_op_with_queue_mismatch(
    broker, plan, names
) -> None:
    broker.durable[names.slot(2)] = {"x-max-length": 5}
    with pytest.raises(errors.QueueMismatchError) as excinfo:
        create(broker, plan, 3)
    assert excinfo.value.queue == names.slot(2)


# ---------------------------------------------------------------------------------------------
# Overshoot: pruning stray A queues
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "arg", "after"),
    [("ensure", 3, 3), ("resize", 3, 3), ("add", 1, 4), ("remove", 1, 2), ("ensure", 6, 6)],
)
def test_any_admin_change_prunes_strays_above_the_count(
    broker, plan, names, method, arg, after
) -> None:
    broker.add_slots(names, [1, 2, 3, 5, 9])
    mark = broker.mark()
    outcome = run(getattr(plan, method)("admin", arg), ADMIN, broker)
    assert (outcome.before, outcome.after) == (3, after)
    assert broker.slots(names) == list(range(1, after + 1))
    deleted = deleted_slots(broker, names, mark)
    assert deleted == sorted(deleted, reverse=True)
    assert len(set(deleted)) == len(deleted)


def test_create_over_strays_without_slot_one_prunes_them(broker, plan, names) -> None:
    broker.add_slots(names, [4, 6])
    assert create(broker, plan, 2) == Resized(0, 2, ())
    assert broker.slots(names) == [1, 2]


def test_strays_beyond_the_overshoot_window_are_left_alone(broker, plan, names) -> None:
    # The bound: the first scan batch covers A[1 .. max(hint, 4) + 1 + overshoot] (A[1..13] with
    # the defaults), and scanning goes on only while an A queue was found within the last
    # `overshoot` probed. A stray farther than that from every other A queue is not seen.
    broker.add_slots(names, [1, 2, 3, 40])
    run(plan.resize("admin", 3), ADMIN, broker)
    assert broker.slots(names) == [1, 2, 3, 40]


# ---------------------------------------------------------------------------------------------
# Counting slots
# ---------------------------------------------------------------------------------------------


def scan(broker: BrokerModel, names: SemaphoreNames, policy: Policy, hint: int = 0) -> Any:
    return run(_flows.scan_slots(names, policy, hint), ADMIN, broker)


@settings(max_examples=60, deadline=None)
@given(count=st.integers(0, 300), hint=st.integers(0, 400))
@example(count=0, hint=0)
@example(count=300, hint=0)
@example(count=13, hint=0)
def test_scan_counts_every_size_in_logarithmically_many_round_trips(count, hint) -> None:
    broker, policy = BrokerModel(), Policy()
    names = SemaphoreNames.of("jobs")
    broker.add_slots(names, range(1, count + 1))
    found = scan(broker, names, policy, hint)
    assert (found.count, found.strays) == (count, ())
    probes = broker.ops(Probe)
    assert len(probes) <= 2 + math.log2(1 + count + policy.overshoot)
    probed = sum(len(p.queues) for p in probes)
    assert probed <= max(hint + 5 + policy.overshoot, 2 * (count + policy.overshoot))


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(0, 60),
    gaps=st.lists(st.integers(2, Policy().overshoot), max_size=6),
    op=st.sampled_from(["ensure", "resize", "add", "remove"]),
)
def test_strays_chained_within_the_overshoot_are_all_found_and_pruned(count, gaps, op) -> None:
    broker, plan = BrokerModel(), SemaphorePlan("jobs", "", Policy())
    names = plan.names
    strays, k = [], count
    for gap in gaps:
        k += gap
        strays.append(k)
    broker.add_slots(names, [*range(1, count + 1), *strays])
    found = scan(broker, names, plan.policy)
    assert (found.count, found.strays) == (count, tuple(strays))
    if count == 0 and op != "ensure":
        return
    outcome = run(getattr(plan, op)("admin", 1), ADMIN, broker)
    assert broker.slots(names) == list(range(1, outcome.after + 1))


def test_scan_with_zero_overshoot_still_counts_a_big_semaphore(broker, names) -> None:
    plan = SemaphorePlan("jobs", "", make_policy(overshoot=0))
    create(broker, plan, 10)
    assert run(plan.resize("admin", 3), ADMIN, broker) == Resized(10, 3, tuple(range(4, 11)))
    assert broker.slots(names) == [1, 2, 3]


def test_count_and_exists_of_the_plan(broker, plan, names) -> None:
    assert run(plan.exists(), CLIENT, broker) is False
    assert run(plan.count(), CLIENT, broker) == 0
    create(broker, plan, 37)
    assert run(plan.exists(), CLIENT, broker) is True
    assert run(plan.count(), CLIENT, broker) == 37


def test_held_slots_includes_holders_of_removed_slots(broker, plan, names) -> None:
    create(broker, plan, 4)
    broker.hold(names, 2, "a")
    broker.hold(names, 4, "b")
    run(plan.resize("admin", 2), ADMIN, broker)
    assert run(plan.held(), ADMIN, broker) == (2, 4)


# ---------------------------------------------------------------------------------------------
# Random interleavings of clients and admins
# ---------------------------------------------------------------------------------------------

CLIENT_ERRORS = (
    errors.AcquireTimeoutError,
    errors.ContentionError,
    errors.SemaphoreNotFoundError,
    errors.BrokerUnavailableError,  # only from a crash this test staged
)
ADMIN_ERRORS = (
    errors.AdminBusyError,
    errors.SemaphoreExistsError,
    errors.SemaphoreNotFoundError,
    errors.BrokerUnavailableError,
)
ADMIN_OPS = ["ensure", "resize", "add", "remove", "create", "destroy"]
PROPERTY_POLICY = Policy(poll_interval=0.2, max_collisions=8, admin_attempts=40)


class World:
    """Clients that acquire then release, admins that resize; checks the invariants each step."""

    def __init__(self, n_clients: int, n_conns: int, n_admins: int) -> None:
        self.broker = BrokerModel()
        self.plan = SemaphorePlan("jobs", "", PROPERTY_POLICY)
        self.names = self.plan.names
        self.inter = Interleaver(self.broker)
        self.clients = [f"c{i}" for i in range(n_clients)]
        self.admins = [f"a{i}" for i in range(n_admins)]
        self.conn_no = {c: i % n_conns for i, c in enumerate(self.clients)}
        self.generation = {i: 0 for i in range(n_conns)}
        self.leases: dict[str, int] = {}  # client -> slot, while its lease is live

    def conn_of(self, actor: str) -> str:
        if actor in self.admins:
            return f"admin-{actor}"
        n = self.conn_no[actor]
        return f"conn{n}.{self.generation[n]}"

    def busy(self, actor: str) -> bool:
        return actor in self.inter.runs and not self.inter.runs[actor].done

    def start(self, actor: str, data: st.DataObject) -> None:
        conn = self.conn_of(actor)
        if actor in self.admins:
            op = data.draw(st.sampled_from(ADMIN_OPS), label="op")
            if op == "destroy":
                self.inter.start(actor, self.plan.destroy(actor), conn)
            else:
                n = data.draw(st.integers(1, 4), label="n")
                self.inter.start(actor, getattr(self.plan, op)(actor, n), conn)
        elif actor in self.leases:
            # From the first operation of its release on, a lease no longer counts as live.
            self.inter.start(actor, _flows.release(self.names, self.leases.pop(actor)), conn)
        else:
            blocking = data.draw(st.booleans(), label="blocking")
            timeout = data.draw(st.sampled_from([None, 0.0, 0.5, 2.0]), label="timeout")
            flow = _flows.acquire(
                self.names,
                holder_id=actor,
                policy=self.plan.policy,
                clock=self.broker.now,
                rng=random.random,
                blocking=blocking,
                timeout=timeout,
                hint=data.draw(st.integers(0, 6), label="hint"),
            )
            self.inter.start(actor, flow, conn)

    def step(self, actor: str) -> None:
        handle = self.inter.step(actor)
        if handle.done:
            self.finished(actor)

    def finished(self, actor: str) -> None:
        handle = self.inter.runs[actor]
        if actor in self.admins:
            if handle.error is not None:
                assert isinstance(handle.error, ADMIN_ERRORS), handle.error
                return
            # An admin op just completed (its last op freed the mutex): A[1..after], nothing else.
            assert self.broker.slots(self.names) == list(range(1, handle.result.after + 1))
        elif handle.error is not None:
            assert isinstance(handle.error, CLIENT_ERRORS), handle.error
        elif isinstance(handle.result, Acquired) and handle.result.slot is not None:
            slot = handle.result.slot
            assert slot not in self.leases.values(), (
                f"{actor} got slot {slot}, already leased: {self.leases}"
            )
            # Handed out only if A[slot] existed once B[slot] was ours.
            claim = [r for r in self.broker.log if r.flow == actor][-1]
            if isinstance(claim.op, Notify):  # a passed-on wake token comes last
                claim = [r for r in self.broker.log if r.flow == actor][-2]
            assert claim.op == DeclareHolder(
                self.names.holder(slot), actor, verify=self.names.slot(slot)
            ), claim
            assert claim.result is Claim.HELD, claim
            self.leases[actor] = slot

    def crash(self, victim: int | str) -> None:
        """A client connection (by number) or an admin's connection (by name) dies."""
        if isinstance(victim, str):
            for handle in self.inter.crash(self.conn_of(victim)):
                self.finished(handle.name)
            return
        for handle in self.inter.crash(f"conn{victim}.{self.generation[victim]}"):
            self.finished(handle.name)
        for client in self.clients:
            if self.conn_no[client] == victim:
                self.leases.pop(client, None)
        self.generation[victim] += 1  # the clients reconnect

    def check(self) -> None:
        slots = list(self.leases.values())
        assert len(slots) == len(set(slots)), f"two live leases of one slot: {self.leases}"
        holders = self.broker.holders(self.names)
        for client, slot in self.leases.items():
            # A live lease is really held: its B queue exists and is owned by its connection.
            assert holders.get(slot) == self.conn_of(client), (client, slot, holders)
        # No leaked slots: a B queue belongs to a live lease or to a flow still under way.
        live = {(self.conn_of(c), s) for c, s in self.leases.items()}
        busy_conns = {r.conn for r in self.inter.runs.values() if not r.done}
        for slot, conn in holders.items():
            assert (conn, slot) in live or conn in busy_conns, (slot, conn, self.leases)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    data=st.data(),
    initial=st.integers(1, 4),
    n_clients=st.integers(2, 5),
    n_conns=st.integers(1, 3),
    n_admins=st.integers(0, 2),
)
def test_random_interleavings_never_give_one_slot_to_two_holders(
    data, initial, n_clients, n_conns, n_admins
) -> None:
    n_conns = min(n_conns, n_clients)
    world = World(n_clients, n_conns, n_admins)
    run(world.plan.create("setup", initial), "setup", world.broker)
    actors = world.clients + world.admins
    victims = st.one_of(st.integers(0, n_conns - 1), *(st.just(a) for a in world.admins))
    for _ in range(data.draw(st.integers(10, 150), label="steps")):
        if data.draw(st.integers(0, 40), label="crash?") == 0:
            world.crash(data.draw(victims, label="victim"))
        else:
            actor = data.draw(st.sampled_from(actors), label="actor")
            if world.busy(actor):
                world.step(actor)
            else:
                world.start(actor, data)
        world.check()
    # Let the admins finish (clients frozen): the semaphore ends contiguous.
    for admin in world.admins:
        while world.busy(admin):
            world.step(admin)
            world.check()


def test_a_nacked_probe_is_asked_again_and_only_the_unknown_queues() -> None:
    from amqp_locks._flows import probe

    flow = probe(("a", "b", "c"))
    assert next(flow) == Probe(("a", "b", "c"))
    assert flow.send((True, None, False)) == Probe(("b",))
    with pytest.raises(StopIteration) as done:
        flow.send((True,))
    assert done.value.value == (True, True, False)


def test_a_queue_that_nacks_every_probe_raises_probe_nacked() -> None:
    from amqp_locks._flows import PROBE_ATTEMPTS, probe

    flow = probe(("odd",))
    op = next(flow)
    with pytest.raises(errors.ProbeNackedError, match="odd"):
        for _ in range(PROBE_ATTEMPTS):
            assert op == Probe(("odd",))
            op = flow.send((None,))


def test_an_acquire_that_found_the_semaphore_idle_says_so(broker, plan, names) -> None:
    create(broker, plan, 3)
    assert acquire(broker, names, hint=3).idle
    broker.hold(names, 3, "other")
    # slot 1 is ours now, slot 3 someone else's: not idle any more
    assert not acquire(broker, names, hint=3).idle


def test_on_an_idle_semaphore_acquire_declares_the_guessed_slot_without_probing(
    broker, plan, names
) -> None:
    create(broker, plan, 3)
    mark = broker.mark()
    outcome = acquire(broker, names, hint=3, speculate=1)
    assert (outcome.slot, outcome.collisions, outcome.idle) == (1, 0, True)
    assert broker.ops(since=mark) == [
        DeclareHolder(names.holder(1), "client", verify=names.slot(1))
    ]


def test_a_wrong_guess_on_a_held_slot_costs_one_lost_race_then_the_spec_scan(
    broker, plan, names
) -> None:
    create(broker, plan, 3)
    broker.hold(names, 1, "other")
    mark = broker.mark()
    outcome = acquire(broker, names, hint=3, speculate=1)
    assert (outcome.slot, outcome.collisions, outcome.idle) == (2, 1, False)
    ops = broker.ops(since=mark)
    assert ops[0] == DeclareHolder(names.holder(1), "client", verify=names.slot(1))
    assert isinstance(ops[1], Probe)


def test_a_guess_at_a_removed_slot_gives_the_holder_queue_back_and_scans(
    broker, plan, names
) -> None:
    create(broker, plan, 2)
    mark = broker.mark()
    outcome = acquire(broker, names, hint=5, speculate=5)
    assert outcome.slot == 1
    ops = broker.ops(since=mark)
    assert ops[:2] == [
        DeclareHolder(names.holder(5), "client", verify=names.slot(5)),
        Delete(names.holder(5)),
    ]
    assert names.holder(5) not in broker.exclusive


def test_a_guess_on_a_missing_semaphore_still_raises_not_found(broker, plan, names) -> None:
    with pytest.raises(errors.SemaphoreNotFoundError):
        acquire(broker, names, speculate=1)
    assert names.holder(1) not in broker.exclusive


def test_a_waiter_woken_by_a_release_declares_the_freed_slot_without_probing(
    broker, plan, names
) -> None:
    create(broker, plan, 2)
    broker.hold(names, 1, "other")
    broker.hold(names, 2, "other")
    inter = Interleaver(broker)
    inter.start("w", acquire_flow(broker, names, hint=2, blocking=True, timeout=30), CLIENT)
    inter.step_until("w", lambda op: isinstance(op, AwaitWake))
    broker.execute(Delete(names.holder(2)), "other")  # the holder of slot 2 lets go ...
    broker.execute(Notify(names.wake, slot=2), "other")  # ... and says which slot it freed
    mark = broker.mark()
    outcome = inter.finish("w")
    assert outcome.slot == 2
    assert broker.ops(conn=CLIENT, since=mark)[:2] == [
        AwaitWake(names.wake, broker.ops(conn=CLIENT, since=mark)[0].seconds),
        DeclareHolder(names.holder(2), "client", verify=names.slot(2)),
    ]


def test_an_immediate_reacquire_after_a_contended_release_defers_to_the_woken_waiter(
    broker, plan, names
) -> None:
    create(broker, plan, 1)
    plan.acquired(Acquired(1, collisions=0, count=1, waits=2))  # our last acquire waited
    plan.released()
    flow = plan.acquire("client", blocking=True, timeout=30)
    first = next(flow)
    assert isinstance(first, Sleep)
    assert 0 < first.seconds <= plan.policy.defer
    flow.close()


def test_no_deference_when_uncontended_or_not_blocking_or_long_after(
    broker, plan, names
) -> None:
    create(broker, plan, 1)
    plan.acquired(Acquired(1, collisions=0, count=1, waits=0))
    plan.released()
    assert not isinstance(next(plan.acquire("client", blocking=True, timeout=30)), Sleep)
    plan.acquired(Acquired(1, collisions=1, count=1, waits=0))
    plan.released()
    assert not isinstance(next(plan.acquire("client", blocking=False, timeout=None)), Sleep)
    plan.released_at -= 1.0  # released a second ago: nobody is racing us any more
    assert not isinstance(next(plan.acquire("client", blocking=True, timeout=30)), Sleep)
