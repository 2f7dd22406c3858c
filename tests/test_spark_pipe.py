"""amqp_locks.spark pipes: Spark partitions feeding a bounded pressure queue, read back in order.

The tests marked ``spark`` run real PySpark jobs in local mode (one SparkSession for the
module, ``local[4,2]``: four tasks at once and two attempts per task, so a failing first
attempt is retried). The others check the Pipe, the envelope and the reader in-process,
without Spark, against the suite's broker.

Every pipe is made with the test's ``amqp_namespace`` as its prefix and deleted afterwards.
"""

from __future__ import annotations

import datetime
import decimal
import itertools
import json
import math
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from helpers import declared_queues
from spark_support import FakeConf, local_session

import amqp_locks.spark
from amqp_locks import errors
from amqp_locks.spark import (
    PREFIX_CONF_KEY,
    URL_CONF_KEY,
    Pipe,
    PipeFormatError,
    PipeItem,
    PipeReader,
    PipeWriter,
    close_connections,
    encode_json,
    read_pipe,
    write_to_pipe,
)

URL = "amqp://user:s3cret@broker.example:5672/%2F"
BAD_URL = "amqp://guest:guest@127.0.0.1:1/%2F"
PARALLELISM = 4

MakePipe = Callable[..., Pipe]


@pytest.fixture
def make_pipe(rabbitmq_url: str, amqp_namespace: str) -> Iterator[MakePipe]:
    """``make_pipe(bound=None, name="rows", **pipe_kwargs)``: a Pipe in the test's namespace,
    created first unless ``bound`` is None; deleted afterwards."""
    made: list[Pipe] = []

    def make(bound: int | None = None, name: str = "rows", **kwargs: Any) -> Pipe:
        kwargs.setdefault("put_timeout", 60)
        kwargs.setdefault("role_timeout", 120)
        pipe = Pipe(name, rabbitmq_url, prefix=amqp_namespace, **kwargs)
        made.append(pipe)
        if bound is not None:
            pipe.create(bound)
        return pipe

    yield make
    close_connections()
    for pipe in made:
        pipe.delete(timeout=30)


class Reader(threading.Thread):
    """Drains a pipe in the background (as a driver thread would), ``delay`` s per row."""

    def __init__(self, pipe: Pipe, delay: float = 0.0, **reader_kwargs: Any) -> None:
        super().__init__(daemon=True)
        self.reader = pipe.reader(timeout=60, **reader_kwargs)
        self.delay = delay
        self.items: list[PipeItem] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.reader:
                for item in self.reader.items():
                    self.items.append(item)
                    if self.delay:
                        time.sleep(self.delay)
        except BaseException as exc:
            self.error = exc

    def result(self, timeout: float = 60) -> list[PipeItem]:
        self.join(timeout)
        assert not self.is_alive(), "the reader did not end: was the pipe closed?"
        if self.error is not None:
            raise self.error
        return self.items


def by_partition(items: Iterable[PipeItem]) -> dict[int, list[PipeItem]]:
    groups: dict[int, list[PipeItem]] = {}
    for item in items:
        assert item.partition is not None
        groups.setdefault(item.partition, []).append(item)
    return groups


def envelope(
    run: str, partition: int, attempt: int, index: int, value: Any, stage: int = 1
) -> bytes:
    """An item exactly as docs/spark.md documents the envelope (built independently)."""
    header = {
        "pipe": 1,
        "enc": "json",
        "run": run,
        "stage": stage,
        "partition": partition,
        "attempt": attempt,
        "index": index,
    }
    return json.dumps(header, separators=(",", ":")).encode() + b"\n" + json.dumps(value).encode()


# -- without Spark ----------------------------------------------------------------------------


def test_a_pipe_and_its_writer_pickle_as_plain_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRESSURE_PREFIX", "driver-prefix")
    pipe = Pipe("rows", URL, encoding="bytes", rows_per_turn=10)
    assert pipe.prefix == "driver-prefix"  # resolved on the driver…
    monkeypatch.setenv("PRESSURE_PREFIX", "executor-prefix")
    copy = pickle.loads(pickle.dumps(pipe))
    assert copy == pipe and copy.prefix == "driver-prefix"  # …never on the executor
    writer = pipe.writer()
    assert isinstance(writer, PipeWriter)
    assert pickle.loads(pickle.dumps(writer)) == writer
    assert pipe.writer().run != writer.run  # each writer is a run of its own
    monkeypatch.delenv("PRESSURE_PREFIX")
    assert Pipe("rows", URL).prefix == "__pressure__"


