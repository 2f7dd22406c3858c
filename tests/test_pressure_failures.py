"""Pressure queues with real processes: SIGKILLed producers and consumers, the bound under
load (sampled inside the broker), and close/delete with clients blocked in other processes.

Children run the functions of ``tests/_pressure_workers.py`` (``spawn`` context) and report
through JSON files in ``tmp_path``; every child is killed and reaped in a ``finally``, every
wait has a deadline. The broker's own view is checked with plain pika (``helpers``) and, for
the bound, with ``rabbitmqctl eval`` on the suite's private node.
"""

from __future__ import annotations

import contextlib
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import _pressure_workers as W
import pika
import pytest
from helpers import (
    existing_queues,
    pressure_queues,
    queue_info,
)
from processes import children, join_all, read_json, start, wait_paths

from amqp_locks import PressureQueue, errors
from amqp_locks.broker import LocalBroker

MakeQueue = Callable[..., PressureQueue]


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


@pytest.fixture
def make_queue(rabbitmq_url: str, amqp_namespace: str) -> Iterator[MakeQueue]:
    """``make_queue(name="q", bound=None, url=None, **create_kwargs)``: a PressureQueue on a
    connection of its own (created unless ``bound`` is None); deleted afterwards."""
    made: list[PressureQueue] = []
    urls: dict[str, str] = {}

    def make(
        name: str = "q", bound: int | None = None, url: str | None = None, **create: Any
    ) -> PressureQueue:
        q = PressureQueue(name, url=url or rabbitmq_url, prefix=amqp_namespace)
        made.append(q)
        urls[name] = url or rabbitmq_url
        if bound is not None:
            q.create(bound, **create)
        return q

    yield make
    for q in made:
        q.disconnect()
    for name, url in urls.items():
        q = PressureQueue(name, url=url, prefix=amqp_namespace)
        with contextlib.suppress(errors.QueueDoesNotExistError):
            q.delete(timeout=10)
        q.disconnect()


def read_progress(path: Path, key: str, default: Any) -> Any:
    try:
        return read_json(path)[key]
    except (AssertionError, ValueError, KeyError):
        return default


def wait_for(predicate: Callable[[], bool], timeout: float, procs: Sequence[Any] = ()) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        dead = [p.pid for p in procs if p.exitcode is not None]
        assert not dead, f"workers {dead} exited early"
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def drain(q: PressureQueue) -> list[bytes]:
    items = []
    with q.consuming(timeout=10) as c:
        while (data := c.get_nowait()) is not None:
            items.append(data)
    return items


def check_prefix_run(numbers: list[int], reported: int) -> int:
    """``numbers`` must be 0..n-1 in order, with n the reported count or one more (the item
    whose commit went through just before the kill, not yet reported). Returns n."""
    n = len(numbers)
    assert numbers == list(range(n)), f"gaps, duplicates or disorder: {numbers[:20]}..."
    assert n in (reported, reported + 1), f"{n} items for {reported} puts reported"
    return n


