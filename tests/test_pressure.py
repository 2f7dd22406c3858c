"""Pressure queues (``PressureQueue``) on a real broker: every operation and error, FIFO, exact
stats, blocking and waking, receive/peek/delivery limits, replication, bad inputs.

Every queue is made with the test's ``amqp_namespace`` as its prefix and deleted afterwards.
What is on the broker is checked independently of the library, with plain pika (``helpers``):
passive declares while a queue lives, confirmed mandatory publishes once it should be gone.
Failure cases with real processes are in ``test_pressure_failures.py``.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pika
import pika.exceptions
import pytest
from helpers import (
    assert_pressure_gone,
    credits,
    declared_queues,
    expected_stats,
    pressure_queues,
)

from amqp_locks import PressureQueue, Producing, errors
from amqp_locks._pressure import MAX_BOUND

MakeQueue = Callable[..., PressureQueue]

ITEMS = [b"a", b"bb", b"", b"dddd", b"\x00\xff binary", b"f" * 1000]


@pytest.fixture
def make_queue(rabbitmq_url: str, amqp_namespace: str) -> Iterator[MakeQueue]:
    """``make_queue(name="q", bound=None, **create_kwargs)``: a PressureQueue on a connection of
    its own (created first unless ``bound`` is None); deleted and disconnected afterwards."""
    made: list[PressureQueue] = []

    def make(
        name: str = "q", bound: int | None = None, client_id: str | None = None, **create: Any
    ) -> PressureQueue:
        q = PressureQueue(name, url=rabbitmq_url, prefix=amqp_namespace, client_id=client_id)
        made.append(q)
        if bound is not None:
            q.create(bound, **create)
        return q

    yield make
    names = {q.name for q in made}
    for q in made:
        q.disconnect()  # roles still held by a failed test are freed with their connection
    for name in names:
        q = PressureQueue(name, url=rabbitmq_url, prefix=amqp_namespace)
        with contextlib.suppress(errors.QueueDoesNotExistError):
            q.delete(timeout=10)
        q.disconnect()


def data_consumers(url: str, q: PressureQueue, suffix: str = "") -> int:
    info = declared_queues(url, [q.base + suffix])[q.base + suffix]
    assert info is not None
    return info[1]


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class Background:
    """Run ``fn`` in a thread; remember its result or exception and when it finished."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.finished_at = time.monotonic()

    def join(self, timeout: float = 10.0) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "background call still blocked"
        if self.error is not None:
            raise self.error
        return self.result


# ------------------------------------------------------------------------------------------
# create, exists, state
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", [0, 3])
def test_create_and_initial_state(make_queue: MakeQueue, rabbitmq_url: str, bound: int) -> None:
    q = make_queue()
    assert q.exists() is False
    assert not declared_queues(rabbitmq_url, pressure_queues(q.base))
    q.create(bound)
    assert q.exists() is True
    assert q.length() == 0
    assert q.closed() is False
    assert q.stats() == expected_stats([], [])
    assert q.producer_id() is None
    assert q.consumer_id() is None
    assert q.bound() == bound
    assert q.dead_length() == 0
    on_broker = declared_queues(rabbitmq_url, pressure_queues(q.base))
    durable = {q.base, f"{q.base}:stats:produced", f"{q.base}:stats:consumed"}
    durable |= {f"{q.base}:attempts", f"{q.base}:dead", f"{q.base}:bound"}
    roles = {f"{q.base}:producer-1-A", f"{q.base}:consumer-1-A"}
    assert durable | roles <= set(on_broker)
    # The lock is released; nobody holds a role (no holder queue).
    assert f"{q.base}:lock" not in on_broker
    assert not {f"{q.base}:producer-1-B", f"{q.base}:consumer-1-B"} & set(on_broker)
    if bound:
        assert on_broker[f"{q.base}:space"] == (bound, 0)  # one credit per free place
    else:
        assert f"{q.base}:space" not in on_broker
    with pytest.raises(errors.QueueAlreadyExistsError):
        q.create(bound)
    with pytest.raises(errors.QueueAlreadyExistsError):
        make_queue().create(bound + 1)
    assert q.bound() == bound  # the failed creates changed nothing
    assert q.stats() == expected_stats([], [])


def test_exists_is_seen_from_other_connections(make_queue: MakeQueue) -> None:
    a, b = make_queue(), make_queue()
    assert not b.exists()
    a.create(2)
    assert b.exists() and b.bound() == 2