def test_repr_masks_the_password() -> None:
    text = repr(Pipe("rows", URL))
    assert "s3cret" not in text
    assert "user:***@broker.example" in text


@pytest.mark.parametrize(
    "kwargs",
    [
        {"url": None},
        {"url": "http://broker/"},
        {"name": ""},
        {"name": "rows:space"},
        {"encoding": "pickle"},
        {"envelope": 1},
        {"rows_per_turn": 0},
        {"rows_per_turn": True},
        {"put_timeout": -1},
        {"role_timeout": "5"},
        {"heartbeat": 0},
        {"connect_timeout": 0},
    ],
)
def test_bad_arguments_fail_on_the_driver(kwargs: dict[str, object]) -> None:
    arguments: dict[str, object] = {"name": "rows", "url": URL, **kwargs}
    with pytest.raises(errors.InvalidArgumentError):
        Pipe(**arguments)  # type: ignore[arg-type]


def test_from_conf_reads_url_and_prefix_and_needs_the_url() -> None:
    conf = FakeConf({URL_CONF_KEY: URL, PREFIX_CONF_KEY: "jobs"})
    assert Pipe.from_conf(conf, "rows", encoding="bytes") == Pipe(
        "rows", URL, prefix="jobs", encoding="bytes"
    )
    assert Pipe.from_conf(conf, "rows", prefix="mine").prefix == "mine"
    with pytest.raises(errors.InvalidArgumentError, match=URL_CONF_KEY):
        Pipe.from_conf(FakeConf({}), "rows")


def test_json_encoding_of_values_json_lacks() -> None:
    row = {
        "day": datetime.date(2024, 5, 6),
        "at": datetime.datetime(2024, 5, 6, 7, 8, 9, 123000),
        "clock": datetime.time(7, 8),
        "price": decimal.Decimal("12.30"),
        "blob": b"\x00\xff",
        "nested": [(1, "a")],
        "nan": math.nan,
    }
    decoded = json.loads(encode_json(row))
    assert decoded == {
        "day": "2024-05-06",
        "at": "2024-05-06T07:08:09.123000",
        "clock": "07:08:00",
        "price": "12.30",
        "blob": "AP8=",
        "nested": [[1, "a"]],
        "nan": decoded["nan"],
    }
    assert math.isnan(decoded["nan"])
    assert encode_json("é") == '"é"'.encode()  # UTF-8, not \\u escapes
    with pytest.raises(TypeError, match="complex value has no JSON form"):
        encode_json({"z": 1j})


def test_json_encoding_of_spark_rows() -> None:
    sql = pytest.importorskip("pyspark.sql")
    Row = sql.Row
    row = Row(id=1, name="a", point=Row(x=1, y=2), tags=[Row(k="t")])
    assert encode_json(row) == b'{"id":1,"name":"a","point":{"x":1,"y":2},"tags":[{"k":"t"}]}'
    assert encode_json(Row(1, 2)) == b"[1,2]"  # a Row without field names: an array


def test_rows_written_outside_spark_round_trip_with_their_envelope(make_pipe: MakePipe) -> None:
    pipe = make_pipe(bound=0)
    writer = pipe.writer()
    assert writer.write([{"a": 1}, [1, 2], "x", None]) == 4
    assert writer.write(iter(range(3))) == 3  # outside Spark each call is a stream of its own
    assert writer.write([]) == 0

    q = pipe.queue()
    try:
        raw = q.get(timeout=5)  # the documented format, read with the plain queue API
        head, _, payload = raw.partition(b"\n")
        header = json.loads(head)
        assert head.startswith(b'{"pipe":1,')
        assert set(header) == {"pipe", "enc", "run", "stage", "partition", "attempt", "index"}
        assert header["enc"] == "json" and header["run"].startswith(writer.run + "~")
        assert (header["stage"], header["partition"], header["attempt"], header["index"]) == (
            -1,
            0,
            0,
            0,
        )
        assert json.loads(payload) == {"a": 1}
    finally:
        q.disconnect()
    assert pipe.close()
    assert not pipe.close()  # already closed

    with pipe.reader(timeout=5) as reader:
        items = list(reader.items())
    assert [item.value for item in items] == [[1, 2], "x", None, 0, 1, 2]
    assert [item.index for item in items] == [1, 2, 3, 0, 1, 2]
    assert len({item.run for item in items}) == 2
    # Row 0 of the first stream was taken above, by another consumer.
    assert (reader.delivered, reader.duplicates, reader.skipped) == (6, 0, 1)
    assert pipe.stats()["produced_messages"] == pipe.stats()["consumed_messages"] == 7


