#!/usr/bin/env python
"""Benchmark the per-task cost of amqp_locks.spark.Throttle in real PySpark jobs.

Each task runs the same tiny partition function (sum 100 rows), either plain or wrapped by
``Throttle.wrap``; a timing wrapper around it measures, inside the Python worker, how long the
partition took from first pull to exhaustion. With the throttle that includes the acquire,
the per-row lease checks, the verification at the end and the release; the semaphore has as
many slots as Spark runs tasks at once, so no task ever waits for a slot. Plain and throttled
jobs alternate, in the same Spark session and against the same broker.

Measured (milliseconds, medians over all tasks after a warm-up job):

* ``plain_task_ms``, ``throttled_task_ms``: the partition function's time in the worker.
* ``spark_throttle_overhead_ms``: throttled minus plain — what the throttle adds per task
  (target ≤ 10 ms). Python workers are reused (``spark.python.worker.reuse=true``), so the
  connection to the broker is already open.
* ``first_task_in_worker_ms``: median over workers of their first throttled task (it opens
  the worker's connection); measured in the warm-up.
* ``plain_job_ms_per_task``, ``throttled_job_ms_per_task``: job wall time / tasks, as the
  driver sees it (Spark's own scheduling cost dominates).

Usage::

    python benchmarks/spark.py                      # private broker, local[2], ~1 min
    python benchmarks/spark.py --quick              # a ~30 s smoke run
    python benchmarks/spark.py --url amqp://...     # or set $AMQP_URL
    python benchmarks/spark.py --json /tmp/spark.json --check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pika
from _common import broker, percentile, progress, summary, table, version_of

import amqp_locks
from amqp_locks import SemaphoreAdmin, redact_url
from amqp_locks.spark import Throttle

log = logging.getLogger("bench")

TARGET_OVERHEAD_MS = 10.0
ROWS_PER_TASK = 100


# ---------------------------------------------------------------------------------------------
# What the tasks run (shipped to the workers by value: this file is __main__)
# ---------------------------------------------------------------------------------------------


def add_up(rows: Iterator[int]) -> Iterator[int]:
    yield sum(rows)


def timed(
    fn: Callable[[Iterator[int]], Iterator[int]],
) -> Callable[[Iterator[int]], Iterator[tuple[int, float, int]]]:
    """A partition function that runs ``fn`` and yields (worker pid, its time in ms, result)."""

    def run(rows: Iterator[int]) -> Iterator[tuple[int, float, int]]:
        start = time.perf_counter()
        (total,) = fn(rows)
        yield os.getpid(), (time.perf_counter() - start) * 1e3, total

    return run


# ---------------------------------------------------------------------------------------------
# Environment and reporting
# ---------------------------------------------------------------------------------------------


def java_version() -> str | None:
    java = shutil.which("java")
    if java is None:
        return None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
        return (out.stderr or out.stdout).splitlines()[0].strip()
    return None


def environment(url: str, source: str, parallelism: int) -> dict[str, Any]:
    server: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        conn = pika.BlockingConnection(pika.URLParameters(url))
        server = dict(conn._impl.server_properties or {})
        conn.close()
    rabbitmq = server.get("version")
    return {
        "rabbitmq": rabbitmq.decode() if isinstance(rabbitmq, bytes) else rabbitmq,
        "broker": source,
        "url": redact_url(url),
        "master": f"local[{parallelism}]",
        "pyspark": version_of("pyspark"),
        "java": java_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "pika": version_of("pika"),
        "amqp_locks": amqp_locks.__version__,
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def format_table(metrics: dict[str, float], passed: bool) -> str:
    rows: list[tuple[str, str, str, str]] = []
    for metric, value in metrics.items():
        if metric == "spark_throttle_overhead_ms":
            target, result = f"<= {TARGET_OVERHEAD_MS:g} ms", "pass" if passed else "FAIL"
        else:
            target, result = "-", "-"
        rows.append((metric, f"{value:.3f} ms", target, result))
    return table(("metric", "value", "target", "result"), rows, "<><<")


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Per-task overhead of amqp_locks.spark.Throttle in PySpark (local mode).",
    )
    parser.add_argument(
        "--url", help="AMQP URL of the broker (default: $AMQP_URL, else a private LocalBroker)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="a ~30 s smoke run")
    parser.add_argument("--tasks", type=int, help="tasks per variant (default 1000; quick 200)")
    parser.add_argument("--rounds", type=int, help="alternating job pairs (default 10; quick 4)")
    parser.add_argument(
        "--parallelism", type=int, default=2, help="tasks Spark runs at once: local[N] (2)"
    )
    parser.add_argument(
        "--check", action="store_true", help="exit with status 1 if the target is missed"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does")
    args = parser.parse_args(argv)
    args.tasks = args.tasks or (200 if args.quick else 1000)
    args.rounds = args.rounds or (4 if args.quick else 10)
    for option in ("tasks", "rounds", "parallelism"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1")
    return args


def start_spark(parallelism: int) -> Any:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers need amqp_locks
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    session = (
        SparkSession.builder.master(f"local[{parallelism}]")
        .appName("amqp_locks-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.python.worker.reuse", "true")
        .config("spark.pyspark.python", os.environ["PYSPARK_PYTHON"])
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    return session


def run(url: str, source: str, args: argparse.Namespace) -> dict[str, Any]:
    namespace = f"bench-{os.getpid()}-{secrets.token_hex(3)}."
    parallelism = args.parallelism
    per_job = max(1, args.tasks // args.rounds)
    env = environment(url, source, parallelism)
    t_start = time.monotonic()
    with contextlib.ExitStack() as stack:
        admin = SemaphoreAdmin("spark-bench", url=url, namespace=namespace)
        stack.callback(admin.close)
        stack.callback(admin.destroy)
        admin.create(parallelism)  # as many slots as concurrent tasks: nobody ever waits

        progress(f"starting Spark local[{parallelism}] (Python worker reuse on)")
        spark = start_spark(parallelism)
        stack.callback(spark.stop)
        sc = spark.sparkContext
        throttle = Throttle("spark-bench", url, timeout=60, namespace=namespace)
        variants: dict[str, Callable[[Iterator[int]], Iterator[tuple[int, float, int]]]] = {
            "plain": timed(add_up),
            "throttled": timed(throttle.wrap(add_up)),
        }
        rows = ROWS_PER_TASK * per_job
        expected = sum(range(rows))

        def job(variant: str, partitions: int) -> tuple[list[tuple[int, float, int]], float]:
            data = sc.parallelize(range(ROWS_PER_TASK * partitions), partitions)
            started = time.perf_counter()
            out = data.mapPartitions(variants[variant]).collect()
            return out, (time.perf_counter() - started) * 1e3

        progress("warm-up: starting Python workers, opening their broker connections")
        warm, _ = job("throttled", 4 * parallelism)
        first_by_pid: dict[int, float] = {}
        for pid, ms, _total in warm:
            first_by_pid.setdefault(pid, ms)
        job("plain", 4 * parallelism)

        samples: dict[str, list[float]] = {"plain": [], "throttled": []}
        job_ms: dict[str, list[float]] = {"plain": [], "throttled": []}
        progress(f"{args.rounds} rounds of a plain and a throttled job, {per_job} tasks each")
        for r in range(args.rounds):
            order = ["plain", "throttled"] if r % 2 == 0 else ["throttled", "plain"]
            for variant in order:
                out, wall_ms = job(variant, per_job)
                if sum(total for _, _, total in out) != expected:
                    raise RuntimeError(f"{variant} job computed a wrong sum")
                samples[variant].extend(ms for _, ms, _ in out)
                job_ms[variant].append(wall_ms / per_job)
            progress(f"round {r + 1}/{args.rounds} done")
        if admin.held():
            raise RuntimeError(f"slots still held after the jobs: {admin.held()}")

    plain = statistics.median(samples["plain"])
    throttled = statistics.median(samples["throttled"])
    metrics = {
        "plain_task_ms": plain,
        "throttled_task_ms": throttled,
        "spark_throttle_overhead_ms": throttled - plain,
        "throttled_task_p90_ms": percentile(samples["throttled"], 90),
        "first_task_in_worker_ms": statistics.median(first_by_pid.values()),
        "plain_job_ms_per_task": statistics.median(job_ms["plain"]),
        "throttled_job_ms_per_task": statistics.median(job_ms["throttled"]),
    }
    passed = metrics["spark_throttle_overhead_ms"] <= TARGET_OVERHEAD_MS
    return {
        **metrics,
        "target_ms": TARGET_OVERHEAD_MS,
        "pass": passed,
        "tasks": {variant: len(values) for variant, values in samples.items()},
        "rounds": args.rounds,
        "tasks_per_job": per_job,
        "rows_per_task": ROWS_PER_TASK,
        "workers_seen_in_warmup": len(first_by_pid),
        "stats_ms": {variant: summary(values) for variant, values in samples.items()},
        "namespace": namespace,
        "environment": env,
        "run_seconds": time.monotonic() - t_start,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    started = time.monotonic()
    with broker(args.url) as (url, source):
        result = run(url, source, args)
    result["total_seconds"] = time.monotonic() - started

    env = result["environment"]
    print()
    print(
        f"RabbitMQ {env['rabbitmq'] or '?'} ({env['broker']}), PySpark {env['pyspark']} "
        f"{env['master']} ({env['java'] or 'java ?'}), Python {env['python']}, "
        f"amqp_locks {env['amqp_locks']}, {env['cpu_count']} CPUs"
    )
    if env["load_average"] is not None:
        print("load average at start: " + ", ".join(f"{x:.2f}" for x in env["load_average"]))
    print(
        f"{result['tasks']['throttled']} throttled and {result['tasks']['plain']} plain tasks "
        f"({result['rounds']} alternating rounds of {result['tasks_per_job']}-task jobs, "
        f"{ROWS_PER_TASK} rows each); {result['total_seconds']:.0f} s in all"
    )
    print()
    keys = [
        "plain_task_ms",
        "throttled_task_ms",
        "spark_throttle_overhead_ms",
        "throttled_task_p90_ms",
        "first_task_in_worker_ms",
        "plain_job_ms_per_task",
        "throttled_job_ms_per_task",
    ]
    print(format_table({key: result[key] for key in keys}, result["pass"]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")
        print(f"\nwrote {args.json}")
    return 1 if args.check and not result["pass"] else 0


if __name__ == "__main__":
    sys.exit(main())
