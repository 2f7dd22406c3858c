"""The asyncio face on a real broker: twins of the main sync cases, plus cancellation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from helpers import existing_queues, semaphore_queues

from amqp_locks import errors
from amqp_locks.aio import Connection, Lease, Mutex, Semaphore, SemaphoreAdmin
from amqp_locks.broker import LocalBroker


@pytest.fixture
async def admin(rabbitmq_url: str, amqp_namespace: str) -> AsyncIterator[SemaphoreAdmin]:
    async with SemaphoreAdmin("sem", url=rabbitmq_url, namespace=amqp_namespace) as admin:
        await admin.create(3)
        yield admin
        await admin.destroy()


@pytest.fixture
async def sem(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> AsyncIterator[Semaphore]:
    sem = Semaphore("sem", url=rabbitmq_url, namespace=amqp_namespace)
    yield sem
    await sem.close()


async def test_admin_lifecycle(rabbitmq_url: str, amqp_namespace: str) -> None:
    async with SemaphoreAdmin("life", url=rabbitmq_url, namespace=amqp_namespace) as admin:
        assert not await admin.exists()
        assert await admin.create(2) == 2
        with pytest.raises(errors.SemaphoreExistsError):
            await admin.create(2)
        assert await admin.ensure(4) == 4
        assert await admin.add(1) == 5
        assert await admin.remove(2) == 3
        assert await admin.resize(1) == 1
        assert await admin.slots() == 1
        await admin.destroy()
        assert not await admin.exists()
        with pytest.raises(errors.SemaphoreNotFoundError):
            await admin.resize(2)
    left = existing_queues(rabbitmq_url, semaphore_queues(f"{amqp_namespace}life"))
    assert left == set()


async def test_acquire_all_then_try_returns_none_and_acquire_times_out(sem: Semaphore) -> None:
    leases = [await sem.acquire(timeout=5) for _ in range(3)]
    assert [lease.slot for lease in leases] == [1, 2, 3]
    assert await sem.try_acquire() is None
    t0 = time.monotonic()
    with pytest.raises(errors.AcquireTimeoutError):
        await sem.acquire(timeout=0.4)
    assert 0.35 < time.monotonic() - t0 < 3


async def test_async_with_releases_and_a_released_slot_is_reused(sem: Semaphore) -> None:
    async with sem.acquire(timeout=5) as lease:
        assert lease.held and lease.slot == 1
    assert not lease.held
    async with sem as again:
        assert again.slot == 1
    again_lease = await sem.acquire(timeout=5)
    await again_lease.release()
    await again_lease.release()


async def test_tasks_sharing_a_connection_never_share_a_slot(sem: Semaphore) -> None:
    results = await asyncio.gather(*(sem.try_acquire() for _ in range(6)))
    taken = sorted(lease.slot for lease in results if lease is not None)
    assert taken == [1, 2, 3]


async def test_a_blocked_acquire_wakes_on_release(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    holder = Semaphore("sem", url=rabbitmq_url, namespace=amqp_namespace, poll_interval=60)
    waiter = Semaphore("sem", url=rabbitmq_url, namespace=amqp_namespace, poll_interval=60)
    try:
        leases = [await holder.acquire(timeout=5) for _ in range(3)]
        task = asyncio.create_task(waiter.acquire(timeout=30).__aenter__())
        await asyncio.sleep(0.3)
        released = time.monotonic()
        await leases[2].release()
        lease = await asyncio.wait_for(task, 10)
        assert lease.slot == 3
        assert time.monotonic() - released < 1.0
    finally:
        await holder.close()
        await waiter.close()


async def test_cancelling_a_blocked_acquire_leaves_nothing_held(
    sem: Semaphore, admin: SemaphoreAdmin
) -> None:
    leases = [await sem.acquire(timeout=5) for _ in range(3)]
    task = asyncio.ensure_future(sem.acquire(timeout=30))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for lease in leases:
        await lease.release()
    await asyncio.sleep(0.2)
    assert await admin.held() == []


async def test_cancellation_racing_the_declare_leaves_nothing_held(
    sem: Semaphore, admin: SemaphoreAdmin
) -> None:
    # Cancel at many points of an acquire in flight; none may leave a B queue behind.
    for delay in [0, 0.0005, 0.001, 0.002, 0.003, 0.005]:
        task = asyncio.ensure_future(sem.acquire(timeout=5))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            lease = await task
        except asyncio.CancelledError:
            continue
        await lease.release()
    await asyncio.sleep(0.3)
    assert await admin.held() == []


async def test_lost_lease_raises_on_leaving_and_fires_on_lost(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    conn = Connection(rabbitmq_url, verify_interval=0.2)
    sem = Semaphore("sem", namespace=amqp_namespace, connection=conn)
    lost: list[Lease] = []
    try:
        await sem.acquire(timeout=5)
        await sem.acquire(timeout=5)
        with pytest.raises(errors.LockLostError):
            async with sem.acquire(timeout=5, on_lost=lost.append) as lease:
                assert lease.slot == 3
                await admin.remove(1)
                for _ in range(100):
                    if not lease.held:
                        break
                    await asyncio.sleep(0.05)
                assert lost == [lease]
        assert await lease.verify() is False
    finally:
        await conn.close()


@pytest.mark.slow
async def test_broker_restart_marks_every_lease_lost_and_keeps_the_slots(
    local_broker: LocalBroker, amqp_namespace: str
) -> None:
    url = local_broker.url
    async with SemaphoreAdmin("sem", url=url, namespace=amqp_namespace) as admin:
        await admin.create(3)
    sem = Semaphore("sem", url=url, namespace=amqp_namespace, heartbeat=2)
    lost: list[Lease] = []
    try:
        a = await sem.acquire(timeout=5, on_lost=lost.append)
        b = await sem.acquire(timeout=5, on_lost=lost.append)
        await asyncio.get_running_loop().run_in_executor(None, local_broker.restart)
        for _ in range(100):
            if len(lost) == 2:
                break
            await asyncio.sleep(0.05)
        assert not a.held and not b.held
        assert a.lost and b.lost
        assert sorted(x.slot for x in lost) == [1, 2]
        with pytest.raises(errors.LockLostError):
            async with a:
                pass
        c = await sem.acquire(timeout=10)  # a new connection; the slots survived
        assert c.slot == 1
        await c.release()
        async with SemaphoreAdmin("sem", url=url, namespace=amqp_namespace) as admin:
            assert await admin.slots() == 3
            await admin.destroy()
    finally:
        await sem.close()


async def test_mutex(rabbitmq_url: str, amqp_namespace: str) -> None:
    mutex = Mutex("m", url=rabbitmq_url, namespace=amqp_namespace)
    try:
        await mutex.create()
        async with mutex as lease:
            assert lease.slot == 1
            assert await mutex.try_acquire() is None
    finally:
        await mutex.destroy()
        await mutex.close()


async def test_bad_arguments_fail_before_any_io(sem: Semaphore) -> None:
    with pytest.raises(errors.InvalidArgumentError):
        sem.acquire(timeout=-1)
    with pytest.raises(errors.InvalidNameError):
        Semaphore("amq.x")


async def test_unreachable_broker_fails_fast() -> None:
    sem = Semaphore("x", url="amqp://guest:guest@127.0.0.1:1/%2F", connect_timeout=2)
    t0 = time.monotonic()
    with pytest.raises(errors.BrokerUnavailableError):
        await sem.acquire(timeout=1)
    assert time.monotonic() - t0 < 3.5
    await sem.close()


async def test_a_nacked_probe_is_an_error_not_a_missing_queue(
    rabbitmq_url: str, amqp_namespace: str
) -> None:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    conn.channel().queue_declare(
        f"{amqp_namespace}odd-1-A",
        durable=True,
        arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
    )
    sem = Semaphore("odd", url=rabbitmq_url, namespace=amqp_namespace)
    try:
        with pytest.raises(errors.ProbeNackedError, match="odd-1-A"):
            await sem.try_acquire()
    finally:
        await sem.close()
        conn.channel().queue_delete(f"{amqp_namespace}odd-1-A")
        conn.close()