def test_the_reader_drops_rows_a_retried_attempt_writes_again(make_pipe: MakePipe) -> None:
    pipe = make_pipe(bound=0)
    q = pipe.queue()
    try:
        with q.producing() as p:
            for index in range(3):  # attempt 0 of partition 5 dies after 3 rows
                p.put(envelope("r1", 5, 0, index, f"p5-{index}"))
            p.put(envelope("r1", 6, 0, 0, "p6-0"))
            for index in range(5):  # attempt 1 writes the whole partition again
                p.put(envelope("r1", 5, 1, index, f"p5-{index}"))
            p.put(envelope("r1", 6, 0, 1, "p6-1"))
            p.put(envelope("r2", 5, 0, 0, "next run"))  # another writer: not a duplicate
            p.put(envelope("r1", 5, 0, 0, "next stage", stage=2))  # another job's stage
            p.put(envelope("r1", 7, 0, 2, "p7-2"))  # rows 0-1 never reached this reader
            p.close()
    finally:
        q.disconnect()

    reader = read_pipe(pipe.name, pipe.url, prefix=pipe.prefix, timeout=5)
    with reader:
        items = list(reader.items())
    assert [item.value for item in items] == [
        "p5-0",
        "p5-1",
        "p5-2",
        "p6-0",
        "p5-3",
        "p5-4",
        "p6-1",
        "next run",
        "next stage",
        "p7-2",
    ]
    assert [item.attempt for item in items if item.partition == 5 and item.run == "r1"] == [
        0,
        0,
        0,
        1,
        1,
        0,  # stage 2
    ]
    assert (reader.delivered, reader.duplicates, reader.skipped) == (10, 3, 2)
    assert pipe.length() == 0


def test_without_dedup_the_reader_delivers_every_copy(make_pipe: MakePipe) -> None:
    pipe = make_pipe(bound=0)
    q = pipe.queue()
    try:
        for attempt in (0, 1):
            q.put(envelope("r", 0, attempt, 0, "row"))
        q.close()
    finally:
        q.disconnect()
    with pipe.reader(timeout=5, dedup=False) as reader:
        assert list(reader) == ["row", "row"]


def test_an_item_without_an_envelope_fails_the_reader_and_stays(make_pipe: MakePipe) -> None:
    pipe = make_pipe(bound=0)
    q = pipe.queue()
    try:
        q.put(b"not a pipe row")
        with pipe.reader(timeout=5) as reader, pytest.raises(PipeFormatError, match="no pipe env"):
            next(iter(reader))
        assert q.length() == 1  # put back, untouched
        assert q.get(timeout=5) == b"not a pipe row"
    finally:
        q.disconnect()


def test_stopping_early_acknowledges_the_rows_seen(make_pipe: MakePipe) -> None:
    pipe = make_pipe(bound=0)
    pipe.writer().write(range(5))
    pipe.close()
    with pipe.reader(timeout=5) as reader:
        for value in reader:
            if value == 1:
                break
    with pipe.reader(timeout=5) as reader:  # a new reader goes on after the rows seen
        assert list(reader) == [2, 3, 4]