def test_holder_ids(make_queue: MakeQueue) -> None:
    q = make_queue(bound=0)
    other = make_queue(client_id="beta")
    assert q.producer_id() is None and q.consumer_id() is None
    default_id = f"{q.connection.client_id}:{threading.current_thread().name}"
    with q.producing() as p:
        # Recorded as soon as the role is taken, before anything is put.
        assert q.producer_id() == default_id
        assert other.producer_id() == default_id
        p.put(b"x")
    assert q.consumer_id() is None
    with other.consuming() as c:
        assert q.consumer_id() == "beta"
        assert c.get() == b"x"
    # The last holder stays recorded after it let go.
    assert q.producer_id() == default_id and q.consumer_id() == "beta"
    other.put(b"y")
    assert q.producer_id() == "beta"
    alpha = make_queue(client_id="alpha")
    assert alpha.get() == b"y"
    assert q.consumer_id() == "alpha"
    with pytest.raises(errors.InvalidArgumentError):
        make_queue(client_id="")


# ------------------------------------------------------------------------------------------
# put and get
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", [0, 10])
def test_put_get_fifo_and_exact_stats(make_queue: MakeQueue, rabbitmq_url: str, bound: int) -> None:
    q = make_queue(bound=bound)
    for item in ITEMS:
        q.put(item)
    q.put_nowait(bytearray(b"ba"))
    q.put(memoryview(b"mv"))
    produced = [*ITEMS, b"ba", b"mv"]
    assert q.length() == len(produced)
    assert q.stats() == expected_stats(produced, [])
    if bound:
        assert credits(rabbitmq_url, q.base) + q.length() == bound
    got = [q.get(), q.get_nowait(), q.get(timeout=5)]
    with q.receive() as item:
        got.append(item)
    assert got == produced[:4]
    assert q.length() == len(produced) - 4
    assert q.stats() == expected_stats(produced, got)
    with q.consuming() as c:
        got += [c.get(), c.get_nowait()]
        with c.receive(timeout=5) as item:
            got.append(item)
        got.append(c.get(timeout=1))
    assert got == produced
    assert q.get_nowait() is None
    assert q.length() == 0
    assert q.stats() == expected_stats(produced, got)
    if bound:
        assert credits(rabbitmq_url, q.base) == bound  # every credit came back


def test_producing_handle_puts_in_order(make_queue: MakeQueue) -> None:
    q = make_queue(bound=5)
    with q.producing(timeout=5) as p:
        assert p.held and p.bound == 5
        for i in range(5):
            p.put(b"%d" % i)
        with pytest.raises(errors.QueueFullError) as full:
            p.put_nowait(b"5")
        assert full.value.bound == 5
        with pytest.raises(errors.OperationTimeoutError):
            p.put(b"5", timeout=0.2)
    assert not p.held
    with pytest.raises(RuntimeError):
        p.put(b"after release")
    p.release()  # idempotent
    assert [q.get() for _ in range(5)] == [b"%d" % i for i in range(5)]
    assert q.stats()["produced_messages"] == 5


def test_put_on_a_full_queue(make_queue: MakeQueue, rabbitmq_url: str) -> None:
    q = make_queue(bound=2)
    q.put(b"1")
    q.put(b"2")
    with pytest.raises(errors.QueueFullError):
        q.put_nowait(b"3")
    started = time.monotonic()
    with pytest.raises(errors.OperationTimeoutError) as timed_out:
        q.put(b"3", timeout=0.3)
    assert time.monotonic() - started >= 0.25
    assert isinstance(timed_out.value, TimeoutError)
    # Nothing was put, and the failed puts left the role and every credit in place.
    assert q.length() == 2
    assert q.stats() == expected_stats([b"1", b"2"], [])
    assert credits(rabbitmq_url, q.base) == 0
    assert q.get() == b"1"
    q.put_nowait(b"3")
    assert [q.get(), q.get()] == [b"2", b"3"]
    assert q.stats() == expected_stats([b"1", b"2", b"3"], [b"1", b"2", b"3"])


def test_put_nowait_while_another_connection_produces(make_queue: MakeQueue) -> None:
    a = make_queue(bound=0, client_id="producer-a")
    b = make_queue()
    with a.producing():
        with pytest.raises(errors.QueueInUseError) as in_use:
            b.put_nowait(b"x")
        assert in_use.value.role == "producer"
        assert in_use.value.holder == "producer-a"
        with pytest.raises(errors.OperationTimeoutError) as timed_out:
            b.put(b"x", timeout=0.3)
        assert isinstance(timed_out.value, TimeoutError)
        with pytest.raises(errors.QueueInUseError):
            a.put_nowait(b"x")  # same connection, other handle: exclusive too
    assert a.length() == 0 and a.stats() == expected_stats([], [])
    b.put_nowait(b"x")
    assert a.get() == b"x"


def test_threads_sharing_a_queue_object_do_not_share_a_role(make_queue: MakeQueue) -> None:
    q = make_queue(bound=0)
    with q.producing():
        job = Background(lambda: q.put_nowait(b"x"))
        with pytest.raises(errors.QueueInUseError):
            job.join()
        job = Background(lambda: q.put(b"y", timeout=0.3))
        with pytest.raises(errors.OperationTimeoutError):
            job.join()
    assert q.length() == 0


