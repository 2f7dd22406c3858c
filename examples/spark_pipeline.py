"""A PySpark job streams results through a bounded pressure queue to a consumer process.

Each partition calls a slow "external service" for each of its rows. At most 2 calls run at
once, on every executor together: the partitions hold a slot of a 2-slot semaphore
(amqp_locks.spark.Throttle). Their results go into a pipe, a pressure queue with room for a
few rows (amqp_locks.spark.Pipe); a consumer process reads it, slower than the job could
write, so the job waits for it (backpressure). At the end the script prints the largest
number of service calls seen at once, the throughput and the queue's stats.

    python examples/spark_pipeline.py                        # local[2]; $AMQP_URL, else a
                                                             # private broker (LocalBroker)
    python examples/spark_pipeline.py --master spark://host:7077 \\
        --url amqp://user:pw@broker:5672/%2F --rows 2000 --partitions 40

Exits 1 if an invariant fails: more calls at once than slots, a row lost, duplicated or out
of order within its partition, more rows queued than the bound, or stats that do not add up.
Needs the spark extra (pip install 'amqp-locks[spark]') and Java.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from amqp_locks import SemaphoreAdmin, errors
from amqp_locks.spark import Pipe, Throttle, read_pipe, write_to_pipe


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (touching ones do not overlap)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    current = highest = 0
    for _, step in events:
        current += step
        highest = max(highest, current)
    return highest


def consume(name: str, url: str, prefix: str, delay: float, out: Any) -> None:
    """The consumer process: read the pipe until it is closed and drained, then report."""
    by_partition: dict[int, list[int]] = {}
    intervals: list[tuple[float, float]] = []
    last = 0.0
    try:
        with read_pipe(name, url, prefix=prefix, timeout=300) as reader:
            for item in reader.items():
                row = item.value
                assert item.partition is not None
                by_partition.setdefault(item.partition, []).append(row["n"])
                intervals.append((row["start"], row["end"]))
                time.sleep(delay)  # the consumer's own work: slower than the job
                last = time.time()
        out.put(
            {
                "partitions": by_partition,
                "max_concurrency": max_overlap(intervals),
                "rows": reader.delivered,
                "duplicates": reader.duplicates,
                # From the first service call to the last row consumed.
                "seconds": last - min((start for start, _ in intervals), default=last),
            }
        )
    except BaseException as exc:
        out.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def run(args: argparse.Namespace, url: str) -> int:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers need amqp_locks
    from pyspark.sql import SparkSession

    tag = secrets.token_hex(3)
    service_name = f"examples.slow-service-{tag}"
    prefix = "examples"
    pipe = Pipe(
        f"spark-results-{tag}",
        url,
        prefix=prefix,
        encoding="json",
        rows_per_turn=args.rows_per_turn,  # partitions compute concurrently between turns
        put_timeout=120,
    )
    service = Throttle(service_name, url, timeout=120)
    delay = args.service_ms / 1000

    def call_service(rows: Iterator[int]) -> Iterator[dict[str, Any]]:
        for n in rows:  # runs on an executor, holding a slot of the semaphore
            start = time.time()
            time.sleep(delay)  # the slow external service
            yield {"n": n, "square": n * n, "start": start, "end": time.time()}

    with SemaphoreAdmin(service_name, url=url) as admin:
        admin.ensure(args.slots)
    pipe.create(bound=args.bound)
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    consumer = spawn.Process(
        target=consume, args=(pipe.name, url, prefix, args.consumer_ms / 1000, results)
    )
    consumer.start()
    spark = (
        SparkSession.builder.master(args.master)
        .appName("amqp_locks-spark-pipeline")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    lengths: list[int] = []
    done = threading.Event()

    def sample_length() -> None:
        with pipe.queue() as q:
            while not done.wait(0.05):
                lengths.append(q.length())

    sampler = threading.Thread(target=sample_length, daemon=True)
    try:
        sampler.start()
        started = time.monotonic()
        rdd = spark.sparkContext.parallelize(range(args.rows), args.partitions)
        written = write_to_pipe(rdd.mapPartitions(service.wrap(call_service)), pipe)
        job_seconds = time.monotonic() - started
        done.set()
        sampler.join(10)
        report = results.get(timeout=300)
        consumer.join(30)
        stats = pipe.stats()
    finally:
        done.set()
        spark.stop()
        if consumer.is_alive():
            consumer.terminate()
        pipe.delete(timeout=30)
        with SemaphoreAdmin(service_name, url=url) as admin:
            admin.destroy()
    if "error" in report:
        print(f"the consumer failed: {report['error']}", file=sys.stderr)
        return 1

    # parallelize(range(n), k) gives partition p the rows p*n//k up to (p+1)*n//k.
    bounds = [p * args.rows // args.partitions for p in range(args.partitions + 1)]
    expected = {p: list(range(bounds[p], bounds[p + 1])) for p in range(args.partitions)}
    print(f"{written} rows from {args.partitions} partitions on {args.master}")
    print(f"  service: at most {report['max_concurrency']} calls at once (slots: {args.slots})")
    print(
        f"  throughput: {report['rows'] / max(report['seconds'], 1e-9):.1f} rows/s from the "
        f"first service call to the last row consumed ({report['seconds']:.2f} s; the job "
        f"took {job_seconds:.2f} s with Spark's start-up)"
    )
    full = sum(1 for n in lengths if n >= args.bound - 1)
    waited = " (the job waited for the consumer)" if full else ""
    print(
        f"  queue: at most {max(lengths, default=0)} rows waiting (bound {args.bound}); "
        f"full or nearly in {full} of {len(lengths)} samples{waited}"
    )
    print(f"  reader: {report['rows']} rows, {report['duplicates']} duplicates dropped")
    print(f"  stats: {stats}")

    failures = []
    if report["max_concurrency"] > args.slots:
        failures.append(f"{report['max_concurrency']} calls at once with {args.slots} slots")
    if report["partitions"] != {p: rows for p, rows in expected.items() if rows}:
        failures.append("rows lost, duplicated or out of order within a partition")
    if written != args.rows or report["rows"] != args.rows:
        failures.append(f"{written} rows written, {report['rows']} read, of {args.rows}")
    if max(lengths, default=0) > args.bound:
        failures.append(f"{max(lengths)} rows queued with a bound of {args.bound}")
    if stats["produced_messages"] != stats["consumed_messages"]:
        failures.append("produced and consumed counts differ")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    parser.add_argument("--url", help="broker URL (default: $AMQP_URL, else a private node)")
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--slots", type=int, default=2, help="concurrent service calls")
    parser.add_argument("--bound", type=int, default=4, help="rows the queue may hold")
    parser.add_argument("--rows-per-turn", type=int, default=3)
    parser.add_argument("--service-ms", type=float, default=20.0, help="per service call")
    parser.add_argument("--consumer-ms", type=float, default=50.0, help="per row consumed")
    args = parser.parse_args()
    url = args.url or os.environ.get("AMQP_URL")
    try:
        if url:
            return run(args, url)
        from amqp_locks.broker import LocalBroker

        print("starting a private RabbitMQ node (amqp_locks.broker.LocalBroker)…")
        with LocalBroker() as broker:
            return run(args, broker.url)
    except ImportError as exc:
        print(f"{exc}: pip install 'amqp-locks[spark]'", file=sys.stderr)
    except errors.AmqpLocksError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
