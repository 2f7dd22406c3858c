"""amqp_locks.spark with real PySpark jobs (local mode, Python worker reuse on).

One SparkSession for the module (startup ≈ 6 s). ``local[4]`` runs 4 tasks at once and allows
no task retries (local mode's maxFailures is 1), so a failing partition fails its job and the
driver sees the executor's exception class and message.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark")

from pyspark import cloudpickle  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from spark_support import local_session  # noqa: E402

import amqp_locks.spark  # noqa: E402
from amqp_locks import Semaphore, SemaphoreAdmin  # noqa: E402
from amqp_locks.spark import URL_CONF_KEY, Throttle, throttled  # noqa: E402

pytestmark = pytest.mark.spark

# The partition functions below run in Spark's Python workers, which cannot import this test
# module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

PARALLELISM = 4


@pytest.fixture(scope="module")
def spark(rabbitmq_url: str) -> Iterator[SparkSession]:
    conf = {
        "spark.task.maxFailures": "1",
        "spark.sql.shuffle.partitions": str(PARALLELISM),
        URL_CONF_KEY: rabbitmq_url,
    }
    with local_session(f"local[{PARALLELISM}]", "amqp_locks-tests", conf) as session:
        yield session


@pytest.fixture
def admin(rabbitmq_url: str, amqp_namespace: str) -> Iterator[SemaphoreAdmin]:
    with SemaphoreAdmin("service", url=rabbitmq_url, namespace=amqp_namespace) as admin:
        yield admin
        admin.destroy()


def job_error(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    """What the driver reports about a failed job (Py4JJavaError or PythonException)."""
    return str(excinfo.value)


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    current = highest = 0
    for _, step in events:  # at equal times, -1 sorts first: touching intervals don't overlap
        current += step
        highest = max(highest, current)
    return highest


def test_map_partitions_never_runs_more_partitions_than_slots(
    spark: SparkSession,
    admin: SemaphoreAdmin,
    rabbitmq_url: str,
    amqp_namespace: str,
    tmp_path: Path,
) -> None:
    slots = PARALLELISM - 1
    admin.create(slots)
    log_dir = str(tmp_path)

    def call_service(rows: Iterator[int]) -> Iterator[int]:
        # The "external service" records when each partition was inside it.
        start = time.time()
        items = list(rows)
        time.sleep(0.25)
        end = time.time()
        with open(os.path.join(log_dir, f"{items[0]}.json"), "w") as f:
            json.dump([start, end], f)
        yield len(items)

    throttle = Throttle("service", rabbitmq_url, timeout=60, namespace=amqp_namespace)
    rdd = spark.sparkContext.parallelize(range(16 * 10), 16)
    assert sum(rdd.mapPartitions(throttle.wrap(call_service)).collect()) == 160

    intervals = [tuple(json.loads(p.read_text())) for p in tmp_path.glob("*.json")]
    assert len(intervals) == 16
    assert max_overlap(intervals) == slots  # never more, and the test could have seen more
    assert not admin.held()


def test_a_worker_reuses_one_connection_across_tasks(
    spark: SparkSession, admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(PARALLELISM)

    def which_connection(rows: Iterator[int]) -> Iterator[tuple[int, list[int]]]:
        list(rows)
        yield os.getpid(), [id(c) for c in amqp_locks.spark._connections.values()]

    throttle = Throttle("service", rabbitmq_url, timeout=60, namespace=amqp_namespace)
    rdd = spark.sparkContext.parallelize(range(32), 32)
    seen = rdd.mapPartitions(throttle.wrap(which_connection)).collect()

    by_pid: dict[int, set[tuple[int, ...]]] = {}
    for pid, connections in seen:
        assert len(connections) == 1  # one URL, one connection per worker process
        by_pid.setdefault(pid, set()).add(tuple(connections))
    assert len(by_pid) < len(seen)  # workers ran several tasks each…
    assert all(len(ids) == 1 for ids in by_pid.values())  # …over the same connection


def test_foreach_partition_failure_releases_the_slot_for_the_retry(
    spark: SparkSession, admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(1)
    throttle = Throttle("service", rabbitmq_url, timeout=10, namespace=amqp_namespace)

    def fail(rows: Iterator[int]) -> None:
        for _ in rows:
            raise RuntimeError("the service said no")

    def write(rows: Iterator[int]) -> None:
        for _ in rows:
            pass

    rdd = spark.sparkContext.parallelize(range(4), 1)
    with pytest.raises(Exception) as excinfo:
        rdd.foreachPartition(throttle.wrap(fail))
    assert "the service said no" in job_error(excinfo)
    # The next attempt (here: the next job) gets the only slot: the failed one let go.
    started = time.monotonic()
    spark.sparkContext.parallelize(range(8), 4).foreachPartition(throttle.wrap(write))
    assert time.monotonic() - started < 10
    assert not admin.held()


def test_a_lost_lease_fails_the_task_mid_partition(
    spark: SparkSession, admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(1)
    url, namespace = rabbitmq_url, amqp_namespace

    def endless_batches(batches: Iterator[Any]) -> Iterator[Any]:
        batch = next(batches)
        # An administrator removes the slot this task holds, from another connection.
        with SemaphoreAdmin("service", url=url, namespace=namespace) as other_admin:
            other_admin.remove(1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the throttle must stop this long before 30 s
            yield batch
            time.sleep(0.05)

    throttle = Throttle(
        "service", rabbitmq_url, timeout=10, namespace=amqp_namespace, verify_interval=0.5
    )
    df = spark.range(0, 100, numPartitions=1)
    started = time.monotonic()
    with pytest.raises(Exception) as excinfo:
        df.mapInArrow(throttle.wrap(endless_batches), df.schema).collect()
    assert time.monotonic() - started < 15
    error = job_error(excinfo)
    assert "LockLostError" in error
    assert f"lost slot 1 of semaphore '{amqp_namespace}service'" in error


def test_no_slot_within_the_timeout_fails_the_task_clearly(
    spark: SparkSession, admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(1)

    def passthrough(batches: Iterator[Any]) -> Iterator[Any]:
        yield from batches

    sem = Semaphore("service", url=rabbitmq_url, namespace=amqp_namespace)
    try:
        with sem.acquire(timeout=5):  # the driver keeps the only slot
            throttle = Throttle("service", rabbitmq_url, timeout=1, namespace=amqp_namespace)
            df = spark.range(0, 10, numPartitions=1)
            started = time.monotonic()
            with pytest.raises(Exception) as excinfo:
                df.mapInPandas(throttle.wrap(passthrough), df.schema).collect()
            assert time.monotonic() - started < 15
    finally:
        sem.close()
    error = job_error(excinfo)
    assert "ThrottleTimeoutError" in error
    assert f"waited 1 s for a slot of semaphore '{amqp_namespace}service'" in error


def test_map_in_pandas_runs_under_the_throttle(
    spark: SparkSession, admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(2)

    def double(batches: Iterator[Any]) -> Iterator[Any]:
        for frame in batches:
            yield frame.assign(id=frame["id"] * 2)

    df = spark.range(0, 100, numPartitions=4)
    wrapped = throttled(double, "service", rabbitmq_url, timeout=30, namespace=amqp_namespace)
    total = df.mapInPandas(wrapped, df.schema).groupBy().sum("id").collect()[0][0]
    assert total == 2 * sum(range(100))
    assert not admin.held()


def test_a_bad_url_fails_the_job_within_seconds(spark: SparkSession) -> None:
    throttle = Throttle("service", "amqp://guest:guest@127.0.0.1:1/%2F", connect_timeout=2)

    def identity(rows: Iterator[int]) -> Iterator[int]:
        yield from rows

    started = time.monotonic()
    with pytest.raises(Exception) as excinfo:
        spark.sparkContext.parallelize(range(4), 2).mapPartitions(throttle.wrap(identity)).collect()
    assert time.monotonic() - started < 15
    error = job_error(excinfo)
    assert "BrokerUnavailableError" in error
    assert "127.0.0.1:1" in error


def test_a_partition_stopped_early_by_take_releases_its_slot(
    spark: SparkSession, admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(1)

    def rows_forever(rows: Iterator[int]) -> Iterator[int]:
        yield from rows

    throttle = Throttle("service", rabbitmq_url, timeout=10, namespace=amqp_namespace)
    rdd = spark.sparkContext.parallelize(range(10_000), 1)
    assert rdd.mapPartitions(throttle.wrap(rows_forever)).take(3) == [0, 1, 2]
    deadline = time.monotonic() + 10
    while admin.held() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not admin.held()


def test_from_conf_reads_the_url_from_the_spark_configuration(
    spark: SparkSession, admin: SemaphoreAdmin, rabbitmq_url: str, amqp_namespace: str
) -> None:
    admin.create(1)
    for source in (spark, spark.sparkContext, spark.sparkContext.getConf()):
        throttle = Throttle.from_conf(source, "service", namespace=amqp_namespace, timeout=10)
        assert throttle.url == rabbitmq_url
    rdd = spark.sparkContext.parallelize(range(6), 3)
    assert rdd.mapPartitions(throttle.wrap(lambda rows: [sum(rows)])).sum() == 15