def test_get_on_an_empty_queue(make_queue: MakeQueue) -> None:
    q = make_queue(bound=3)
    assert q.get_nowait() is None
    started = time.monotonic()
    with pytest.raises(errors.OperationTimeoutError) as timed_out:
        q.get(timeout=0.3)
    assert time.monotonic() - started >= 0.25
    assert isinstance(timed_out.value, TimeoutError)
    with pytest.raises(errors.OperationTimeoutError), q.receive(timeout=0.1):
        pytest.fail("received from an empty queue")
    with q.consuming() as c:
        assert c.get_nowait() is None
        with pytest.raises(errors.OperationTimeoutError):
            c.get(timeout=0.1)
    assert q.stats() == expected_stats([], [])
    q.put(b"x")
    assert q.get(timeout=1) == b"x"


def test_get_while_another_connection_consumes(make_queue: MakeQueue) -> None:
    a = make_queue(bound=0, client_id="consumer-a")
    b = make_queue()
    a.put(b"x")
    with a.consuming():
        with pytest.raises(errors.QueueInUseError) as in_use:
            b.get_nowait()
        assert in_use.value.role == "consumer"
        assert in_use.value.holder == "consumer-a"
        with pytest.raises(errors.OperationTimeoutError):
            b.get(timeout=0.3)
        with pytest.raises(errors.OperationTimeoutError):
            b.peek(timeout=0)
    assert b.length() == 1 and b.stats()["consumed_messages"] == 0
    assert b.get_nowait() == b"x"


# ------------------------------------------------------------------------------------------
# missing queues
# ------------------------------------------------------------------------------------------


MISSING_OPERATIONS: dict[str, Callable[[PressureQueue], Any]] = {
    "length": lambda q: q.length(),
    "closed": lambda q: q.closed(),
    "stats": lambda q: q.stats(),
    "producer_id": lambda q: q.producer_id(),
    "consumer_id": lambda q: q.consumer_id(),
    "bound": lambda q: q.bound(),
    "dead_length": lambda q: q.dead_length(),
    "put": lambda q: q.put(b"x", timeout=1),
    "put_nowait": lambda q: q.put_nowait(b"x"),
    "get": lambda q: q.get(timeout=1),
    "get_nowait": lambda q: q.get_nowait(),
    "peek": lambda q: q.peek(timeout=1),
    "receive": lambda q: q.receive(timeout=1).__enter__(),
    "close": lambda q: q.close(timeout=1),
    "kick": lambda q: q.kick(1, timeout=1),
    "delete": lambda q: q.delete(timeout=1),
    "producing": lambda q: q.producing(timeout=1),
    "consuming": lambda q: q.consuming(timeout=1),
    "iterate": lambda q: next(iter(q)),
}


def test_operations_on_a_missing_queue(make_queue: MakeQueue, rabbitmq_url: str) -> None:
    q = make_queue()
    for what, operation in MISSING_OPERATIONS.items():
        started = time.monotonic()
        with pytest.raises(errors.QueueDoesNotExistError):
            operation(q)
        assert time.monotonic() - started < 1.0, f"{what} waited on a missing queue"
    assert q.exists() is False
    assert_pressure_gone(rabbitmq_url, q.base)  # no operation left anything behind


# ------------------------------------------------------------------------------------------
# close and iteration
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", [0, 5])
def test_close_lets_consumers_drain_then_fails(
    make_queue: MakeQueue, rabbitmq_url: str, bound: int
) -> None:
    q = make_queue(bound=bound)
    other = make_queue()
    for item in (b"1", b"2", b"3"):
        q.put(item)
    q.close()
    assert q.closed() is True and other.closed() is True
    assert q.length() == 3  # the end marker is not an item
    for put in (lambda: q.put(b"4"), lambda: other.put_nowait(b"4")):
        with pytest.raises(errors.QueueClosedError):
            put()
    with q.producing() as p, pytest.raises(errors.QueueClosedError):
        p.put(b"4")
    with pytest.raises(errors.QueueClosedError):
        q.close()
    with pytest.raises(errors.QueueClosedError):
        other.kick(1)
    assert other.peek() == b"1"
    assert [other.get(), other.get_nowait()] == [b"1", b"2"]
    with other.receive() as item:
        assert item == b"3"
    assert q.length() == 0
    # Drained: every consumer, now and later, learns it is closed -- none waits.
    for get in (
        lambda: other.get(),
        lambda: other.get_nowait(),
        lambda: q.get(timeout=5),
        lambda: q.peek(),
        lambda: q.receive().__enter__(),
    ):
        started = time.monotonic()
        with pytest.raises(errors.QueueClosedError):
            get()
        assert time.monotonic() - started < 1.0
    assert q.length() == 0 and q.closed() is True
    assert q.stats() == expected_stats([b"1", b"2", b"3"], [b"1", b"2", b"3"])
    if bound:
        assert credits(rabbitmq_url, q.base) == bound  # the failed puts kept no credit