# ------------------------------------------------------------------------------------------
# a killed producer
# ------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_killed_producer_frees_the_role_and_leaves_no_half_put_item(
    rabbitmq_url: str, amqp_namespace: str, make_queue: MakeQueue, tmp_path: Path
) -> None:
    bound = 2000
    q = make_queue(bound=bound)
    ready, progress, out = tmp_path / "ready", tmp_path / "progress.json", tmp_path / "out.json"
    with children() as procs:
        producer = start(
            procs, W.produce, rabbitmq_url, amqp_namespace, "q", 10**6,
            str(ready), str(progress), str(out), False, "doomed-producer",
        )  # fmt: skip
        wait_paths([ready], 30, procs)
        assert q.producer_id() == "doomed-producer"
        wait_for(lambda: read_progress(progress, "put", 0) >= 300, 30, procs)
        time.sleep(random.uniform(0, 0.05))
        producer.kill()  # SIGKILL, mid-put
        producer.join(10)
        killed_at = time.monotonic()
        reported = read_progress(progress, "put", 0)
        assert reported < bound, "the producer was meant to be killed before the queue filled"

        # The broker frees the role as it sees the socket close; retry until it has.
        while True:
            try:
                q.put_nowait(b"after the kill")
                break
            except errors.QueueInUseError:
                assert time.monotonic() - killed_at < 5, "role still held 5 s after SIGKILL"
                time.sleep(0.01)
        took = time.monotonic() - killed_at
        print(f"put {took * 1000:.0f} ms after the SIGKILL; {reported} puts reported")
        assert took < 1.0
    assert q.producer_id() != "doomed-producer"

    length = q.length()
    # Every credit the dead producer held came back; items + credits = bound.
    assert queue_info(rabbitmq_url, f"{q.base}:space")[0] + length == bound
    stats = q.stats()
    items = drain(q)
    assert items[-1] == b"after the kill"
    n = check_prefix_run([W.number(data) for data in items[:-1]], reported)
    assert length == n + 1
    assert stats["produced_messages"] == n + 1
    assert stats["produced_bytes"] == sum(map(len, items))
    assert q.stats()["consumed_messages"] == n + 1


@pytest.mark.timeout(90)
def test_a_waiting_producer_takes_over_from_a_killed_one(
    rabbitmq_url: str, amqp_namespace: str, make_queue: MakeQueue, tmp_path: Path
) -> None:
    """A put already waiting for the role gets it once the holder is SIGKILLed. The broker
    frees the role at once; the waiter notices at its role mutex's jittered fallback poll
    (0.5-1.5 s), as a dead holder sends no wake-up."""
    q = make_queue(bound=10)
    waiter = make_queue()
    ready, out = tmp_path / "ready", tmp_path / "out.json"
    done: list[float] = []
    with children() as procs:
        holder = start(
            procs, W.hold_role, rabbitmq_url, amqp_namespace, "q", "producer",
            str(ready), str(out),
        )  # fmt: skip
        wait_paths([ready], 30, procs)

        def put() -> None:
            waiter.put(b"waiter", timeout=20)
            done.append(time.monotonic())

        thread = threading.Thread(target=put, daemon=True)
        thread.start()
        time.sleep(0.5)
        assert not done, "put while another process held the producer role"
        holder.kill()
        holder.join(10)
        killed_at = time.monotonic()
        thread.join(20)
    assert done, "the waiting put never finished"
    took = done[0] - killed_at
    print(f"waiting put done {took * 1000:.0f} ms after the SIGKILL")
    assert took < 2.5
    assert drain(q) == [W.item(0), b"waiter"]
    assert q.stats()["produced_messages"] == 2


# ------------------------------------------------------------------------------------------
# a killed consumer
# ------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("kills", "replicated"),
    [(1, False), (1, True), (2, False)],
    ids=["once", "once-replicated", "twice-with-limit-2"],
)
def test_killed_consumer_inside_receive(
    rabbitmq_url: str,
    amqp_namespace: str,
    make_queue: MakeQueue,
    tmp_path: Path,
    kills: int,
    replicated: bool,
) -> None:
    bound = 5
    limit = 2 if kills == 2 else None
    q = make_queue(bound=bound, delivery_limit=limit, replicated=replicated)
    for n in range(5):
        q.put(W.item(n))
    with children() as procs:
        for k in range(kills):
            holding, out = tmp_path / f"holding-{k}.json", tmp_path / f"out-{k}.json"
            consumer = start(
                procs, W.hold_in_receive, rabbitmq_url, amqp_namespace, "q",
                str(holding), str(out),
            )  # fmt: skip
            wait_paths([holding], 30, [consumer])
            assert read_json(holding)["item"] == 0
            assert q.length() == 4  # item-0 is being received: not waiting
            assert queue_info(rabbitmq_url, f"{q.base}:space")[0] == 0  # no room came back
            consumer.kill()
            consumer.join(10)
    assert q.stats()["consumed_messages"] == 0
    assert q.length() == 5
    if kills == 1:
        # The same item, first in line.
        with q.receive(timeout=5) as data:
            assert data == W.item(0)
        rest = list(range(1, 5))
    else:
        # Two deliveries, both killed: the attempts record outlived them, and the limit
        # moves the item to the dead-letter queue on its third delivery.
        assert q.get(timeout=5) == W.item(1)
        assert q.dead_length() == 1
        rest = list(range(2, 5))
    assert [W.number(d) for d in drain(q)] == rest
    assert q.stats()["consumed_messages"] == 5 - (kills - 1)
    assert queue_info(rabbitmq_url, f"{q.base}:space")[0] == bound