def test_bytes_pipes_without_envelopes_carry_bare_payloads(make_pipe: MakePipe) -> None:
    pipe = make_pipe(bound=4, encoding="bytes", envelope=False)
    assert pipe.writer().write([b"a", bytearray(b"b"), memoryview(b"c")]) == 3
    with pytest.raises(TypeError, match="encoding='bytes' takes bytes rows, got str"):
        pipe.writer().write([b"d", "e"])
    pipe.close()
    q = pipe.queue()
    try:
        assert q.peek() == b"a"  # a plain consumer sees exactly the payload
    finally:
        q.disconnect()
    with pytest.raises(errors.InvalidArgumentError, match="dedup needs envelopes"):
        pipe.reader(dedup=True)
    with pipe.reader(timeout=5) as reader:
        assert list(reader) == [b"a", b"b", b"c", b"d"]
        assert reader.dedup is False


def test_a_full_pipe_fails_the_writer_after_put_timeout(make_pipe: MakePipe) -> None:
    pipe = make_pipe(bound=2, put_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(errors.OperationTimeoutError, match=r"put of row 2 \(waiting for room"):
        pipe.writer().write(range(5))
    assert time.monotonic() - started < 5
    assert pipe.length() == 2


def test_losing_the_connection_fails_the_writer(make_pipe: MakePipe) -> None:
    pipe = make_pipe(bound=0)

    def rows() -> Iterator[int]:
        for row in range(10):
            if row == 3:
                close_connections()  # the worker's connection dies under the producer role
            yield row

    with pytest.raises(errors.LockLostError, match="producer role"):
        pipe.writer().write(rows())
    assert pipe.length() == 3
    assert pipe.writer().write(range(2)) == 2  # the next partition opens a new connection


def test_a_row_that_cannot_be_encoded_fails_the_writer_naming_it(make_pipe: MakePipe) -> None:
    pipe = make_pipe(bound=0)
    with pytest.raises(ValueError, match=r"process \d+, row 1: .*surrogates"):
        pipe.writer().write(["ok", "\ud800"])  # a lone surrogate has no UTF-8 form
    assert pipe.length() == 1


def test_write_to_pipe_needs_a_dataframe_or_an_rdd() -> None:
    with pytest.raises(errors.InvalidArgumentError, match="DataFrame or RDD"):
        write_to_pipe([1, 2, 3], Pipe("rows", URL))


def test_a_missing_pipe_fails_the_writer_clearly(make_pipe: MakePipe) -> None:
    pipe = make_pipe(bound=None, name="never-created")
    with pytest.raises(errors.QueueDoesNotExistError):
        pipe.writer().write([1])
    assert isinstance(pipe.reader(), PipeReader)


# -- with Spark ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spark(rabbitmq_url: str) -> Iterator[Any]:
    pytest.importorskip("pyspark")
    from pyspark import cloudpickle

    # The partition functions below run in Spark's Python workers, which cannot import this
    # test module: ship its functions by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    conf = {
        "spark.sql.shuffle.partitions": str(PARALLELISM),
        "spark.sql.session.timeZone": "UTC",
        URL_CONF_KEY: rabbitmq_url,
    }
    # local[N,2]: two attempts per task, so a failing first attempt is retried.
    with local_session(f"local[{PARALLELISM},2]", "amqp_locks-pipe-tests", conf) as session:
        yield session