def test_iteration_ends_at_close(make_queue: MakeQueue) -> None:
    q = make_queue(bound=0)
    q.put(b"1")
    q.put(b"2")
    q.close()
    assert list(q) == [b"1", b"2"]
    assert list(q) == []

    r = make_queue("r", bound=2)
    with r.producing() as p:
        p.put(b"x")
        p.close()
        with pytest.raises(errors.QueueClosedError):
            p.close()
    with r.consuming() as c:
        assert list(c) == [b"x"]
        assert list(c) == []
    assert r.stats()["consumed_messages"] == 1


@pytest.mark.parametrize("bound", [1, 2])
def test_iteration_waits_for_items_until_close(make_queue: MakeQueue, bound: int) -> None:
    q = make_queue(bound=bound)
    reader = Background(lambda: list(q))
    with q.producing() as p:
        for i in range(100):  # the reader makes room, over and over: no wake-up is lost
            p.put(b"%d" % i, timeout=5)
        p.close()
    assert reader.join() == [b"%d" % i for i in range(100)]
    assert q.stats()["consumed_messages"] == 100


def test_bound_above_the_credit_prefetch(make_queue: MakeQueue, rabbitmq_url: str) -> None:
    bound = 300  # more credits than a producer keeps delivered ahead (128)
    q = make_queue(bound=bound)
    with q.producing() as p:
        for i in range(bound):
            p.put_nowait(b"%d" % i)
        with pytest.raises(errors.QueueFullError):
            p.put_nowait(b"over")
    assert q.length() == bound and credits(rabbitmq_url, q.base) == 0
    assert q.get() == b"0"
    q.put_nowait(b"last")
    with pytest.raises(errors.QueueFullError):
        q.put_nowait(b"over")
    assert q.stats()["produced_messages"] == bound + 1


def test_threads_sharing_a_role_handle(make_queue: MakeQueue) -> None:
    q = make_queue(bound=0)
    with q.producing() as p:
        jobs = [
            Background(lambda t=t: [p.put(b"%d-%d" % (t, i)) for i in range(40)]) for t in range(4)
        ]
        for job in jobs:
            job.join(30)
    items = [q.get_nowait() for _ in range(160)]
    assert q.get_nowait() is None
    for t in range(4):  # each thread's items in its order, none lost or doubled
        assert [x for x in items if x and x.startswith(b"%d-" % t)] == [
            b"%d-%d" % (t, i) for i in range(40)
        ]
    assert q.stats()["produced_messages"] == 160


# ------------------------------------------------------------------------------------------
# delete
# ------------------------------------------------------------------------------------------


def test_delete_removes_every_queue_and_create_starts_afresh(
    make_queue: MakeQueue, rabbitmq_url: str
) -> None:
    q = make_queue(bound=3, delivery_limit=1)
    q.put(b"poison")
    q.put(b"ok")
    with pytest.raises(ValueError), q.receive() as item:  # first delivery
        raise ValueError(item)
    assert q.get() == b"ok"  # the poison item (second delivery > 1) was dead-lettered
    assert q.dead_length() == 1
    q.put(b"left")
    on_broker = set(declared_queues(rabbitmq_url, pressure_queues(q.base)))
    assert {q.base, f"{q.base}:bound", f"{q.base}:space", f"{q.base}:dead"} <= on_broker

    q.delete()
    assert q.exists() is False
    assert_pressure_gone(rabbitmq_url, q.base)
    with pytest.raises(errors.QueueDoesNotExistError):
        q.delete()
    with pytest.raises(errors.QueueDoesNotExistError):
        q.get_nowait()

    q.create(7)
    assert q.stats() == expected_stats([], [])
    assert (q.length(), q.bound(), q.dead_length(), q.closed()) == (0, 7, 0, False)
    assert q.producer_id() is None and q.consumer_id() is None
    assert credits(rabbitmq_url, q.base) == 7
    q.put(b"new")
    assert q.get() == b"new"
    q.delete()
    assert_pressure_gone(rabbitmq_url, q.base)


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_delete_waits_for_an_idle_role_holder_then_can_finish(
    make_queue: MakeQueue, rabbitmq_url: str, role: str
) -> None:
    q = make_queue(bound=2)
    holder = make_queue(client_id="old-holder")
    q.put(b"x")
    handle = holder.producing() if role == "producer" else holder.consuming()
    with pytest.raises(errors.OperationTimeoutError):
        q.delete(timeout=0.5)
    # The items went first; the holder finds the queue gone.
    assert q.exists() is False
    with pytest.raises(errors.QueueDoesNotExistError):
        if isinstance(handle, Producing):
            handle.put_nowait(b"y")
        else:
            handle.get_nowait()
    # Not re-created under the old holder's feet: it would carry its records over.
    with pytest.raises(errors.QueueAlreadyExistsError):
        q.create(5)
    handle.release()
    q.delete(timeout=5)  # finishes the delete that stopped midway
    assert_pressure_gone(rabbitmq_url, q.base)