# ------------------------------------------------------------------------------------------
# the bound under load, sampled inside the broker
# ------------------------------------------------------------------------------------------


_SAMPLER = r"""
Q = rabbit_misc:r(<<"/">>, queue, <<"{queue}">>),
ok = file:write_file("{started}", <<"started">>),
Loop = fun Loop(Max, N, AtMax, Over) ->
  case filelib:is_file("{stop}") of
    true -> {{sampled, Max, N, AtMax, Over}};
    false ->
      case rabbit_amqqueue:lookup(Q) of
        {{ok, AQ}} ->
          [{{messages, M}}] = rabbit_amqqueue:info(AQ, [messages]),
          timer:sleep(2),
          NewAtMax = case M of Max -> AtMax + 1; _ when M > Max -> 1; _ -> AtMax end,
          NewOver = case M > {limit} of true -> Over + 1; false -> Over end,
          Loop(max(M, Max), N + 1, NewAtMax, NewOver);
        _ -> {{gone, Max, N, AtMax, Over}}
      end
  end
end,
Loop(0, 0, 0, 0).
"""


class BrokerSampler:
    """Samples ``messages`` (ready + unacknowledged) of one queue every ~2 ms inside the
    broker (``rabbitmqctl eval``), from start() until stop(); reports the maximum, and how
    many samples were above ``limit``."""

    def __init__(self, broker: LocalBroker, queue: str, tmp_path: Path, limit: int) -> None:
        assert re.fullmatch(r"[A-Za-z0-9_.:\-]+", queue), queue
        self.broker = broker
        self.started = tmp_path / "sampler-started"
        self.stop_file = tmp_path / "sampler-stop"
        self.expr = _SAMPLER.format(
            queue=queue, started=self.started, stop=self.stop_file, limit=int(limit)
        )
        self.output: str | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.output = self.broker._ctl(["eval", self.expr], timeout=150)
        except BaseException as exc:
            self.error = exc

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.started.exists():
            assert self.error is None, self.error
            assert time.monotonic() < deadline, "sampler did not start"
            time.sleep(0.01)

    def stop(self) -> tuple[int, int, int, int]:
        """(largest count seen, samples, samples at that count, samples above ``limit``)."""
        W.touch(self.stop_file)
        self.thread.join(30)
        assert self.error is None, self.error
        assert self.output is not None
        text = re.sub(r"\s", "", self.output)
        found = re.search(r"\{(sampled|gone),(\d+),(\d+),(\d+),(\d+)\}", text)
        assert found, self.output
        assert found.group(1) == "sampled", "the data queue vanished while sampled"
        peak, samples, at_peak, over = (int(found.group(k)) for k in range(2, 6))
        return peak, samples, at_peak, over


