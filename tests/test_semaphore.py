"""Lock clients on a real broker (sync API): acquire, try, time out, release, lose."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pika
import pytest
from helpers import existing_queues

from amqp_locks import Connection, Lease, Mutex, Semaphore, SemaphoreAdmin, errors


@pytest.fixture
def admin(rabbitmq_url: str, amqp_namespace: str) -> Iterator[SemaphoreAdmin]:
    with SemaphoreAdmin("sem", url=rabbitmq_url, namespace=amqp_namespace) as admin:
        admin.create(3)
        yield admin
        admin.destroy()


@pytest.fixture
def sem(admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str) -> Iterator[Semaphore]:
    sem = Semaphore("sem", url=rabbitmq_url, namespace=amqp_namespace)
    yield sem
    sem.close()


def test_acquire_takes_the_lowest_free_slots(sem: Semaphore) -> None:
    leases = [sem.acquire(timeout=5) for _ in range(3)]
    assert [lease.slot for lease in leases] == [1, 2, 3]
    assert all(lease.held for lease in leases)


def test_when_all_slots_are_held_try_acquire_returns_none(sem: Semaphore) -> None:
    for _ in range(3):
        sem.acquire(timeout=5)
    assert sem.try_acquire() is None


def test_when_all_slots_are_held_acquire_times_out(sem: Semaphore) -> None:
    for _ in range(3):
        sem.acquire(timeout=5)
    t0 = time.monotonic()
    with pytest.raises(errors.AcquireTimeoutError) as info:
        sem.acquire(timeout=0.5)
    assert 0.45 < time.monotonic() - t0 < 3
    assert isinstance(info.value, TimeoutError)


def test_timeout_zero_is_one_attempt(sem: Semaphore) -> None:
    assert sem.acquire(timeout=0).slot == 1
    for _ in range(2):
        sem.acquire(timeout=5)
    with pytest.raises(errors.AcquireTimeoutError):
        sem.acquire(timeout=0)


def test_release_frees_the_slot_for_the_next_client(
    sem: Semaphore, rabbitmq_url: str, amqp_namespace: str
) -> None:
    leases = [sem.acquire(timeout=5) for _ in range(3)]
    leases[1].release()
    assert not leases[1].held
    leases[1].release()  # idempotent
    assert not existing_queues(rabbitmq_url, [f"{amqp_namespace}sem-2-B"])
    again = sem.try_acquire()
    assert again is not None and again.slot == 2


def test_with_block_releases_on_exit_and_on_error(sem: Semaphore) -> None:
    with sem.acquire(timeout=5) as lease:
        assert lease.held
    assert not lease.held
    with pytest.raises(RuntimeError), sem.acquire(timeout=5) as lease2:
        raise RuntimeError("boom")
    assert not lease2.held
    with sem as lease3:
        assert lease3.slot == 1
    assert not lease3.held


def test_semaphore_context_manager_nests_per_thread(sem: Semaphore) -> None:
    with sem as outer, sem as inner:
        assert {outer.slot, inner.slot} == {1, 2}
        assert outer.held and inner.held
    assert not outer.held and not inner.held


def test_a_blocked_acquire_wakes_on_release_not_on_its_poll(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    sem = Semaphore("sem", url=rabbitmq_url, namespace=amqp_namespace, poll_interval=60)
    waiter_sem = Semaphore("sem", url=rabbitmq_url, namespace=amqp_namespace, poll_interval=60)
    try:
        leases = [sem.acquire(timeout=5) for _ in range(3)]
        got: list[float] = []

        def wait() -> None:
            lease = waiter_sem.acquire(timeout=30)
            got.append(time.monotonic())
            lease.release()

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.5)
        released_at = time.monotonic()
        leases[0].release()
        thread.join(10)
        assert got, "the waiter did not wake"
        assert got[0] - released_at < 1.0
    finally:
        sem.close()
        waiter_sem.close()


def test_added_slots_wake_waiters(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    sem = Semaphore("sem", url=rabbitmq_url, namespace=amqp_namespace, poll_interval=60)
    try:
        for _ in range(3):
            sem.acquire(timeout=5)
        threading.Timer(0.3, admin.add, args=(1,)).start()
        t0 = time.monotonic()
        lease = sem.acquire(timeout=10)
        assert lease.slot == 4
        assert time.monotonic() - t0 < 2
    finally:
        sem.close()


def test_acquire_on_a_missing_semaphore_raises_not_found(
    rabbitmq_url: str, amqp_namespace: str
) -> None:
    sem = Semaphore("nothing", url=rabbitmq_url, namespace=amqp_namespace)
    try:
        with pytest.raises(errors.SemaphoreNotFoundError, match="does not exist"):
            sem.acquire(timeout=1)
        with pytest.raises(errors.SemaphoreNotFoundError):
            sem.try_acquire()
        assert not existing_queues(rabbitmq_url, [f"{amqp_namespace}nothing-1-B"])
    finally:
        sem.close()


def test_a_removed_slot_marks_its_lease_lost_and_leaving_raises(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    conn = Connection(rabbitmq_url, verify_interval=0.2)
    sem = Semaphore("sem", namespace=amqp_namespace, connection=conn)
    lost: list[Lease] = []
    try:
        with (
            pytest.raises(errors.LockLostError, match="slot 3"),
            sem.acquire(timeout=5) as a,
            sem.acquire(timeout=5) as b,
            sem.acquire(timeout=5, on_lost=lost.append) as c,
        ):
            assert c.slot == 3
            admin.remove(1)
            deadline = time.monotonic() + 5
            while c.held and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not c.held
            assert c.lost and "deleted" in (c.lost_reason or "")
            assert lost == [c]
            assert a.held and b.held
        assert c.verify() is False
    finally:
        conn.close()


def test_an_exception_in_the_block_wins_over_lock_lost(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    sem = Semaphore("sem", url=rabbitmq_url, namespace=amqp_namespace)
    try:
        with pytest.raises(KeyError), sem.acquire(timeout=5) as lease:
            sem.connection.close()  # the connection dies under the lease
            assert not lease.held
            raise KeyError("user error")
    finally:
        sem.close()


def test_closing_the_connection_marks_leases_released_not_lost(sem: Semaphore) -> None:
    lease = sem.acquire(timeout=5)
    sem.close()
    assert not lease.held
    assert not lease.lost
    with pytest.raises(errors.ClosedError):
        sem.acquire(timeout=1)


def test_verify_confirms_a_held_lease(sem: Semaphore) -> None:
    lease = sem.acquire(timeout=5)
    assert lease.verify() is True
    lease.release()
    assert lease.verify() is False


def test_threads_sharing_a_connection_never_share_a_slot(sem: Semaphore) -> None:
    # One connection may re-declare its own exclusive queue; the library must not let
    # two of its threads both "hold" a slot that way.
    barrier = threading.Barrier(6)
    slots: list[int | None] = []
    lock = threading.Lock()

    def grab() -> None:
        barrier.wait()
        lease = sem.try_acquire()
        with lock:
            slots.append(lease.slot if lease else None)

    threads = [threading.Thread(target=grab) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    taken = [s for s in slots if s is not None]
    assert sorted(taken) == [1, 2, 3]
    assert slots.count(None) == 3


def test_holder_identity_is_visible_on_the_broker(
    sem: Semaphore, rabbitmq_url: str, amqp_namespace: str
) -> None:
    lease = sem.acquire(timeout=5)
    assert lease.holder_id.startswith(sem.connection.client_id)
    assert threading.current_thread().name in lease.holder_id
    # Another connection re-declaring the B queue passively gets RESOURCE_LOCKED: proof
    # the queue is exclusive to our connection.
    conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
            conn.channel().queue_declare(f"{amqp_namespace}sem-{lease.slot}-B", passive=True)
        assert info.value.reply_code == 405
    finally:
        conn.close()


def test_mutex_is_a_one_slot_semaphore(rabbitmq_url: str, amqp_namespace: str) -> None:
    mutex = Mutex("job", url=rabbitmq_url, namespace=amqp_namespace)
    other = Mutex("job", url=rabbitmq_url, namespace=amqp_namespace)
    try:
        with pytest.raises(errors.SemaphoreNotFoundError):
            other.try_acquire()
        mutex.create()
        with pytest.raises(errors.SemaphoreExistsError):
            mutex.create()
        mutex.ensure()
        with mutex as lease:
            assert lease.slot == 1
            assert other.try_acquire() is None
        assert other.acquire(timeout=5).slot == 1
    finally:
        mutex.destroy()
        mutex.close()
        other.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"heartbeat": 0},
        {"heartbeat": 1.5},
        {"connect_timeout": 0},
        {"poll_interval": 0},
        {"poll_interval": -1},
        {"max_collisions": 0},
        {"client_id": ""},
    ],
)
def test_bad_options_fail_at_construction(kwargs: dict[str, object]) -> None:
    with pytest.raises(errors.InvalidArgumentError):
        Semaphore("x", url="amqp://guest:guest@127.0.0.1:1/%2F", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("url", ["http://localhost", "localhost:5672", 5672])
def test_bad_urls_fail_at_construction(url: object) -> None:
    with pytest.raises(errors.InvalidArgumentError):
        Semaphore("x", url=url)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [-0.1, "1", float("nan")])
def test_bad_acquire_timeouts_fail_before_any_io(sem: Semaphore, timeout: object) -> None:
    with pytest.raises(errors.InvalidArgumentError):
        sem.acquire(timeout=timeout)  # type: ignore[arg-type]


def test_url_and_connection_together_are_refused(rabbitmq_url: str) -> None:
    with Connection(rabbitmq_url) as conn, pytest.raises(errors.InvalidArgumentError):
        Semaphore("x", url=rabbitmq_url, connection=conn)


def test_an_unreachable_broker_fails_fast_with_broker_unavailable() -> None:
    sem = Semaphore("x", url="amqp://guest:guest@127.0.0.1:1/%2F", connect_timeout=2)
    t0 = time.monotonic()
    with pytest.raises(errors.BrokerUnavailableError, match="could not connect"):
        sem.acquire(timeout=1)
    assert time.monotonic() - t0 < 3.5
    sem.close()


def test_a_blackholed_broker_fails_within_the_connect_timeout() -> None:
    # 192.0.2.0/24 is TEST-NET-1... but nothing may leave this machine: use a local socket
    # that accepts TCP and never speaks AMQP instead.
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    try:
        sem = Semaphore("x", url=f"amqp://guest:guest@127.0.0.1:{port}/%2F", connect_timeout=1)
        t0 = time.monotonic()
        with pytest.raises(errors.BrokerUnavailableError):
            sem.acquire(timeout=1)
        assert time.monotonic() - t0 < 3
        sem.close()
    finally:
        server.close()


def test_wrong_credentials_are_broker_unavailable_with_a_hint(rabbitmq_url: str) -> None:
    url = rabbitmq_url.replace("guest:guest@", "guest:wrong@")
    sem = Semaphore("x", url=url, connect_timeout=3)
    with pytest.raises(errors.BrokerUnavailableError, match="credentials"):
        sem.try_acquire()
    sem.close()


def test_a_nacked_probe_is_an_error_not_a_missing_queue(
    rabbitmq_url: str, amqp_namespace: str
) -> None:
    # A queue that rejects publishes when full nacks every probe: the library must not read
    # that as "no such queue" (which would mean "semaphore missing" or "slot free").
    conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    conn.channel().queue_declare(
        f"{amqp_namespace}odd-1-A",
        durable=True,
        arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
    )
    sem = Semaphore("odd", url=rabbitmq_url, namespace=amqp_namespace)
    try:
        with pytest.raises(errors.ProbeNackedError, match="odd-1-A"):
            sem.try_acquire()
        assert not existing_queues(rabbitmq_url, [f"{amqp_namespace}odd-1-B"])
    finally:
        sem.close()
        conn.channel().queue_delete(f"{amqp_namespace}odd-1-A")
        conn.close()