def test_create_after_a_delete_that_stopped_midway(
    make_queue: MakeQueue, rabbitmq_url: str
) -> None:
    q = make_queue(bound=2)
    holder = make_queue()
    q.put(b"old")
    with holder.consuming(), pytest.raises(errors.OperationTimeoutError):
        q.delete(timeout=0.3)
    q.create(5)  # the holder let go: create rebuilds from what the delete left
    assert q.stats() == expected_stats([], [])
    assert (q.length(), q.bound(), q.consumer_id()) == (0, 5, None)
    assert credits(rabbitmq_url, q.base) == 5
    q.put(b"new")
    assert holder.get() == b"new"
    assert q.stats() == expected_stats([b"new"], [b"new"])


# ------------------------------------------------------------------------------------------
# blocking and waking
# ------------------------------------------------------------------------------------------


def test_blocked_put_wakes_when_room_frees(make_queue: MakeQueue, rabbitmq_url: str) -> None:
    q = make_queue(bound=1)
    waiting = make_queue(client_id="waiting-producer")
    q.put(b"first")
    put = Background(lambda: waiting.put(b"second", timeout=10))
    # It holds the producer role and waits for a credit, pushed to its consumer.
    wait_until(lambda: q.producer_id() == "waiting-producer")
    wait_until(lambda: data_consumers(rabbitmq_url, q, ":space") == 1)
    time.sleep(0.3)
    assert put.thread.is_alive() and q.length() == 1
    freed = time.monotonic()
    assert q.get() == b"first"
    put.join()
    assert put.finished_at is not None
    latency = put.finished_at - freed
    print(f"blocked put woke {latency * 1000:.1f} ms after the get started")
    assert latency < 0.5
    assert q.get_nowait() == b"second"


def test_blocked_get_wakes_when_an_item_arrives(make_queue: MakeQueue, rabbitmq_url: str) -> None:
    q = make_queue(bound=0)
    waiting = make_queue()
    get = Background(lambda: waiting.get(timeout=10))
    # Blocked on a consumer of the data queue: the broker pushes the item.
    wait_until(lambda: data_consumers(rabbitmq_url, q) == 1)
    time.sleep(0.3)
    assert get.thread.is_alive()
    sent = time.monotonic()
    q.put(b"item")
    assert get.join() == b"item"
    assert get.finished_at is not None
    latency = get.finished_at - sent
    print(f"blocked get woke {latency * 1000:.1f} ms after the put started")
    assert latency < 0.5
    assert data_consumers(rabbitmq_url, q) == 0
    assert q.stats() == expected_stats([b"item"], [b"item"])


def test_two_producers_serialize(make_queue: MakeQueue) -> None:
    a = make_queue(bound=0, client_id="a")
    b = make_queue(client_id="b")
    with a.producing() as p:
        p.put(b"a1")
        put = Background(lambda: b.put(b"b1", timeout=10))
        time.sleep(0.4)
        assert put.thread.is_alive(), "B put while A held the producer role"
        assert a.length() == 1
        p.put(b"a2")
        released = time.monotonic()
    put.join()
    assert put.finished_at is not None
    latency = put.finished_at - released
    print(f"B's put finished {latency * 1000:.1f} ms after A released")
    assert latency < 0.5  # woken by the release, not by the fallback poll
    assert a.producer_id() == "b"
    assert [a.get() for _ in range(3)] == [b"a1", b"a2", b"b1"]


# ------------------------------------------------------------------------------------------
# receive, delivery limit, kick, peek
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", [0, 2])
def test_receive_acks_on_success_and_puts_back_on_error(
    make_queue: MakeQueue, rabbitmq_url: str, bound: int
) -> None:
    q = make_queue(bound=bound)
    q.put(b"first")
    q.put(b"second")
    for _ in range(3):
        with pytest.raises(KeyError), q.receive() as item:
            assert item == b"first"
            assert q.length() == 1  # being received: not waiting in the queue
            raise KeyError(item)
    assert q.length() == 2
    assert q.stats() == expected_stats([b"first", b"second"], [])
    if bound:
        assert credits(rabbitmq_url, q.base) == 0  # no credit came back for a failed receive
    with q.receive() as item:
        assert item == b"first"
    assert q.stats() == expected_stats([b"first", b"second"], [b"first"])
    with q.consuming() as c:
        with pytest.raises(RuntimeError), c.receive() as item:
            raise RuntimeError(item)
        with c.receive() as item:
            assert item == b"second"
    assert q.length() == 0
    assert q.stats() == expected_stats([b"first", b"second"], [b"first", b"second"])
    if bound:
        assert credits(rabbitmq_url, q.base) == bound