def job_error(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    """What the driver reports about a failed job (Py4JJavaError or PythonException)."""
    return str(excinfo.value)


@pytest.mark.spark
def test_rows_arrive_once_in_order_and_the_bound_holds_the_job_back(
    spark: Any, make_pipe: MakePipe, rabbitmq_url: str
) -> None:
    partitions, per_partition, bound, delay = 16, 25, 8, 0.005
    rows = partitions * per_partition
    pipe = make_pipe(bound=bound)
    reader = Reader(pipe, delay=delay)  # a slow consumer
    reader.start()
    lengths: list[int] = []
    stop = threading.Event()

    data_queue = f"{pipe.prefix}:{pipe.name}"  # docs/pressure.md: the data queue is P:Q

    def sample() -> None:  # the data queue's ready items, by passive declares (not the library)
        while not stop.is_set():
            found = declared_queues(rabbitmq_url, [data_queue])[data_queue]
            if found is not None:
                lengths.append(found[0])
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    rdd = spark.sparkContext.parallelize(range(rows), partitions)
    assert write_to_pipe(rdd, pipe, close=False) == rows
    elapsed = time.monotonic() - started
    stop.set()
    sampler.join(10)
    pipe.close()  # after sampling: the end marker is a message too
    items = reader.result()

    groups = by_partition(items)
    assert sorted(groups) == list(range(partitions))
    for partition, group in groups.items():
        first = partition * per_partition
        assert [item.value for item in group] == list(range(first, first + per_partition))
        assert [item.index for item in group] == list(range(per_partition))
        assert {item.attempt for item in group} == {0}
    # One producer turn per partition: each partition's rows are contiguous.
    assert sum(1 for a, b in itertools.pairwise(items) if a.partition != b.partition) == 15
    assert (reader.reader.duplicates, reader.reader.skipped) == (0, 0)
    # Bounded, and full at times: the producers had to wait for the slow consumer.
    assert len(lengths) > 20
    assert max(lengths) <= bound
    assert max(lengths) >= bound - 1
    assert elapsed >= rows * delay
    stats = pipe.stats()
    assert stats["produced_messages"] == stats["consumed_messages"] == rows


@pytest.mark.spark
@pytest.mark.parametrize("rows_per_turn", [None, 4])
def test_a_retried_task_delivers_each_row_once(
    spark: Any, make_pipe: MakePipe, rows_per_turn: int | None
) -> None:
    partitions, per_partition = 6, 12
    pipe = make_pipe(bound=5, rows_per_turn=rows_per_turn)
    reader = Reader(pipe)
    reader.start()

    def fail_first_attempt_of_partition_3(rows: Iterator[int]) -> Iterator[int]:
        from pyspark import TaskContext

        context = TaskContext.get()
        assert context is not None
        for n, row in enumerate(rows):
            if n == 6 and context.partitionId() == 3 and context.attemptNumber() == 0:
                raise RuntimeError("attempt 0 of partition 3 dies after 6 rows")
            yield row

    rdd = spark.sparkContext.parallelize(range(partitions * per_partition), partitions)
    written = write_to_pipe(rdd.mapPartitions(fail_first_attempt_of_partition_3), pipe)
    assert written == partitions * per_partition  # successful attempts only
    items = reader.result()

    groups = by_partition(items)
    for partition, group in groups.items():
        first = partition * per_partition
        assert [item.value for item in group] == list(range(first, first + per_partition))
    attempts = [item.attempt for item in groups[3]]
    # Rows put before the failure (a whole turn of 4 with rows_per_turn=4) come from
    # attempt 0; the retry's copies of them were dropped, its later rows delivered.
    duplicates = 6 if rows_per_turn is None else 4
    assert attempts == [0] * duplicates + [1] * (per_partition - duplicates)
    assert reader.reader.duplicates == duplicates
    stats = pipe.stats()
    assert stats["produced_messages"] == partitions * per_partition + duplicates
    assert stats["consumed_messages"] == stats["produced_messages"]


@pytest.mark.spark
def test_a_task_that_loses_the_producer_role_fails(spark: Any, make_pipe: MakePipe) -> None:
    pipe = make_pipe(bound=0)

    def lose_the_connection_at_row_3(rows: Iterator[int]) -> Iterator[int]:
        for n, row in enumerate(rows):
            if n == 3:  # the worker's connection dies while the task holds the role
                amqp_locks.spark.close_connections()
            yield row

    rdd = spark.sparkContext.parallelize(range(10), 1).mapPartitions(lose_the_connection_at_row_3)
    started = time.monotonic()
    with pytest.raises(Exception) as excinfo:
        rdd.foreachPartition(pipe.writer())
    assert time.monotonic() - started < 30
    error = job_error(excinfo)
    assert "LockLostError" in error
    assert "producer role" in error
    assert pipe.length() == 6  # 3 rows from each of the two attempts, then each failed


@pytest.mark.spark
def test_a_bad_url_fails_fast_with_a_clear_message(spark: Any, amqp_namespace: str) -> None:
    pipe = Pipe("rows", BAD_URL, prefix=amqp_namespace, connect_timeout=2)
    started = time.monotonic()
    with pytest.raises(Exception) as excinfo:
        spark.sparkContext.parallelize(range(4), 2).foreachPartition(pipe.writer())
    assert time.monotonic() - started < 20
    error = job_error(excinfo)
    assert "BrokerUnavailableError" in error
    assert "127.0.0.1:1" in error
    # write_to_pipe checks on the driver first: no job runs.
    started = time.monotonic()
    with pytest.raises(errors.BrokerUnavailableError, match=r"127\.0\.0\.1:1"):
        write_to_pipe(spark.range(4), pipe)
    assert time.monotonic() - started < 10


@pytest.mark.spark
def test_dataframe_rows_round_trip_as_json(spark: Any, make_pipe: MakePipe) -> None:
    from pyspark.sql import types as T

    schema = T.StructType(
        [
            T.StructField("id", T.LongType()),
            T.StructField("name", T.StringType()),
            T.StructField("score", T.DoubleType()),
            T.StructField("ok", T.BooleanType()),
            T.StructField("missing", T.StringType()),
            T.StructField("day", T.DateType()),
            T.StructField("at", T.TimestampType()),
            T.StructField("price", T.DecimalType(10, 2)),
            T.StructField("tags", T.ArrayType(T.StringType())),
            T.StructField(
                "point",
                T.StructType(
                    [T.StructField("x", T.IntegerType()), T.StructField("y", T.IntegerType())]
                ),
            ),
            T.StructField("attrs", T.MapType(T.StringType(), T.IntegerType())),
            T.StructField("blob", T.BinaryType()),
        ]
    )
    data = [
        (
            i,
            f"row {i} é",
            i / 4,
            i % 2 == 0,
            None,
            datetime.date(2024, 1, 1 + i),
            datetime.datetime(2024, 5, 6, 7, 8, 9, 250000),
            decimal.Decimal(f"{i}.50"),
            ["a", "b"][: i % 3],
            (i, -i),
            {"k": i},
            bytes([i, 255]),
        )
        for i in range(6)
    ]
    df = spark.createDataFrame(data, schema).repartition(3, "id").sortWithinPartitions("id")
    pipe = make_pipe(bound=4)
    reader = Reader(pipe)
    reader.start()
    assert write_to_pipe(df, pipe) == 6  # and closes the pipe: the reader ends
    values = sorted((item.value for item in reader.result()), key=lambda v: v["id"])
    assert values[3] == {
        "id": 3,
        "name": "row 3 é",
        "score": 0.75,
        "ok": False,
        "missing": None,
        "day": "2024-01-04",
        "at": "2024-05-06T07:08:09.250000",
        "price": "3.50",
        "tags": [],
        "point": {"x": 3, "y": -3},
        "attrs": {"k": 3},
        "blob": "A/8=",
    }
    assert [list(v) for v in values] == [[f.name for f in schema.fields]] * 6  # field order
    assert [v["id"] for v in values] == list(range(6))


@pytest.mark.spark
def test_a_worker_reuses_one_connection_across_pipe_tasks(
    spark: Any, make_pipe: MakePipe, rabbitmq_url: str
) -> None:
    pipe = make_pipe(bound=0, encoding="json")
    url = rabbitmq_url

    def report_connection(rows: Iterator[int]) -> Iterator[Any]:
        yield from rows
        # After the first row the writer holds the role over the worker's cached connection.
        yield {
            "pid": os.getpid(),
            "connections": [id(c) for k, c in amqp_locks.spark._connections.items() if k[1] == url],
        }

    rdd = spark.sparkContext.parallelize(range(24), 24).mapPartitions(report_connection)
    write_to_pipe(rdd, pipe)
    with pipe.reader(timeout=10) as reader:
        reports = [v for v in reader if isinstance(v, dict)]
    assert len(reports) == 24
    by_pid: dict[int, set[tuple[int, ...]]] = {}
    for report in reports:
        assert len(report["connections"]) == 1
        by_pid.setdefault(report["pid"], set()).add(tuple(report["connections"]))
    assert len(by_pid) < len(reports)  # workers ran several tasks each…
    assert all(len(ids) == 1 for ids in by_pid.values())  # …over the same connection


@pytest.mark.spark
def test_from_conf_reads_the_url_from_the_spark_configuration(
    spark: Any, rabbitmq_url: str
) -> None:
    assert Pipe.from_conf(spark, "rows").url == rabbitmq_url
