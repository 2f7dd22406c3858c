"""amqp_locks.spark without Spark: what a Throttle is, and what its wrapper does in-process.

These run without PySpark installed (the module imports it lazily); the Spark jobs are in
``test_spark.py``.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Iterator

import pytest
from spark_support import FakeConf

import amqp_locks.spark
from amqp_locks import SemaphoreAdmin, errors
from amqp_locks.spark import (
    NAMESPACE_CONF_KEY,
    URL_CONF_KEY,
    Throttle,
    ThrottledFunction,
    ThrottleTimeoutError,
    close_connections,
    throttled,
)

URL = "amqp://user:s3cret@broker.example:5672/%2F"


def count_rows(rows: Iterator[int]) -> Iterator[int]:
    yield sum(1 for _ in rows)


@pytest.fixture
def admin(rabbitmq_url: str, amqp_namespace: str) -> Iterator[SemaphoreAdmin]:
    with SemaphoreAdmin("service", url=rabbitmq_url, namespace=amqp_namespace) as admin:
        yield admin
        admin.destroy()
    close_connections()


def test_public_names() -> None:
    assert set(amqp_locks.spark.__all__) == {
        "NAMESPACE_CONF_KEY",
        "URL_CONF_KEY",
        "Throttle",
        "ThrottleTimeoutError",
        "ThrottledFunction",
        "close_connections",
        "throttled",
        "ENCODINGS",
        "PREFIX_CONF_KEY",
        "Pipe",
        "PipeFormatError",
        "PipeItem",
        "PipeReader",
        "PipeWriter",
        "encode_json",
        "read_pipe",
        "write_to_pipe",
    }
    assert issubclass(ThrottleTimeoutError, errors.AcquireTimeoutError)
    assert issubclass(ThrottleTimeoutError, TimeoutError)
    error = pickle.loads(pickle.dumps(ThrottleTimeoutError("ns.api", 2.5, "process 1")))
    assert (error.name, error.timeout, error.task) == ("ns.api", 2.5, "process 1")
    assert str(error).startswith("process 1 waited 2.5 s for a slot of semaphore 'ns.api'")


def test_a_throttle_and_its_wrapped_function_pickle_as_plain_values() -> None:
    throttle = Throttle("service", URL, timeout=30, namespace="ns.")
    assert pickle.loads(pickle.dumps(throttle)) == throttle
    wrapped = pickle.loads(pickle.dumps(throttle.wrap(count_rows)))
    assert isinstance(wrapped, ThrottledFunction)
    assert wrapped.throttle == throttle and wrapped.fn is count_rows
    assert wrapped.__name__ == "count_rows"


def test_repr_masks_the_password() -> None:
    text = repr(Throttle("service", URL))
    assert "s3cret" not in text
    assert "user:***@broker.example" in text


@pytest.mark.parametrize(
    "kwargs",
    [
        {"url": None},
        {"url": "http://broker/"},
        {"name": ""},
        {"name": "amq.reserved"},
        {"timeout": -1},
        {"timeout": "5"},
        {"heartbeat": 0},
        {"connect_timeout": 0},
        {"verify_interval": -2},
    ],
)
def test_bad_arguments_fail_on_the_driver(kwargs: dict[str, object]) -> None:
    arguments: dict[str, object] = {"name": "service", "url": URL, **kwargs}
    with pytest.raises(errors.InvalidArgumentError):
        Throttle(**arguments)  # type: ignore[arg-type]


def test_from_conf_reads_url_and_namespace_and_needs_the_url() -> None:
    conf = FakeConf({URL_CONF_KEY: URL, NAMESPACE_CONF_KEY: "ns."})
    assert Throttle.from_conf(conf, "service", timeout=5) == Throttle(
        "service", URL, timeout=5, namespace="ns."
    )
    assert Throttle.from_conf(conf, "service", namespace="mine.").namespace == "mine."
    with pytest.raises(errors.InvalidArgumentError, match=URL_CONF_KEY):
        Throttle.from_conf(FakeConf({}), "service")


def test_the_wrapped_function_holds_a_slot_while_it_runs(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(2)
    seen: list[list[int]] = []

    def observe(rows: Iterator[int]) -> Iterator[int]:
        seen.append(list(admin.held()))
        yield from rows

    wrapped = throttled(observe, "service", rabbitmq_url, timeout=5, namespace=amqp_namespace)
    assert list(wrapped(iter(range(3)))) == [0, 1, 2]
    assert seen == [[1]]
    assert not admin.held()


def test_a_foreach_partition_function_returning_none_is_supported(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(1)
    written: list[int] = []
    throttle = Throttle("service", rabbitmq_url, timeout=5, namespace=amqp_namespace)
    assert list(throttle.wrap(written.extend)(iter(range(4)))) == []
    assert written == [0, 1, 2, 3]


def test_a_speculative_copy_takes_a_slot_of_its_own(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    """Two attempts of one partition are two holders: with one slot, the copy must wait."""
    admin.create(1)
    inside, leave = threading.Event(), threading.Event()

    def original(rows: Iterator[int]) -> Iterator[int]:
        inside.set()
        leave.wait(10)
        yield from rows

    throttle = Throttle("service", rabbitmq_url, timeout=0.5, namespace=amqp_namespace)
    first = threading.Thread(target=lambda: list(throttle.wrap(original)(iter(range(3)))))
    first.start()
    try:
        assert inside.wait(10)
        with pytest.raises(ThrottleTimeoutError, match=r"waited 0\.5 s for a slot of semaphore"):
            list(throttle.wrap(count_rows)(iter(range(3))))
    finally:
        leave.set()
        first.join(10)
    assert list(throttle.wrap(count_rows)(iter(range(3)))) == [3]


def test_losing_the_connection_fails_at_the_next_input_row(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(1)
    processed: list[int] = []

    def write(rows: Iterator[int]) -> None:
        for row in rows:
            processed.append(row)
            if row == 1:
                close_connections()  # the worker's connection dies under the lease

    throttle = Throttle("service", rabbitmq_url, timeout=5, namespace=amqp_namespace)
    with pytest.raises(errors.LockLostError, match="lost slot 1 of semaphore"):
        list(throttle.wrap(write)(iter(range(10))))
    assert processed == [0, 1]
    # The next partition opens a new connection.
    assert list(throttle.wrap(count_rows)(iter(range(3)))) == [3]


def test_hold_verifies_the_slot_when_the_block_ends(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(1)
    throttle = Throttle("service", rabbitmq_url, timeout=5, namespace=amqp_namespace)
    with throttle.hold() as lease:
        assert lease.held and lease.slot == 1
    assert not admin.held()
    with pytest.raises(errors.LockLostError), throttle.hold():
        admin.remove(1)  # only the broker knows yet: the check at the end asks it
    assert not admin.held()


def test_each_process_has_its_own_connection_after_fork(
    admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(2)
    throttle = Throttle("service", rabbitmq_url, timeout=5, namespace=amqp_namespace)
    with throttle.hold() as parent_lease:
        parent_connections = dict(amqp_locks.spark._connections)
        pid = os.fork()
        if pid == 0:  # the child: takes the other slot over a connection of its own
            status = 1
            try:
                with throttle.hold() as lease:
                    mine = list(amqp_locks.spark._connections.values())
                    fresh = len(mine) == 1 and mine[0] not in parent_connections.values()
                    status = 0 if lease.slot == 2 and fresh else 1
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert parent_lease.held
        assert amqp_locks.spark._connections == parent_connections