def test_releasing_the_consumer_inside_receive_puts_the_item_back(make_queue: MakeQueue) -> None:
    q = make_queue(bound=0)
    q.put(b"x")
    c = q.consuming()
    receiving = c.receive()
    assert receiving.__enter__() == b"x"
    c.release()  # the role goes, and with it the unacknowledged item
    assert q.length() == 1
    assert q.get() == b"x"
    assert q.stats()["consumed_messages"] == 1


def test_delivery_limit_dead_letters_and_kick_gives_a_fresh_count(
    make_queue: MakeQueue, rabbitmq_url: str
) -> None:
    q = make_queue(bound=4, delivery_limit=2)
    q.put(b"poison")
    q.put(b"next")

    def fail_once() -> None:
        with pytest.raises(ValueError), q.receive() as item:
            assert item == b"poison"
            raise ValueError(item)

    fail_once()
    fail_once()
    assert q.dead_length() == 0
    # Its third delivery would exceed the limit: moved to the dead-letter queue on the way.
    assert q.get() == b"next"
    assert q.dead_length() == 1
    assert q.length() == 0
    assert q.stats() == expected_stats([b"poison", b"next"], [b"next"])
    assert credits(rabbitmq_url, q.base) == 4  # a dead item gives its place back

    q.put(b"tail")
    assert q.kick(5) == 1  # only one was dead
    assert q.dead_length() == 0
    assert q.length() == 2
    assert credits(rabbitmq_url, q.base) == 2
    assert q.kick(1) == 0
    assert q.get() == b"tail"
    # Back at the tail with a fresh count: two more deliveries before it is dead again.
    fail_once()
    fail_once()
    q.put(b"after")
    assert q.get() == b"after"
    assert q.dead_length() == 1
    assert q.stats() == expected_stats(
        [b"poison", b"next", b"tail", b"after"], [b"next", b"tail", b"after"]
    )
    with q.producing() as p:
        assert p.kick() == 1
    assert q.get() == b"poison"  # acknowledged at last: it leaves for good
    assert q.dead_length() == 0 and q.length() == 0
    assert credits(rabbitmq_url, q.base) == 4


def test_kick_waits_for_room(make_queue: MakeQueue) -> None:
    q = make_queue(bound=1, delivery_limit=1)
    q.put(b"poison")
    with pytest.raises(ValueError), q.receive():
        raise ValueError
    assert q.get_nowait() is None  # its second delivery: buried on the way
    assert q.dead_length() == 1
    q.put(b"full")
    assert q.kick(1, timeout=0.2) == 0  # no room: nothing moved
    assert q.dead_length() == 1 and q.length() == 1
    assert q.get() == b"full"
    assert q.kick(1, timeout=1) == 1
    assert q.get() == b"poison"


def test_peek_is_not_a_delivery(make_queue: MakeQueue) -> None:
    q = make_queue(bound=3, delivery_limit=1)
    assert q.peek() is None
    q.put(b"oldest")
    q.put(b"newer")
    for _ in range(4):
        assert q.peek() == b"oldest"
    with q.consuming() as c:
        assert c.peek() == b"oldest"
        assert c.peek() == b"oldest"
    assert q.length() == 2
    assert q.stats()["consumed_messages"] == 0
    # Six looks, and still its first delivery: not dead-lettered under a limit of 1.
    assert q.get() == b"oldest"
    assert q.dead_length() == 0
    # A delivery that fails still counts after peeks.
    with pytest.raises(ValueError), q.receive() as item:
        raise ValueError(item)
    assert q.peek() == b"newer"
    assert q.get_nowait() is None  # its second delivery: dead-lettered
    assert q.dead_length() == 1
    assert q.stats() == expected_stats([b"oldest", b"newer"], [b"oldest"])


# ------------------------------------------------------------------------------------------
# replicated (quorum) queues
# ------------------------------------------------------------------------------------------


def test_replicated_queue(make_queue: MakeQueue, rabbitmq_url: str) -> None:
    q = make_queue(bound=3, replicated=True)
    conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        # Independent check of the queue type: a matching declare succeeds, another fails.
        conn.channel().queue_declare(q.base, durable=True, arguments={"x-queue-type": "quorum"})
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as mismatch:
            conn.channel().queue_declare(q.base, durable=True)
        assert mismatch.value.reply_code == 406
    finally:
        conn.close()
    for item in (b"1", b"2", b"3"):
        q.put(item)
    with pytest.raises(errors.QueueFullError):
        q.put_nowait(b"4")
    # Quorum queues requeue a rejected message at the tail: a look, or a failed receive,
    # must still leave the item first in line.
    assert [q.peek(), q.peek()] == [b"1", b"1"]
    with q.consuming() as c:
        assert [c.peek(), c.peek()] == [b"1", b"1"]
        with pytest.raises(ZeroDivisionError), c.receive() as item:
            assert item == b"1"
            raise ZeroDivisionError
        assert c.peek() == b"1"
    with pytest.raises(ZeroDivisionError), q.receive() as item:
        assert item == b"1"
        raise ZeroDivisionError
    assert q.get() == b"1"  # put back first in line
    with q.receive() as item:
        assert item == b"2"
    q.put(b"4")
    q.close()
    assert list(q) == [b"3", b"4"]
    with pytest.raises(errors.QueueClosedError):
        q.get()
    assert q.stats() == expected_stats([b"1", b"2", b"3", b"4"], [b"1", b"2", b"3", b"4"])
    q.delete()
    assert_pressure_gone(rabbitmq_url, q.base)