@pytest.mark.private_broker
@pytest.mark.timeout(60)
def test_sampler_counts_ready_and_unacknowledged_messages(
    local_broker: LocalBroker, amqp_namespace: str, tmp_path: Path
) -> None:
    """The sampler below is not vacuous: it sees items being received, not only ready ones."""
    queue = f"{amqp_namespace}sampled"
    conn = pika.BlockingConnection(pika.URLParameters(local_broker.url))
    try:
        ch = conn.channel()
        ch.queue_declare(queue, durable=True)
        sampler = BrokerSampler(local_broker, queue, tmp_path, limit=3)
        sampler.start()
        for body in (b"1", b"2", b"3"):
            ch.basic_publish("", queue, body)
        method, _props, _body = ch.basic_get(queue, auto_ack=False)  # now 2 ready + 1 unacked
        ch.basic_publish("", queue, b"4")
        time.sleep(0.2)
        ch.basic_ack(method.delivery_tag)
        time.sleep(0.2)
        peak, samples, at_peak, over = sampler.stop()
        assert peak == 4 and samples > 10 and at_peak > 5 and 5 < over < samples
        ch.queue_delete(queue)
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.private_broker
@pytest.mark.timeout(150)
def test_bound_is_never_exceeded_under_load_nor_after_a_consumer_is_killed(
    local_broker: LocalBroker, amqp_namespace: str, make_queue: MakeQueue, tmp_path: Path
) -> None:
    url, bound, count = local_broker.url, 4, 1500
    q = make_queue(bound=bound, url=url)
    sampler = BrokerSampler(local_broker, q.base, tmp_path, limit=bound)
    sampler.start()
    p_ready, p_progress, p_out = (tmp_path / f"producer.{s}" for s in ("ready", "json", "out"))
    c_files = [
        tuple(tmp_path / f"consumer{k}.{s}" for s in ("ready", "json", "out")) for k in (1, 2)
    ]
    with children() as procs:
        producer = start(
            procs, W.produce, url, amqp_namespace, "q", count,
            str(p_ready), str(p_progress), str(p_out), False,
        )  # fmt: skip
        wait_paths([p_ready], 30, procs)
        wait_for(lambda: q.length() == bound, 30, procs)
        wait_for(lambda: read_progress(p_progress, "put", 0) == bound, 10, procs)
        time.sleep(0.2)
        assert read_progress(p_progress, "put", 0) == bound  # full: the producer waits

        ready, progress, out = c_files[0]
        consumer = start(
            procs, W.consume, url, amqp_namespace, "q", str(ready), str(progress), str(out)
        )
        wait_paths([ready], 30, procs)
        wait_for(lambda: len(read_progress(progress, "got", [])) >= 400, 60, procs)
        time.sleep(random.uniform(0, 0.02))
        consumer.kill()  # SIGKILL, most likely inside a receive block
        consumer.join(10)
        first = read_progress(progress, "got", [])
        # The producer refills what the dead consumer freed, and no more. (One less if the
        # consumer died between acknowledging an item and returning its credit: the credit is
        # owed until the next consumer takes the role and pays it; checked at the end.)
        time.sleep(0.5)
        assert q.length() in (bound - 1, bound)

        ready, progress, out = c_files[1]
        start(procs, W.consume, url, amqp_namespace, "q", str(ready), str(progress), str(out))
        join_all([producer], 90)
        # Every item is in: from here on the queue only shrinks. Stop sampling before close()
        # queues the end marker, which is no item (and takes no credit).
        peak, samples, at_peak, over = sampler.stop()
        q.close()
        join_all([procs[-1]], 90)
    print(
        f"data queue: peak {peak} (bound {bound}) in {samples} samples, {at_peak} at the "
        f"peak, {over} above the bound"
    )

    produced, consumed = read_json(p_out), read_json(c_files[1][2])
    assert "error" not in produced, produced["error"]["traceback"]
    assert "error" not in consumed, consumed["error"]["traceback"]
    assert produced["put"] == count
    assert consumed.get("closed")
    # Never above the bound, not even by one for a moment (a get's credit is published only
    # after its ack was applied: see _pressure._return_credit).
    assert peak <= bound, f"{peak} items on the broker, bound {bound} ({over} samples above)"
    assert peak >= bound, "the sampler never saw the queue full: the check proved nothing"
    assert samples >= 200
    # Every item once, in order; the one the killed consumer held may come again (at least
    # once), first in line for the next consumer.
    assert first == list(range(len(first)))
    second = consumed["got"]
    assert second[0] in (len(first) - 1, len(first)), (first[-3:], second[:3])
    assert second == list(range(second[0], count))
    stats = q.stats()
    assert stats["produced_messages"] == stats["consumed_messages"] == count
    assert queue_info(url, f"{q.base}:space")[0] == bound


