"""The asyncio PressureQueue on a real broker: twins of the main sync cases (test_pressure.py),
plus what only asyncio has (cancellation, tasks sharing a handle).

Every queue is made with the test's ``amqp_namespace`` as its prefix and deleted afterwards.
What is on the broker is checked independently of the library, with plain pika (``helpers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pika
import pytest
from helpers import (
    assert_pressure_gone,
    credits,
    declared_queues,
    expected_stats,
    pressure_queues,
    queue_info,
)

from amqp_locks import errors
from amqp_locks.aio import Connection, Consuming, PressureQueue, Producing

MakeQueue = Callable[..., Awaitable[PressureQueue]]

ITEMS = [b"a", b"bb", b"", b"dddd", b"\x00\xff binary", b"f" * 1000]


@pytest.fixture
async def make_queue(rabbitmq_url: str, amqp_namespace: str) -> AsyncIterator[MakeQueue]:
    """``await make_queue(name="q", bound=None, client_id=None, **create_kwargs)``: a
    PressureQueue on a connection of its own (created first unless ``bound`` is None);
    deleted and disconnected afterwards."""
    made: list[PressureQueue] = []

    async def make(
        name: str = "q", bound: int | None = None, client_id: str | None = None, **create: Any
    ) -> PressureQueue:
        q = PressureQueue(name, url=rabbitmq_url, prefix=amqp_namespace, client_id=client_id)
        made.append(q)
        if bound is not None:
            await q.create(bound, **create)
        return q

    yield make
    names = {q.name for q in made}
    for q in made:
        await q.disconnect()  # roles still held by a failed test are freed with their connection
    for name in names:
        async with PressureQueue(name, url=rabbitmq_url, prefix=amqp_namespace) as q:
            with contextlib.suppress(errors.QueueDoesNotExistError):
                await q.delete(timeout=10)


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def no_role_held(url: str, q: PressureQueue) -> bool:
    held = {f"{q.base}:lock", f"{q.base}:producer-1-B", f"{q.base}:consumer-1-B"}
    return not held & set(declared_queues(url, pressure_queues(q.base)))


def finished_at(task: asyncio.Task[Any], stamps: dict[asyncio.Task[Any], float]) -> None:
    stamps[task] = time.monotonic()


# ------------------------------------------------------------------------------------------
# create, exists, state
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", [0, 3])
async def test_create_and_initial_state(
    make_queue: MakeQueue, rabbitmq_url: str, bound: int
) -> None:
    q = await make_queue()
    other = await make_queue()
    assert await q.exists() is False
    assert not declared_queues(rabbitmq_url, pressure_queues(q.base))
    await q.create(bound)
    assert await q.exists() is True and await other.exists() is True
    assert await q.length() == 0
    assert await q.closed() is False
    assert await q.stats() == expected_stats([], [])
    assert await q.producer_id() is None and await q.consumer_id() is None
    assert await q.bound() == bound and await other.bound() == bound
    assert await q.dead_length() == 0
    on_broker = declared_queues(rabbitmq_url, pressure_queues(q.base))
    assert {q.base, f"{q.base}:dead", f"{q.base}:producer-1-A"} <= set(on_broker)
    if bound:
        assert on_broker[f"{q.base}:space"] == (bound, 0)
    else:
        assert f"{q.base}:space" not in on_broker
    assert no_role_held(rabbitmq_url, q)
    with pytest.raises(errors.QueueAlreadyExistsError):
        await other.create(bound + 1)
    assert await q.bound() == bound


async def test_holder_ids(make_queue: MakeQueue) -> None:
    q = await make_queue(bound=0)
    beta = await make_queue(client_id="beta")
    async with q.producing() as p:
        task = asyncio.current_task()
        assert task is not None
        # Recorded as soon as the role is taken: host:pid:task by default.
        assert await beta.producer_id() == f"{q.connection.client_id}:{task.get_name()}"
        await p.put(b"x")
    async with beta.consuming() as c:
        assert await q.consumer_id() == "beta"
        assert await c.get() == b"x"
    assert await q.consumer_id() == "beta"  # the last holder stays recorded


# ------------------------------------------------------------------------------------------
# put and get
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", [0, 10])
async def test_put_get_fifo_and_exact_stats(
    make_queue: MakeQueue, rabbitmq_url: str, bound: int
) -> None:
    q = await make_queue(bound=bound)
    for item in ITEMS:
        await q.put(item)
    await q.put_nowait(bytearray(b"ba"))  # type: ignore[arg-type]
    await q.put(memoryview(b"mv"))  # type: ignore[arg-type]
    produced = [*ITEMS, b"ba", b"mv"]
    assert await q.length() == len(produced)
    assert await q.stats() == expected_stats(produced, [])
    if bound:
        assert credits(rabbitmq_url, q.base) + await q.length() == bound
    got = [await q.get(), await q.get_nowait(), await q.get(timeout=5)]
    async with q.receive() as item:
        got.append(item)
    assert got == produced[:4]
    async with q.consuming() as c:
        assert isinstance(c, Consuming) and c.held
        got += [await c.get(), await c.get_nowait()]
        async with c.receive(timeout=5) as item:
            got.append(item)
        got.append(await c.get(timeout=1))
    assert not c.held
    assert got == produced
    assert await q.get_nowait() is None
    assert await q.stats() == expected_stats(produced, got)
    if bound:
        assert credits(rabbitmq_url, q.base) == bound  # every credit came back


async def test_producing_handle(make_queue: MakeQueue) -> None:
    q = await make_queue(bound=3)
    p = await q.producing(timeout=5)
    assert isinstance(p, Producing) and p.held and p.bound == 3
    # Tasks sharing one handle: their puts run one at a time, the record stays exact.
    await asyncio.gather(*(p.put(b"%d" % i) for i in range(3)))
    with pytest.raises(errors.QueueFullError) as full:
        await p.put_nowait(b"3")
    assert full.value.bound == 3
    with pytest.raises(errors.OperationTimeoutError):
        await p.put(b"3", timeout=0.2)
    await p.release()
    await p.release()  # idempotent
    assert not p.held
    with pytest.raises(RuntimeError):
        await p.put(b"after release")
    assert sorted([await q.get() for _ in range(3)]) == [b"0", b"1", b"2"]
    assert await q.stats() == expected_stats([b"0", b"1", b"2"], [b"0", b"1", b"2"])


async def test_put_nowait_full_and_in_use(make_queue: MakeQueue, rabbitmq_url: str) -> None:
    q = await make_queue(bound=2, client_id="producer-a")
    other = await make_queue()
    await q.put(b"1")
    await q.put(b"2")
    with pytest.raises(errors.QueueFullError):
        await q.put_nowait(b"3")
    started = time.monotonic()
    with pytest.raises(errors.OperationTimeoutError) as timed_out:
        await q.put(b"3", timeout=0.3)
    assert time.monotonic() - started >= 0.25
    assert isinstance(timed_out.value, TimeoutError)
    async with q.producing():
        with pytest.raises(errors.QueueInUseError) as in_use:
            await other.put_nowait(b"x")
        assert in_use.value.role == "producer" and in_use.value.holder == "producer-a"
        with pytest.raises(errors.QueueInUseError):
            await q.put_nowait(b"x")  # same connection, another task's call: exclusive too
        with pytest.raises(errors.OperationTimeoutError):
            await other.put(b"x", timeout=0.3)
    # Nothing was put; the failed puts left the role and every credit in place.
    assert await q.length() == 2 and credits(rabbitmq_url, q.base) == 0
    assert await q.stats() == expected_stats([b"1", b"2"], [])
    assert no_role_held(rabbitmq_url, q)


async def test_get_on_an_empty_queue(make_queue: MakeQueue, rabbitmq_url: str) -> None:
    q = await make_queue(bound=3, client_id="consumer-a")
    other = await make_queue()
    assert await q.get_nowait() is None
    started = time.monotonic()
    with pytest.raises(errors.OperationTimeoutError):
        await q.get(timeout=0.3)
    assert time.monotonic() - started >= 0.25
    with pytest.raises(errors.OperationTimeoutError):
        async with q.receive(timeout=0.1):
            pytest.fail("received from an empty queue")
    async with q.consuming() as c:
        assert await c.get_nowait() is None
        with pytest.raises(errors.QueueInUseError) as in_use:
            await other.get_nowait()
        assert in_use.value.role == "consumer" and in_use.value.holder == "consumer-a"
    assert queue_info(rabbitmq_url, q.base) == (0, 0)  # no consumer left behind
    assert await q.stats() == expected_stats([], [])


async def test_operations_on_a_missing_queue(make_queue: MakeQueue, rabbitmq_url: str) -> None:
    q = await make_queue()

    async def receive() -> None:
        async with q.receive(timeout=1):
            pass

    async def iterate() -> None:
        async for _ in q:
            pass

    operations: dict[str, Callable[[], Awaitable[Any]]] = {
        "length": q.length,
        "stats": q.stats,
        "dead_length": q.dead_length,
        "put": lambda: q.put(b"x", timeout=1),
        "put_nowait": lambda: q.put_nowait(b"x"),
        "get": lambda: q.get(timeout=1),
        "get_nowait": q.get_nowait,
        "peek": lambda: q.peek(timeout=1),
        "receive": receive,
        "close": lambda: q.close(timeout=1),
        "kick": lambda: q.kick(1, timeout=1),
        "delete": lambda: q.delete(timeout=1),
        "producing": lambda: q.producing(timeout=1),
        "iterate": iterate,
    }
    for what, operation in operations.items():
        started = time.monotonic()
        with pytest.raises(errors.QueueDoesNotExistError):
            await operation()
        assert time.monotonic() - started < 1.0, f"{what} waited on a missing queue"
    assert_pressure_gone(rabbitmq_url, q.base)


# ------------------------------------------------------------------------------------------
# blocking and waking
# ------------------------------------------------------------------------------------------


async def test_blocked_put_wakes_when_a_consumer_gets(
    make_queue: MakeQueue, rabbitmq_url: str
) -> None:
    q = await make_queue(bound=1)
    waiting = await make_queue(client_id="waiting-producer")
    await q.put(b"first")
    stamps: dict[asyncio.Task[Any], float] = {}
    put = asyncio.create_task(waiting.put(b"second", timeout=10))
    put.add_done_callback(lambda t: finished_at(t, stamps))
    # It holds the producer role and waits on a consumer of the credit queue: no polling.
    await wait_until(lambda: queue_info(rabbitmq_url, f"{q.base}:space")[1] == 1)
    await asyncio.sleep(0.3)
    assert not put.done() and await q.length() == 1
    assert await q.producer_id() == "waiting-producer"
    freed = time.monotonic()
    assert await q.get() == b"first"
    await asyncio.wait_for(put, 5)
    latency = stamps[put] - freed
    print(f"blocked put woke {latency * 1000:.1f} ms after the get started")
    assert latency < 1.0
    assert await q.get_nowait() == b"second"


async def test_blocked_get_wakes_when_an_item_arrives(
    make_queue: MakeQueue, rabbitmq_url: str
) -> None:
    q = await make_queue(bound=0)
    waiting = await make_queue()
    stamps: dict[asyncio.Task[Any], float] = {}
    get = asyncio.create_task(waiting.get(timeout=10))
    get.add_done_callback(lambda t: finished_at(t, stamps))
    await wait_until(lambda: queue_info(rabbitmq_url, q.base)[1] == 1)
    sent = time.monotonic()
    await q.put(b"item")
    assert await asyncio.wait_for(get, 5) == b"item"
    latency = stamps[get] - sent
    print(f"blocked get woke {latency * 1000:.1f} ms after the put started")
    assert latency < 1.0
    assert queue_info(rabbitmq_url, q.base) == (0, 0)
    assert await q.stats() == expected_stats([b"item"], [b"item"])


async def test_two_producers_on_separate_connections_serialize(make_queue: MakeQueue) -> None:
    a = await make_queue(bound=0, client_id="a")
    b = await make_queue(client_id="b")
    stamps: dict[asyncio.Task[Any], float] = {}
    async with a.producing() as p:
        await p.put(b"a1")
        put = asyncio.create_task(b.put(b"b1", timeout=10))
        put.add_done_callback(lambda t: finished_at(t, stamps))
        await asyncio.sleep(0.4)
        assert not put.done(), "B put while A held the producer role"
        await p.put(b"a2")
        released = time.monotonic()
    await asyncio.wait_for(put, 5)
    latency = stamps[put] - released
    print(f"B's put finished {latency * 1000:.1f} ms after A released")
    assert latency < 1.0  # woken by the release, not by the fallback poll
    assert await a.producer_id() == "b"
    assert [await a.get() for _ in range(3)] == [b"a1", b"a2", b"b1"]


# ------------------------------------------------------------------------------------------
# cancellation
# ------------------------------------------------------------------------------------------


async def test_a_cancelled_wait_leaves_nothing_taken(
    make_queue: MakeQueue, rabbitmq_url: str
) -> None:
    q = await make_queue(bound=1, delivery_limit=1)
    # A blocked get, cancelled: no consumer, no role, nothing counted as a delivery.
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(q.get(), 0.3)
    async with q.consuming() as c:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(c.get(), 0.3)
        assert queue_info(rabbitmq_url, q.base) == (0, 0)
        await q.put(b"x")
        assert await c.get(timeout=1) == b"x"  # the handle still works
    # A blocked put, cancelled: nothing put, its credit wait abandoned.
    await q.put(b"y")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(q.put(b"z"), 0.3)
    assert await q.length() == 1 and credits(rabbitmq_url, q.base) == 0
    assert await q.get() == b"y"
    await q.put(b"z", timeout=1)  # the credit came back, and is found again
    assert await q.get() == b"z"
    assert await q.dead_length() == 0
    assert await q.stats() == expected_stats([b"x", b"y", b"z"], [b"x", b"y", b"z"])
    assert no_role_held(rabbitmq_url, q)


async def test_cancelling_a_receive_block_puts_the_item_back(make_queue: MakeQueue) -> None:
    q = await make_queue(bound=2)
    await q.put(b"x")
    entered = asyncio.Event()

    async def slow() -> None:
        async with q.receive() as item:
            assert item == b"x"
            entered.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(slow())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await q.length() == 1
    assert await q.get() == b"x"


async def test_cancellation_at_any_moment_loses_nothing_with_receive(
    make_queue: MakeQueue, rabbitmq_url: str
) -> None:
    # Timeouts about one round trip long land inside every step: waits, gets, consumes,
    # commits. Session RPCs finish first, so the handles keep working, and receive() never
    # loses an item: each is handled exactly once here (a cancelled block puts it back).
    count = 60
    q = await make_queue(bound=4)
    producer = await make_queue()
    rng = random.Random(7)
    handled: list[bytes] = []

    async def produce() -> None:
        async with producer.producing() as p:
            put = 0
            while put < count:
                # Perhaps put anyway (cancelled as it committed): the record knows.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(p.put(b"%03d" % put, timeout=10), rng.uniform(0, 0.004))
                put = (await producer.stats())["produced_messages"]
            await p.close()

    async def consume() -> None:
        async with q.consuming() as c:

            async def receive() -> None:
                async with c.receive(timeout=10) as item:
                    await asyncio.sleep(rng.uniform(0, 0.002))
                    handled.append(item)

            while True:
                try:
                    await asyncio.wait_for(receive(), rng.uniform(0, 0.006))
                except asyncio.TimeoutError:
                    pass
                except errors.QueueClosedError:
                    return

    await asyncio.wait_for(asyncio.gather(produce(), consume()), 30)
    assert handled == [b"%03d" % i for i in range(count)]
    assert await q.stats() == expected_stats(handled, handled)
    assert credits(rabbitmq_url, q.base) == 4
    assert no_role_held(rabbitmq_url, q)


# ------------------------------------------------------------------------------------------
# receive, close, delete
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", [0, 2])
async def test_receive_acks_on_success_and_puts_back_on_exception(
    make_queue: MakeQueue, rabbitmq_url: str, bound: int
) -> None:
    q = await make_queue(bound=bound)
    await q.put(b"first")
    await q.put(b"second")
    for _ in range(2):
        with pytest.raises(KeyError):
            async with q.receive() as item:
                assert item == b"first"  # put back first in line
                assert await q.length() == 1  # being received: not waiting
                raise KeyError(item)
    assert await q.stats() == expected_stats([b"first", b"second"], [])
    if bound:
        assert credits(rabbitmq_url, q.base) == 0  # no credit for a failed receive
    async with q.receive() as item:
        assert item == b"first"
    async with q.consuming() as c:
        with pytest.raises(RuntimeError):
            async with c.receive() as item:
                raise RuntimeError(item)
        async with c.receive() as item:
            assert item == b"second"
    assert await q.length() == 0
    assert await q.stats() == expected_stats([b"first", b"second"], [b"first", b"second"])
    if bound:
        assert credits(rabbitmq_url, q.base) == bound


@pytest.mark.parametrize("bound", [0, 5])
async def test_close_lets_consumers_drain_then_fails(make_queue: MakeQueue, bound: int) -> None:
    q = await make_queue(bound=bound)
    other = await make_queue()
    for item in (b"1", b"2", b"3"):
        await q.put(item)
    await q.close()
    assert await q.closed() is True and await other.closed() is True
    assert await q.length() == 3  # the end marker is not an item
    with pytest.raises(errors.QueueClosedError):
        await other.put_nowait(b"4")
    with pytest.raises(errors.QueueClosedError):
        await q.close()
    assert await other.peek() == b"1"
    assert [await other.get(), await other.get_nowait()] == [b"1", b"2"]
    assert [item async for item in q] == [b"3"]
    for get in (other.get, other.get_nowait, q.peek):
        started = time.monotonic()
        with pytest.raises(errors.QueueClosedError):
            await get()
        assert time.monotonic() - started < 1.0
    async with q.consuming() as c:
        assert [item async for item in c] == []
    assert await q.stats() == expected_stats([b"1", b"2", b"3"], [b"1", b"2", b"3"])


async def test_iteration_waits_for_items_until_close(make_queue: MakeQueue) -> None:
    q = await make_queue(bound=2)
    other = await make_queue()

    async def read() -> list[bytes]:
        return [item async for item in other]

    reader = asyncio.create_task(read())
    for i in range(6):  # three times the bound: the reader makes room
        await q.put(b"%d" % i, timeout=5)
    await q.close(timeout=5)
    assert await asyncio.wait_for(reader, 5) == [b"%d" % i for i in range(6)]


async def test_delete_wakes_a_blocked_get_and_a_blocked_put(
    make_queue: MakeQueue, rabbitmq_url: str
) -> None:
    full = await make_queue("full", bound=1)
    empty = await make_queue("empty", bound=1)
    producer = await make_queue("full")
    consumer = await make_queue("empty")
    await full.put(b"x")
    put = asyncio.create_task(producer.put(b"y", timeout=30))
    get = asyncio.create_task(consumer.get(timeout=30))
    await wait_until(lambda: queue_info(rabbitmq_url, f"{full.base}:space")[1] == 1)
    await wait_until(lambda: queue_info(rabbitmq_url, empty.base)[1] == 1)
    started = time.monotonic()
    await asyncio.gather(full.delete(timeout=10), empty.delete(timeout=10))
    for task in (put, get):
        with pytest.raises(errors.QueueDoesNotExistError):
            await asyncio.wait_for(task, 5)
    elapsed = time.monotonic() - started
    print(f"delete woke both and finished in {elapsed * 1000:.1f} ms")
    assert elapsed < 1.0
    assert_pressure_gone(rabbitmq_url, full.base)
    assert_pressure_gone(rabbitmq_url, empty.base)
    await empty.create(1)  # a fresh start
    assert await empty.stats() == expected_stats([], [])


async def test_delete_waits_for_a_role_holder(make_queue: MakeQueue, rabbitmq_url: str) -> None:
    q = await make_queue(bound=2)
    holder = await make_queue()
    await q.put(b"x")
    async with holder.consuming() as c:
        with pytest.raises(errors.OperationTimeoutError):
            await q.delete(timeout=0.3)
        assert await q.exists() is False  # the items went first
        with pytest.raises(errors.QueueDoesNotExistError):
            await c.get_nowait()
    await q.delete(timeout=5)  # finishes the delete that stopped midway
    assert_pressure_gone(rabbitmq_url, q.base)


async def test_a_put_into_a_vanished_data_queue_fails(
    make_queue: MakeQueue, rabbitmq_url: str
) -> None:
    q = await make_queue(bound=0)
    async with q.producing() as p:
        await p.put(b"a")
        conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
        conn.channel().queue_delete(q.base)  # behind the library's back
        conn.close()
        # The broker returns the publish (mandatory) inside the transaction: reported.
        with pytest.raises(errors.QueueDoesNotExistError):
            await p.put(b"b")
    await q.delete(timeout=5)
    assert_pressure_gone(rabbitmq_url, q.base)


async def test_closing_the_connection_wakes_blocked_calls(
    make_queue: MakeQueue, rabbitmq_url: str, amqp_namespace: str
) -> None:
    q = await make_queue(bound=1)
    await q.put(b"x")
    conn = Connection(rabbitmq_url)
    other = PressureQueue("q", connection=conn, prefix=amqp_namespace)
    c = await other.consuming()
    receiving = c.receive()
    assert await receiving.__aenter__() == b"x"  # the only item, and the only credit, held
    get = asyncio.create_task(c.get(timeout=30))
    put = asyncio.create_task(other.put(b"y", timeout=30))
    await wait_until(lambda: queue_info(rabbitmq_url, q.base)[1] == 1)
    await wait_until(lambda: queue_info(rabbitmq_url, f"{q.base}:space")[1] == 1)
    started = time.monotonic()
    await conn.close()
    for task in (get, put):
        with pytest.raises(errors.BrokerUnavailableError):
            await asyncio.wait_for(task, 5)
    assert time.monotonic() - started < 1.0
    assert not c.held
    await c.release()
    # Its roles and the item it held went back with its connection.
    await wait_until(lambda: no_role_held(rabbitmq_url, q))
    assert await q.get(timeout=5) == b"x"
    await q.put(b"z", timeout=5)
    assert await q.get(timeout=5) == b"z"
    assert await q.stats() == expected_stats([b"x", b"z"], [b"x", b"z"])


# ------------------------------------------------------------------------------------------
# delivery limit, kick, peek
# ------------------------------------------------------------------------------------------


async def test_delivery_limit_dead_letters_and_kick_gives_a_fresh_count(
    make_queue: MakeQueue, rabbitmq_url: str
) -> None:
    q = await make_queue(bound=4, delivery_limit=2)
    await q.put(b"poison")
    await q.put(b"next")

    async def fail_once() -> None:
        with pytest.raises(ValueError):
            async with q.receive() as item:
                assert item == b"poison"
                raise ValueError(item)

    await fail_once()
    await fail_once()
    assert await q.dead_length() == 0
    assert await q.get() == b"next"  # the third delivery of poison: dead-lettered on the way
    assert await q.dead_length() == 1 and await q.length() == 0
    assert credits(rabbitmq_url, q.base) == 4  # a dead item gives its place back
    await q.put(b"tail")
    assert await q.kick(5) == 1
    assert await q.dead_length() == 0 and await q.length() == 2
    assert await q.get() == b"tail"
    # Back at the tail with a fresh count: two more deliveries before it is dead again.
    await fail_once()
    await fail_once()
    assert await q.get_nowait() is None
    assert await q.dead_length() == 1
    async with q.producing() as p:
        assert await p.kick() == 1
    assert await q.get() == b"poison"
    assert await q.stats() == expected_stats(
        [b"poison", b"next", b"tail"], [b"next", b"tail", b"poison"]
    )
    assert credits(rabbitmq_url, q.base) == 4


async def test_peek_leaves_the_item(make_queue: MakeQueue) -> None:
    q = await make_queue(bound=3, delivery_limit=1)
    assert await q.peek() is None
    await q.put(b"oldest")
    await q.put(b"newer")
    for _ in range(3):
        assert await q.peek() == b"oldest"
    async with q.consuming() as c:
        assert await c.peek() == b"oldest"
    assert await q.length() == 2
    # Four looks, and still its first delivery: not dead-lettered under a limit of 1.
    assert await q.get() == b"oldest"
    assert await q.dead_length() == 0
    assert await q.stats() == expected_stats([b"oldest", b"newer"], [b"oldest"])


async def test_replicated_queue_keeps_fifo_when_an_item_is_put_back(
    make_queue: MakeQueue, rabbitmq_url: str
) -> None:
    q = await make_queue(bound=3, replicated=True)
    for item in (b"1", b"2", b"3"):
        await q.put(item)
    with pytest.raises(errors.QueueFullError):
        await q.put_nowait(b"4")
    async with q.consuming() as c:
        with pytest.raises(ZeroDivisionError):
            async with c.receive() as item:
                assert item == b"1"
                raise ZeroDivisionError
        assert await c.peek() == b"1"
        assert await c.get() == b"1"  # put back first in line
    await q.close()
    assert [item async for item in q] == [b"2", b"3"]
    assert await q.stats() == expected_stats([b"1", b"2", b"3"], [b"1", b"2", b"3"])
    assert credits(rabbitmq_url, q.base) == 3


# ------------------------------------------------------------------------------------------
# bad inputs, lifecycle
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "prefix"),
    [
        ("", None),
        ("amq.x", ""),
        ("a\nb", None),
        ("x:space", None),
        ("x-1-A", None),
        ("x" * 240, None),
    ],
)
def test_bad_names(rabbitmq_url: str, name: str, prefix: str | None) -> None:
    with pytest.raises(errors.InvalidNameError):
        PressureQueue(name, url=rabbitmq_url, prefix=prefix)


async def test_bad_inputs_change_nothing(make_queue: MakeQueue, rabbitmq_url: str) -> None:
    q = await make_queue(bound=2)
    await q.put(b"x")
    before = await q.stats()
    for data in ("text", 1, None, [b"x"]):
        for put in (q.put, q.put_nowait):
            with pytest.raises(TypeError):
                await put(data)  # type: ignore[arg-type]
        async with q.producing() as p:
            with pytest.raises(TypeError):
                await p.put(data)  # type: ignore[arg-type]

    async def receive(timeout: Any) -> None:
        async with q.receive(timeout=timeout):
            pass

    calls: list[Callable[[Any], Any]] = [
        lambda t: q.put(b"y", timeout=t),
        lambda t: q.get(timeout=t),
        receive,
        lambda t: q.peek(timeout=t),
        lambda t: q.close(timeout=t),
        lambda t: q.kick(1, timeout=t),
        lambda t: q.delete(timeout=t),
    ]
    bad_timeouts: list[Any] = [-1, -0.001, float("nan"), "1", True]
    for timeout in bad_timeouts:
        for call in calls:
            with pytest.raises(errors.InvalidArgumentError):
                await call(timeout)
        for take in (q.producing, q.consuming):
            with pytest.raises(errors.InvalidArgumentError):
                take(timeout)
        async with q.consuming() as c:
            with pytest.raises(errors.InvalidArgumentError):
                await c.get(timeout=timeout)
    with pytest.raises(errors.InvalidArgumentError):
        await q.kick(-1)
    with pytest.raises(errors.InvalidArgumentError):
        await (await make_queue("other")).create(-1)
    # Nothing was put, taken, closed or deleted; no role or credit was left held.
    assert await q.exists() and not await q.closed()
    assert await q.stats() == before
    assert await q.length() == 1 and credits(rabbitmq_url, q.base) == 1
    assert no_role_held(rabbitmq_url, q)
    assert not declared_queues(rabbitmq_url, pressure_queues(f"{q.base[: -len(q.name)]}other"))


async def test_shared_connection_and_context_managers(
    rabbitmq_url: str, amqp_namespace: str
) -> None:
    async with Connection(rabbitmq_url) as conn:
        q = PressureQueue("shared", connection=conn, prefix=amqp_namespace)
        r = PressureQueue("shared", connection=conn, prefix=amqp_namespace)
        await q.create(1)
        try:
            await q.put(b"x")
            assert await r.get(timeout=1) == b"x"
            await q.disconnect()  # not its connection: nothing happens
            assert await r.exists()
        finally:
            await q.delete(timeout=5)
        assert repr(q).startswith("<aio.PressureQueue")
    with pytest.raises(errors.InvalidArgumentError):
        PressureQueue("x", url=rabbitmq_url, connection=conn)


async def test_put_many_get_many(make_queue: MakeQueue) -> None:
    q = await make_queue(bound=3)
    await q.put_many([b"a", b"b"])
    with pytest.raises(errors.OperationTimeoutError) as caught:
        await q.put_many([b"c", b"d"], timeout=0.3)
    assert caught.value.done == 1
    assert await q.get_many(10) == [b"a", b"b", b"c"]
    async with q.producing() as p:
        await p.put_many([b"e"])
        await p.close()
    async with q.consuming() as c:
        assert await c.get_many(5) == [b"e"]
        with pytest.raises(errors.QueueClosedError):
            await c.get_many(5)
    assert await q.stats() == expected_stats([b"a", b"b", b"c", b"e"], [b"a", b"b", b"c", b"e"])