# ------------------------------------------------------------------------------------------
# bad inputs
# ------------------------------------------------------------------------------------------


BAD_NAMES: list[tuple[str, str | None]] = [
    ("", None),
    ("amq.x", ""),
    ("x", "amq."),
    ("a\nb", None),
    ("tab\there", None),
    ("del\x7f", None),
    ("x:space", None),
    ("x-1-A", None),
    ("x:producer", None),
    ("x:consumer-1-B", None),
    ("x:stats:produced", None),
    ("x:dead", None),
    ("x:bound", None),
    ("x" * 240, None),
    ("é" * 120, None),
]


@pytest.mark.parametrize(("name", "prefix"), BAD_NAMES)
def test_bad_names(rabbitmq_url: str, name: str, prefix: str | None) -> None:
    with pytest.raises(errors.InvalidNameError):
        PressureQueue(name, url=rabbitmq_url, prefix=prefix)


def test_non_str_names(rabbitmq_url: str) -> None:
    for name, prefix in ((b"x", None), (None, None), (3, None), ("x", b"p")):
        with pytest.raises(errors.InvalidNameError):
            PressureQueue(name, url=rabbitmq_url, prefix=prefix)  # type: ignore[arg-type]


def test_longest_name_fits(make_queue: MakeQueue, rabbitmq_url: str, amqp_namespace: str) -> None:
    room = 255 - len(":consumer-100000-B")
    name = "n" * (room - len(amqp_namespace) - 1)
    with pytest.raises(errors.InvalidNameError):
        make_queue(name + "n")
    q = make_queue(name, bound=1)
    assert len(q.base.encode()) == room
    q.put(b"x")
    assert q.get() == b"x"
    q.delete()
    assert_pressure_gone(rabbitmq_url, q.base)


@pytest.mark.parametrize("bound", [-1, 1.5, True, "3", None, MAX_BOUND + 1])
def test_bad_bound(make_queue: MakeQueue, rabbitmq_url: str, bound: Any) -> None:
    q = make_queue()
    with pytest.raises(errors.InvalidArgumentError):
        q.create(bound)
    assert not q.exists()
    assert_pressure_gone(rabbitmq_url, q.base)


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "2"])
def test_bad_delivery_limit(make_queue: MakeQueue, rabbitmq_url: str, limit: Any) -> None:
    q = make_queue()
    with pytest.raises(errors.InvalidArgumentError):
        q.create(2, delivery_limit=limit)
    with pytest.raises(TypeError):
        q.create(2, replicated=1)  # type: ignore[arg-type]
    assert not q.exists()
    assert_pressure_gone(rabbitmq_url, q.base)


BAD_TIMEOUTS = [-1, -0.001, math.nan, "1", True, [1]]


def test_bad_data_and_timeouts_change_nothing(make_queue: MakeQueue, rabbitmq_url: str) -> None:
    q = make_queue(bound=2)
    q.put(b"x")
    before = q.stats()
    for data in ("text", 1, None, [b"x"], {b"x": 1}):
        for put in (q.put, q.put_nowait):
            with pytest.raises(TypeError):
                put(data)  # type: ignore[arg-type]
        with q.producing() as p, pytest.raises(TypeError):
            p.put(data)  # type: ignore[arg-type]
    calls: list[Callable[[Any], Any]] = [
        lambda t: q.put(b"y", timeout=t),
        lambda t: q.get(timeout=t),
        lambda t: q.receive(timeout=t).__enter__(),
        lambda t: q.peek(timeout=t),
        lambda t: q.close(timeout=t),
        lambda t: q.kick(1, timeout=t),
        lambda t: q.delete(timeout=t),
        lambda t: q.producing(timeout=t),
        lambda t: q.consuming(timeout=t),
    ]
    for timeout in BAD_TIMEOUTS:
        for call in calls:
            with pytest.raises(errors.InvalidArgumentError):
                call(timeout)
        with q.producing() as p:
            with pytest.raises(errors.InvalidArgumentError):
                p.put(b"y", timeout=timeout)
            with pytest.raises(errors.InvalidArgumentError):
                p.kick(1, timeout=timeout)
        with q.consuming() as c:
            with pytest.raises(errors.InvalidArgumentError):
                c.get(timeout=timeout)
            with pytest.raises(errors.InvalidArgumentError):
                c.receive(timeout=timeout).__enter__()
    for count in (-1, 1.5, True, "1"):
        with pytest.raises(errors.InvalidArgumentError):
            q.kick(count)  # type: ignore[arg-type]
    # Nothing was put, taken, closed or deleted; no role or credit was left held.
    assert q.exists() and not q.closed()
    assert q.stats() == before
    assert q.length() == 1
    assert credits(rabbitmq_url, q.base) == 1
    on_broker = declared_queues(rabbitmq_url, pressure_queues(q.base))
    assert not {f"{q.base}:lock", f"{q.base}:producer-1-B", f"{q.base}:consumer-1-B"} & set(
        on_broker
    )
    q.put_nowait(b"y")
    assert [q.get_nowait(), q.get_nowait()] == [b"x", b"y"]


