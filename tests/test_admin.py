"""Administration on a real broker: create, ensure, add, remove, resize, destroy."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pika
import pytest
from helpers import existing_queues, semaphore_queues, slot_queues_present

from amqp_locks import Semaphore, SemaphoreAdmin, errors


@pytest.fixture
def admin(rabbitmq_url: str, amqp_namespace: str) -> Iterator[SemaphoreAdmin]:
    with SemaphoreAdmin("sem", url=rabbitmq_url, namespace=amqp_namespace) as admin:
        yield admin
        admin.destroy()


def base(ns: str) -> str:
    return f"{ns}sem"


def test_create_makes_contiguous_slot_queues_and_a_wake_queue(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    assert not admin.exists()
    assert admin.slots() == 0
    assert admin.create(3) == 3
    assert admin.exists()
    assert admin.slots() == 3
    assert slot_queues_present(rabbitmq_url, base(amqp_namespace)) == [1, 2, 3]
    # the admin mutex is released after the operation
    present = existing_queues(rabbitmq_url, [base(amqp_namespace), base(amqp_namespace) + "-0-W"])
    assert present == {base(amqp_namespace) + "-0-W"}


def test_create_on_an_existing_semaphore_raises_and_changes_nothing(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(2)
    with pytest.raises(errors.SemaphoreExistsError, match="already exists with 2"):
        admin.create(5)
    assert slot_queues_present(rabbitmq_url, base(amqp_namespace)) == [1, 2]


def test_ensure_creates_then_resizes_idempotently(admin: SemaphoreAdmin) -> None:
    assert admin.ensure(2) == 2
    assert admin.ensure(2) == 2
    assert admin.ensure(5) == 5
    assert admin.slots() == 5
    assert admin.ensure(1) == 1
    assert admin.slots() == 1


def test_add_remove_resize_return_the_new_count(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(2)
    assert admin.add(3) == 5
    assert admin.remove(2) == 3
    assert admin.resize(6) == 6
    assert admin.resize(2) == 2
    assert slot_queues_present(rabbitmq_url, base(amqp_namespace)) == [1, 2]


def test_remove_more_than_exist_stops_at_zero(admin: SemaphoreAdmin) -> None:
    admin.create(2)
    assert admin.remove(5) == 0
    assert not admin.exists()


@pytest.mark.parametrize("method", ["add", "remove", "resize"])
def test_changing_a_missing_semaphore_raises_not_found(admin: SemaphoreAdmin, method: str) -> None:
    with pytest.raises(errors.SemaphoreNotFoundError):
        getattr(admin, method)(1)


def test_destroy_removes_every_queue_and_is_idempotent(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(4)
    admin.destroy()
    admin.destroy()
    assert existing_queues(rabbitmq_url, semaphore_queues(base(amqp_namespace))) == set()


@pytest.mark.parametrize(
    ("call", "args"),
    [
        ("create", (0,)),
        ("create", (-1,)),
        ("create", (1.5,)),
        ("create", ("3",)),
        ("create", (True,)),
        ("create", (100_001,)),
        ("ensure", (0,)),
        ("add", (0,)),
        ("remove", (0,)),
        ("resize", (None,)),
    ],
)
def test_bad_counts_raise_invalid_argument_and_touch_nothing(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str, call: str, args: tuple
) -> None:
    with pytest.raises(errors.InvalidArgumentError):
        getattr(admin, call)(*args)
    assert existing_queues(rabbitmq_url, semaphore_queues(base(amqp_namespace))) == set()


@pytest.mark.parametrize("timeout", [-1, "5", float("nan")])
def test_bad_timeouts_raise_invalid_argument(admin: SemaphoreAdmin, timeout: object) -> None:
    admin.create(1)
    with pytest.raises(errors.InvalidArgumentError):
        admin.remove(1, wait=True, timeout=timeout)  # type: ignore[arg-type]
    assert admin.slots() == 1


def test_stray_slot_queues_above_the_count_are_pruned(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(6)
    # Someone deletes slot 3 by hand: "swiss cheese" with 4..6 stranded above the count.
    conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    conn.channel().queue_delete(f"{base(amqp_namespace)}-3-A")
    conn.close()
    assert admin.slots() == 2
    admin.ensure(2)
    assert slot_queues_present(rabbitmq_url, base(amqp_namespace)) == [1, 2]


def test_a_queue_with_foreign_arguments_gives_a_clear_error(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    conn.channel().queue_declare(f"{base(amqp_namespace)}-2-A", durable=True)
    conn.close()
    with pytest.raises(errors.QueueMismatchError, match=r"-2-A") as info:
        admin.create(3)
    assert info.value.queue == f"{base(amqp_namespace)}-2-A"
    # the admin mutex was given back despite the failure
    assert existing_queues(rabbitmq_url, [base(amqp_namespace)]) == set()


def test_admin_operations_serialise_on_the_admin_mutex(
    rabbitmq_url: str, amqp_namespace: str
) -> None:
    blocker = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    blocker.channel().queue_declare(base(amqp_namespace), exclusive=True)
    admin = SemaphoreAdmin("sem", url=rabbitmq_url, namespace=amqp_namespace, admin_attempts=5)
    try:
        t0 = time.monotonic()
        with pytest.raises(errors.AdminBusyError, match="admin mutex"):
            admin.create(1)
        assert time.monotonic() - t0 < 5
        assert not admin.exists()
        blocker.close()
        assert admin.create(1) == 1
    finally:
        admin.destroy()
        admin.close()


def test_held_lists_slots_with_holders(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(3)
    sem = Semaphore("sem", url=rabbitmq_url, namespace=amqp_namespace)
    try:
        assert admin.held() == []
        a, b = sem.acquire(timeout=5), sem.acquire(timeout=5)
        assert admin.held() == sorted([a.slot, b.slot])
        a.release()
        assert admin.held() == [b.slot]
    finally:
        sem.close()


def test_remove_with_wait_returns_when_the_evicted_holder_lets_go(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(2)
    sem = Semaphore("sem", url=rabbitmq_url, namespace=amqp_namespace)
    try:
        sem.acquire(timeout=5)
        top = sem.acquire(timeout=5)
        assert top.slot == 2
        threading.Timer(0.5, top.release).start()
        t0 = time.monotonic()
        assert admin.remove(1, wait=True, timeout=10) == 1
        assert 0.4 < time.monotonic() - t0 < 5
        assert admin.held() == [1]
    finally:
        sem.close()


def test_wait_released_times_out_while_a_removed_slot_is_held(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(2)
    sem = Semaphore("sem", url=rabbitmq_url, namespace=amqp_namespace)
    try:
        sem.acquire(timeout=5)
        top = sem.acquire(timeout=5)
        with pytest.raises(errors.ReleaseTimeoutError) as info:
            admin.resize(1, wait=True, timeout=0.3)
        assert info.value.slots == (2,)
        assert admin.slots() == 1  # the removal itself is done
        assert admin.wait_released(timeout=0.2) is False
        assert admin.wait_released(slots=[1], timeout=0.2) is False
        top.release()
        assert admin.wait_released(timeout=5) is True
    finally:
        sem.close()


def test_destroy_with_wait_waits_for_every_holder(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(1)
    sem = Semaphore("sem", url=rabbitmq_url, namespace=amqp_namespace)
    try:
        lease = sem.acquire(timeout=5)
        threading.Timer(0.3, lease.release).start()
        admin.destroy(wait=True, timeout=10)
        assert not lease.held
        assert not admin.exists()
    finally:
        sem.close()


@pytest.mark.parametrize("slots", ["12", [0], [1, "2"], 3, [True]])
def test_bad_slot_lists_for_wait_released_are_invalid_arguments(
    admin: SemaphoreAdmin, slots: object
) -> None:
    with pytest.raises(errors.InvalidArgumentError):
        admin.wait_released(slots=slots, timeout=0.1)  # type: ignore[arg-type]


def test_a_connection_of_the_wrong_kind_is_refused(rabbitmq_url: str) -> None:
    from amqp_locks.aio import Connection as AsyncConnection

    with pytest.raises(errors.InvalidArgumentError, match=r"amqp_locks\.Connection"):
        SemaphoreAdmin("x", connection=AsyncConnection(rabbitmq_url))  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError):
        Semaphore("x", connection=object())  # type: ignore[arg-type]