# ------------------------------------------------------------------------------------------
# close and delete with clients blocked in other processes
# ------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("blocked", "action", "expected"),
    [
        ("get", "close", "QueueClosedError"),
        ("get", "delete", "QueueDoesNotExistError"),
        ("put", "delete", "QueueDoesNotExistError"),
    ],
)
def test_close_and_delete_wake_blocked_clients(
    rabbitmq_url: str,
    amqp_namespace: str,
    make_queue: MakeQueue,
    tmp_path: Path,
    blocked: str,
    action: str,
    expected: str,
) -> None:
    q = make_queue(bound=1)
    if blocked == "put":
        q.put(b"fills the queue")
    ready, out = tmp_path / "ready", tmp_path / "out.json"
    worker = W.blocked_get if blocked == "get" else W.blocked_put
    with children() as procs:
        proc = start(procs, worker, rabbitmq_url, amqp_namespace, "q", str(ready), str(out), 30.0)
        wait_paths([ready], 30, procs)
        # Really blocked on the broker: a consumer of the data queue (get) or of the credit
        # queue (put), held by the worker's role.
        waited_on = q.base if blocked == "get" else f"{q.base}:space"
        wait_for(lambda: queue_info(rabbitmq_url, waited_on)[1] == 1, 30, procs)
        holder = q.consumer_id() if blocked == "get" else q.producer_id()
        assert holder == f"blocked-{blocked}"
        time.sleep(0.2)
        assert proc.exitcode is None

        acted_at = time.time()
        if action == "close":
            q.close(timeout=5)
        else:
            q.delete(timeout=10)
            deleted_in = time.time() - acted_at
            print(f"delete took {deleted_in * 1000:.0f} ms with a blocked {blocked}")
            assert deleted_in < 5
        join_all([proc], 30)
    report = read_json(out)
    assert report.get("raised") == expected, report
    woke = report["t_returned"] - acted_at
    print(f"blocked {blocked} woke {woke * 1000:.0f} ms after {action}")
    assert woke < 1.0
    if action == "delete":
        assert not q.exists()
        left = existing_queues(rabbitmq_url, pressure_queues(q.base))
        assert not left, f"queues left on the broker: {sorted(left)}"
    else:
        assert q.closed() and q.length() == 0
        with pytest.raises(errors.QueueClosedError):
            q.get(timeout=5)


# ------------------------------------------------------------------------------------------
# stats stay exact when a producer is killed mid-run
# ------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_stats_exact_after_a_killed_producer(
    rabbitmq_url: str, amqp_namespace: str, make_queue: MakeQueue, tmp_path: Path
) -> None:
    bound = 8
    q = make_queue(bound=bound)
    reader = make_queue()
    got: list[bytes] = []
    killed = threading.Event()
    failure: list[BaseException] = []

    def consume() -> None:
        try:
            with reader.consuming(timeout=10) as c:
                while True:
                    try:
                        got.append(c.get(timeout=1.0))
                    except errors.OperationTimeoutError:
                        if killed.is_set():
                            return
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    ready, progress, out = tmp_path / "ready", tmp_path / "progress.json", tmp_path / "out.json"
    with children() as procs:
        producer = start(
            procs, W.produce, rabbitmq_url, amqp_namespace, "q", 10**6,
            str(ready), str(progress), str(out),
        )  # fmt: skip
        wait_paths([ready], 30, procs)
        wait_for(lambda: read_progress(progress, "put", 0) >= 500, 60, procs)
        time.sleep(random.uniform(0, 0.05))
        producer.kill()
        producer.join(10)
        killed.set()
        reported = read_progress(progress, "put", 0)
        thread.join(30)
    assert not thread.is_alive() and not failure, failure
    n = check_prefix_run([W.number(data) for data in got], reported)
    assert q.stats() == {
        "produced_messages": n,
        "produced_bytes": sum(map(len, got)),
        "consumed_messages": n,
        "consumed_bytes": sum(map(len, got)),
    }
    assert q.length() == 0
    assert queue_info(rabbitmq_url, f"{q.base}:space")[0] == bound
