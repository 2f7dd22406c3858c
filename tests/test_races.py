"""Regression tests for races found in review: many threads and tasks per connection, hard
contention, aborted operations. Each asserts the invariant, not just "no exception"."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from helpers import existing_queues

from amqp_locks import Connection, Semaphore, SemaphoreAdmin, aio


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_threads_on_shared_connections_never_double_hold_under_hard_contention(
    rabbitmq_url: str, amqp_namespace: str
) -> None:
    # Lost races close channels, so runs often wait for a fresh channel before declaring:
    # the connection's book of held queues must cover that wait too.
    with SemaphoreAdmin("hot", url=rabbitmq_url, namespace=amqp_namespace) as admin:
        admin.create(3)
        conns = [Connection(rabbitmq_url) for _ in range(3)]
        holders: dict[int, object] = {}
        lock = threading.Lock()
        violations: list[tuple[int, bool, bool]] = []
        count = [0]
        stop = time.monotonic() + 5

        def work(conn: Connection) -> None:
            sem = Semaphore("hot", namespace=amqp_namespace, connection=conn, poll_interval=0.05)
            rng = random.Random()
            while time.monotonic() < stop:
                lease = sem.acquire(timeout=10) if rng.random() < 0.7 else sem.try_acquire()
                if lease is None:
                    continue
                with lock:
                    other = holders.get(lease.slot)
                    if other is not None and other.held:  # type: ignore[attr-defined]
                        violations.append((lease.slot, other.verify(), lease.verify()))  # type: ignore[attr-defined]
                    holders[lease.slot] = lease
                    count[0] += 1
                time.sleep(rng.random() * 0.002)
                with lock:
                    if holders.get(lease.slot) is lease:
                        del holders[lease.slot]
                lease.release()

        threads = [threading.Thread(target=work, args=(conns[i % 3],)) for i in range(24)]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert not any(thread.is_alive() for thread in threads)
            assert count[0] > 100
            assert violations == []
            assert admin.held() == []
        finally:
            for conn in conns:
                conn.close()
            admin.destroy()


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_tasks_on_shared_connections_never_double_hold_under_hard_contention(
    rabbitmq_url: str, amqp_namespace: str
) -> None:
    async with aio.SemaphoreAdmin("hot", url=rabbitmq_url, namespace=amqp_namespace) as admin:
        await admin.create(3)
        conns = [aio.Connection(rabbitmq_url) for _ in range(2)]
        holders: dict[int, aio.Lease] = {}
        violations: list[int] = []
        count = [0]
        stop = time.monotonic() + 5

        async def work(conn: aio.Connection) -> None:
            sem = aio.Semaphore(
                "hot", namespace=amqp_namespace, connection=conn, poll_interval=0.05
            )
            rng = random.Random()
            while time.monotonic() < stop:
                if rng.random() < 0.7:
                    lease: aio.Lease | None = await sem.acquire(timeout=30)
                else:
                    lease = await sem.try_acquire()
                if lease is None:
                    continue
                other = holders.get(lease.slot)
                if other is not None and other.held:
                    violations.append(lease.slot)
                holders[lease.slot] = lease
                count[0] += 1
                await asyncio.sleep(rng.random() * 0.002)
                if holders.get(lease.slot) is lease:
                    del holders[lease.slot]
                await lease.release()

        try:
            await asyncio.gather(*(work(conns[i % 2]) for i in range(16)))
            assert count[0] > 100
            assert violations == []
            assert await admin.held() == []
        finally:
            for conn in conns:
                await conn.close()
            await admin.destroy()


def test_a_lease_lost_to_a_slot_removal_lets_go_of_its_holder_queue_on_release(
    rabbitmq_url: str, amqp_namespace: str
) -> None:
    # Until the holder stops, wait_released must keep waiting; once it releases, the holder
    # queue must go, even though the lease was already lost.
    with SemaphoreAdmin("gone", url=rabbitmq_url, namespace=amqp_namespace) as admin:
        admin.create(1)
        conn = Connection(rabbitmq_url, verify_interval=0.2)
        sem = Semaphore("gone", namespace=amqp_namespace, connection=conn)
        try:
            lease = sem.acquire(timeout=5)
            admin.remove(1)
            deadline = time.monotonic() + 5
            while lease.held and time.monotonic() < deadline:
                time.sleep(0.05)
            assert lease.lost
            assert admin.wait_released(slots=[1], timeout=0.3) is False  # still running
            lease.release()
            assert admin.wait_released(slots=[1], timeout=5) is True
            assert not existing_queues(rabbitmq_url, [f"{amqp_namespace}gone-1-B"])
            assert conn._io is not None and not conn._io.claims
        finally:
            conn.close()
            admin.destroy()


def test_an_acquire_aborted_while_its_declare_is_in_flight_leaves_nothing_held(
    rabbitmq_url: str, amqp_namespace: str
) -> None:
    # What a KeyboardInterrupt does to a blocked sync acquire: the flow is aborted while the
    # broker may still be creating the holder queue.
    from amqp_locks import _flows
    from amqp_locks._common import SemaphorePlan, make_policy

    with SemaphoreAdmin("abort", url=rabbitmq_url, namespace=amqp_namespace) as admin:
        admin.create(1)
        plan = SemaphorePlan("abort", amqp_namespace, make_policy())
        with Connection(rabbitmq_url) as conn:
            io = conn._live()
            for _ in range(10):
                flow = _flows.acquire(
                    plan.names,
                    holder_id="t",
                    policy=plan.policy,
                    clock=time.monotonic,
                    rng=random.random,
                    blocking=False,
                    timeout=None,
                    speculate=1,  # straight to the declare
                )
                future, cancel = io.submit(flow)
                cancel()
                try:
                    future.result(5)
                except Exception:
                    pass
                else:
                    continue
                deadline = time.monotonic() + 5
                while io.claims and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert not io.claims
                assert admin.held() == []
        admin.destroy()