# ------------------------------------------------------------------------------------------
# batches: put_many and get_many
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", [0, 4])
def test_put_many_get_many_keep_order_bound_and_exact_stats(
    make_queue: MakeQueue, rabbitmq_url: str, bound: int
) -> None:
    q = make_queue(bound=bound)
    first = [f"item-{i}".encode() for i in range(3)]
    q.put_many(first)
    assert q.length() == 3
    if bound:
        assert credits(rabbitmq_url, q.base) == bound - 3
        # More than the room left: the first fits, the time runs out for the rest.
        with pytest.raises(errors.OperationTimeoutError) as caught:
            q.put_many([b"x", b"y", b"z"], timeout=0.3)
        assert caught.value.done == 1 and "first 1 items were put" in str(caught.value)
    else:
        q.put_many([b"x"])
    assert q.length() == 4
    assert q.get_many(2) == first[:2]
    assert q.get_many(10, timeout=1) == [first[2], b"x"]  # only what is there, no waiting
    with pytest.raises(errors.OperationTimeoutError):
        q.get_many(3, timeout=0.2)
    assert q.stats() == expected_stats([*first, b"x"], [*first, b"x"])
    if bound:
        wait_until(lambda: credits(rabbitmq_url, q.base) == bound)  # every credit back


def test_put_many_blocks_while_full_and_resumes_as_room_frees(
    make_queue: MakeQueue, rabbitmq_url: str
) -> None:
    q = make_queue(bound=3)
    items = [str(i).encode() for i in range(20)]
    producer = Background(lambda: q.put_many(items, timeout=30))
    got: list[bytes] = []
    with make_queue().consuming(timeout=5) as c:
        while len(got) < len(items):
            batch = c.get_many(5, timeout=10)
            assert 1 <= len(batch) <= 3  # never more than the bound was queued
            got += batch
    producer.join(10)
    assert got == items
    assert credits(rabbitmq_url, q.base) == 3


def test_get_many_stops_at_the_end_marker_and_then_reports_closed(make_queue: MakeQueue) -> None:
    q = make_queue(bound=5)
    with q.producing() as p:
        p.put_many([b"a", b"b"])
        p.close()
    assert q.get_many(10) == [b"a", b"b"]
    with pytest.raises(errors.QueueClosedError):
        q.get_many(10)
    with pytest.raises(errors.QueueClosedError):
        q.put_many([b"c"])


def test_batch_arguments_are_checked_before_any_broker_work(make_queue: MakeQueue) -> None:
    q = make_queue(bound=2)
    with pytest.raises(TypeError):
        q.put_many([b"ok", "not bytes"])  # type: ignore[list-item]
    assert q.length() == 0  # nothing of the batch was put
    for most in (0, -1, 1.5, True):
        with pytest.raises(errors.InvalidArgumentError):
            q.get_many(most)  # type: ignore[arg-type]


def test_an_operation_failing_midway_gives_the_role_up_and_loses_nothing(
    make_queue: MakeQueue, rabbitmq_url: str
) -> None:
    """After a broker timeout or an interruption mid-operation, what the broker did is
    unknown: the handle gives the role up (its deliveries go back, first in line) instead of
    going on from a state it cannot trust."""
    from amqp_locks import _pressure as P

    q = make_queue(bound=3)
    q.put_many([b"a", b"b"])
    c = q.consuming(timeout=5)

    def take_then_time_out(consumer: P.Consumer) -> P.Flow[None]:
        item = yield from P.take(consumer, 0.0, P.Policy(), time.monotonic)
        assert item is not None and item.body == b"a"
        raise errors.BrokerTimeoutError("simulated: the commit was never answered")

    with pytest.raises(errors.BrokerTimeoutError):
        c._role.run(take_then_time_out(c._state))
    assert not c.held
    with pytest.raises(errors.LockLostError, match="failed midway"):
        c.get_nowait()
    c.release()  # idempotent
    assert q.get_many(5) == [b"a", b"b"]  # nothing lost, nothing reordered
    wait_until(lambda: credits(rabbitmq_url, q.base) == 3)
    assert q.stats()["consumed_messages"] == 2
