#!/usr/bin/env python
"""Benchmark amqp_locks semaphores against the broker's own floor, side by side, in one run.

Measured (milliseconds, medians over many iterations after a warm-up):

* ``floor_declare_delete_ms``: raw pika (BlockingConnection): exclusive ``queue_declare``
  (``x-max-length: 0``) + ``queue_delete`` of the same queue -- the least any lock on
  exclusive queues can cost for a take-and-give-back.
* ``sync_acquire_release_ms`` / ``async_acquire_release_ms``: uncontended ``acquire()`` +
  ``release()`` on a 3-slot semaphore (sync API, then amqp_locks.aio inside ``asyncio.run``).
* ``uncontended_acquire_ms``: the acquire alone, same 3-slot semaphore (release untimed).
* ``scan64_acquire_ms``: the acquire alone of slot 64 of a 64-slot semaphore whose slots
  1..63 are held by another connection (release untimed).
* ``handoff_median_ms`` / ``handoff_p99_ms``: 8 worker processes contend for a 1-slot
  semaphore, each holding it ~2 ms; a handoff is the gap between one holder's release start
  and the next holder's acquire returning.
* ``collisions_per_handoff``: declare races lost (``lease.collisions``) per handoff.

The single-process metrics are measured in interleaved rounds (every metric once per round,
in a rotating order), so drift in machine load hits all of them alike.

Usage::

    python benchmarks/semaphore.py                      # private broker, ~1-2 min
    python benchmarks/semaphore.py --quick              # ~20 s smoke run
    python benchmarks/semaphore.py --url amqp://...     # or set $AMQP_URL
    python benchmarks/semaphore.py --json /tmp/bench.json --check
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import multiprocessing
import os
import platform
import queue
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue as MPQueue
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Barrier as MPBarrier
from typing import Any

import pika
from _common import broker, percentile, progress, summary, table, version_of

import amqp_locks
from amqp_locks import Semaphore, SemaphoreAdmin, redact_url
from amqp_locks.aio import Semaphore as ASemaphore

log = logging.getLogger("bench")

#: Queue arguments of the floor's declare: the same as the library's holder (B) queues.
FLOOR_ARGUMENTS: dict[str, Any] = {"x-max-length": 0}

#: Targets: metric -> (reference metric, allowed factor).
TARGETS: dict[str, tuple[str, float]] = {
    "sync_acquire_release_ms": ("floor_declare_delete_ms", 1.25),
    "async_acquire_release_ms": ("floor_declare_delete_ms", 1.25),
    "scan64_acquire_ms": ("uncontended_acquire_ms", 1.5),
    "handoff_median_ms": ("floor_declare_delete_ms", 2.0),
}

SHORT_NAMES: dict[str, str] = {
    "floor_declare_delete_ms": "floor",
    "uncontended_acquire_ms": "uncontended",
}

SCAN_SLOTS = 64
UNCONTENDED_SLOTS = 3


@dataclass(frozen=True)
class Sizes:
    """How much to measure."""

    iterations: int  # samples per single-process metric (split over the rounds)
    warmup: int  # untimed iterations per metric before the first round
    rounds: int  # interleaved rounds
    handoffs: int  # handoffs to run (the first handoff_warmup are discarded)
    handoff_warmup: int
    workers: int
    hold_ms: float
    handoff_deadline_s: float  # stop the handoff run after this long, whatever the count

    @property
    def per_round(self) -> int:
        return max(1, math.ceil(self.iterations / self.rounds))


DEFAULT_SIZES = Sizes(
    iterations=2000,
    warmup=200,
    rounds=6,
    handoffs=400,
    handoff_warmup=20,
    workers=8,
    hold_ms=2.0,
    handoff_deadline_s=90.0,
)
QUICK_SIZES = Sizes(
    iterations=300,
    warmup=40,
    rounds=2,
    handoffs=120,
    handoff_warmup=10,
    workers=8,
    hold_ms=2.0,
    handoff_deadline_s=30.0,
)


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Single-process measurements (each returns milliseconds per iteration)
# ---------------------------------------------------------------------------------------------


def time_floor(channel: Any, queue_name: str, n: int) -> list[float]:
    samples: list[float] = []
    for _ in range(n):
        start = time.perf_counter()
        channel.queue_declare(queue=queue_name, exclusive=True, arguments=FLOOR_ARGUMENTS)
        channel.queue_delete(queue=queue_name)
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def time_acquire_release(sem: Semaphore, n: int) -> list[float]:
    samples: list[float] = []
    for _ in range(n):
        start = time.perf_counter()
        lease = sem.acquire(timeout=5)
        lease.release()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def time_acquire_only(sem: Semaphore, n: int, expect_slot: int | None = None) -> list[float]:
    samples: list[float] = []
    for _ in range(n):
        start = time.perf_counter()
        lease = sem.acquire(timeout=5)
        elapsed = time.perf_counter() - start
        slot = lease.slot
        lease.release()
        if expect_slot is not None and slot != expect_slot:
            raise RuntimeError(f"expected to acquire slot {expect_slot}, got slot {slot}")
        samples.append(elapsed * 1e3)
    return samples


async def _async_acquire_release(
    url: str, name: str, namespace: str, warmup: int, n: int
) -> list[float]:
    sem = ASemaphore(name, url=url, namespace=namespace)
    try:
        for _ in range(warmup):
            lease = await sem.acquire(timeout=5)
            await lease.release()
        samples: list[float] = []
        for _ in range(n):
            start = time.perf_counter()
            lease = await sem.acquire(timeout=5)
            await lease.release()
            samples.append((time.perf_counter() - start) * 1e3)
        return samples
    finally:
        await sem.close()


def time_async_acquire_release(
    url: str, name: str, namespace: str, warmup: int, n: int
) -> list[float]:
    """One block in a fresh ``asyncio.run`` (and a fresh aio Semaphore, warmed up first)."""
    return asyncio.run(_async_acquire_release(url, name, namespace, warmup, n))


# ---------------------------------------------------------------------------------------------
# Handoff: worker processes contending for a one-slot semaphore
# ---------------------------------------------------------------------------------------------

# (acquired at, release started at, collisions, worker index), time.time() seconds
Record = tuple[float, float, int, int]


def handoff_worker(
    index: int,
    url: str,
    name: str,
    namespace: str,
    total: int,
    hold_s: float,
    deadline_s: float,
    barrier: MPBarrier,
    counter: Synchronized,  # type: ignore[type-arg]
    results: MPQueue[tuple[int, list[Record], str | None]],
) -> None:
    """Loop acquire / hold / release until ``total`` handoffs happened (or the deadline)."""
    records: list[Record] = []
    error: str | None = None
    sem = Semaphore(name, url=url, namespace=namespace)
    try:
        # Open the connection before the start line, so connecting is not measured.
        SemaphoreAdmin(name, connection=sem.connection, namespace=namespace).exists()
        barrier.wait(timeout=120)
        deadline = time.monotonic() + deadline_s
        while counter.value < total and time.monotonic() < deadline:
            lease = sem.acquire(timeout=30)
            acquired_at = time.time()
            time.sleep(hold_s)
            released_at = time.time()
            collisions = lease.collisions
            lease.release()
            with counter.get_lock():
                counter.value += 1
            records.append((acquired_at, released_at, collisions, index))
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(Exception):
            sem.close()
        results.put((index, records, error))


@dataclass
class HandoffResult:
    gaps_ms: list[float]
    #: The gaps split by whether the next holder is the process that just released.
    same_worker_gaps_ms: list[float]
    other_worker_gaps_ms: list[float]
    collisions: int
    acquisitions: int
    same_worker: int
    overlaps: int
    errors: list[str]
    elapsed_s: float


def run_handoff(url: str, name: str, namespace: str, sizes: Sizes) -> HandoffResult:
    ctx: SpawnContext = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(sizes.workers + 1)
    counter = ctx.Value("l", 0)
    results: MPQueue[tuple[int, list[Record], str | None]] = ctx.Queue()
    total = sizes.handoffs + sizes.handoff_warmup + 1
    procs: list[BaseProcess] = [
        ctx.Process(
            target=handoff_worker,
            args=(
                i,
                url,
                name,
                namespace,
                total,
                sizes.hold_ms / 1e3,
                sizes.handoff_deadline_s,
                barrier,
                counter,
                results,
            ),
            name=f"handoff-worker-{i}",
            daemon=True,
        )
        for i in range(sizes.workers)
    ]
    for proc in procs:
        proc.start()
    records: list[Record] = []
    errors: list[str] = []
    try:
        try:
            barrier.wait(timeout=120)
        except Exception:
            errors.append("workers did not reach the start line within 120 s")
        started = time.monotonic()
        pending = len(procs)
        collect_until = started + sizes.handoff_deadline_s + 60
        while pending:
            try:
                index, got, error = results.get(timeout=max(0.1, collect_until - time.monotonic()))
            except queue.Empty:
                errors.append(f"{pending} worker(s) did not report back")
                break
            pending -= 1
            records.extend(got)
            if error is not None:
                errors.append(f"worker {index}: {error}")
        elapsed = time.monotonic() - started
    finally:
        for proc in procs:
            proc.join(timeout=10)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        results.close()

    records.sort()
    acquisitions = len(records)
    gaps: list[float] = []
    same: list[float] = []
    other: list[float] = []
    collisions = overlaps = 0
    for i in range(1, len(records)):
        prev, cur = records[i - 1], records[i]
        gap_ms = (cur[0] - prev[1]) * 1e3
        if gap_ms < 0:
            overlaps += 1  # two holders at once: would be a mutual-exclusion bug
        # Skip the warm-up, and the overrun past `total`: once workers start leaving, only
        # blocked waiters are left and the handoffs are no longer like the steady state.
        if i <= sizes.handoff_warmup or i >= total:
            continue
        gaps.append(gap_ms)
        collisions += cur[2]
        (same if cur[3] == prev[3] else other).append(gap_ms)
    return HandoffResult(
        gaps_ms=gaps,
        same_worker_gaps_ms=same,
        other_worker_gaps_ms=other,
        collisions=collisions,
        acquisitions=acquisitions,
        same_worker=len(same),
        overlaps=overlaps,
        errors=errors,
        elapsed_s=elapsed,
    )


# ---------------------------------------------------------------------------------------------
# Environment and reporting
# ---------------------------------------------------------------------------------------------


def environment(url: str, source: str, connection: Any) -> dict[str, Any]:
    server: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        server = dict(connection._impl.server_properties or {})

    def text(value: Any) -> str | None:
        if isinstance(value, bytes):
            return value.decode(errors="replace")
        return None if value is None else str(value)

    affinity: int | None = None
    if hasattr(os, "sched_getaffinity"):
        affinity = len(os.sched_getaffinity(0))
    return {
        "rabbitmq": text(server.get("version")),
        "erlang": text(server.get("platform")),
        "broker": source,
        "url": redact_url(url),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "pika": version_of("pika"),
        "aio_pika": version_of("aio-pika"),
        "amqp_locks": amqp_locks.__version__,
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def evaluate(metrics: dict[str, float]) -> tuple[dict[str, float], dict[str, bool]]:
    ratios: dict[str, float] = {}
    passed: dict[str, bool] = {}
    for metric, (reference, factor) in TARGETS.items():
        ratio = metrics[metric] / metrics[reference] if metrics[reference] > 0 else math.inf
        ratios[f"{metric.removesuffix('_ms')}_vs_{SHORT_NAMES[reference]}"] = ratio
        passed[metric] = ratio <= factor
    return ratios, passed


def format_table(metrics: dict[str, float], passed: dict[str, bool]) -> str:
    rows: list[tuple[str, str, str, str, str]] = []
    for metric, value in metrics.items():
        shown = f"{value:.3f}" + (" ms" if metric.endswith("_ms") else "")
        if metric in TARGETS:
            reference, factor = TARGETS[metric]
            ratio = value / metrics[reference] if metrics[reference] > 0 else math.inf
            rows.append(
                (
                    metric,
                    shown,
                    f"<= {factor:g} x {SHORT_NAMES[reference]}",
                    f"{ratio:.2f}",
                    "pass" if passed[metric] else "FAIL",
                )
            )
        else:
            rows.append((metric, shown, "-", "-", "-"))
    return table(("metric", "value", "target", "ratio", "result"), rows, "<><><")


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark amqp_locks semaphores against raw pika declare+delete.",
    )
    parser.add_argument(
        "--url",
        help="AMQP URL of the broker (default: $AMQP_URL, else a private LocalBroker)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="a ~20 s smoke run")
    parser.add_argument("--iterations", type=int, help="samples per single-process metric")
    parser.add_argument("--warmup", type=int, help="untimed warm-up iterations per metric")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the metrics")
    parser.add_argument("--handoffs", type=int, help="handoffs measured")
    parser.add_argument("--workers", type=int, help="handoff worker processes (default 8)")
    parser.add_argument("--hold-ms", type=float, help="how long a handoff worker holds the slot")
    parser.add_argument(
        "--check", action="store_true", help="exit with status 1 if a target is missed"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    args = parser.parse_args(argv)
    for option in ("iterations", "rounds", "handoffs", "workers"):
        value = getattr(args, option)
        if value is not None and value < 1:
            parser.error(f"--{option} must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must not be negative")
    if args.hold_ms is not None and args.hold_ms < 0:
        parser.error("--hold-ms must not be negative")
    return args


def sizes_from(args: argparse.Namespace) -> Sizes:
    base = QUICK_SIZES if args.quick else DEFAULT_SIZES
    overrides = {
        key: value
        for key, value in (
            ("iterations", args.iterations),
            ("warmup", args.warmup),
            ("rounds", args.rounds),
            ("handoffs", args.handoffs),
            ("workers", args.workers),
            ("hold_ms", args.hold_ms),
        )
        if value is not None
    }
    return Sizes(**{**asdict(base), **overrides})


def run(url: str, source: str, sizes: Sizes) -> dict[str, Any]:
    namespace = f"bench-{os.getpid()}-{secrets.token_hex(3)}."
    names = {"small": "sem3", "scan": "sem64", "handoff": "mutex"}
    floor_queue = f"{namespace}floor"
    t_start = time.monotonic()

    with contextlib.ExitStack() as stack:
        floor_conn = pika.BlockingConnection(pika.URLParameters(url))
        stack.callback(floor_conn.close)
        floor_ch = floor_conn.channel()
        env = environment(url, source, floor_conn)

        admins: dict[str, SemaphoreAdmin] = {}
        for key, name in names.items():
            admin = SemaphoreAdmin(name, url=url, namespace=namespace)
            stack.callback(admin.close)
            admins[key] = admin
        # Registered after the closes, so it runs before them (ExitStack is LIFO), and after
        # every Semaphore below is closed (those are registered later still).
        for admin in admins.values():
            stack.callback(admin.destroy)
        admins["small"].create(UNCONTENDED_SLOTS)
        admins["scan"].create(SCAN_SLOTS)
        admins["handoff"].create(1)

        small = Semaphore(names["small"], url=url, namespace=namespace)
        stack.callback(small.close)
        scanner = Semaphore(names["scan"], url=url, namespace=namespace)
        stack.callback(scanner.close)
        holder = Semaphore(names["scan"], url=url, namespace=namespace)
        stack.callback(holder.close)

        progress(f"holding slots 1..{SCAN_SLOTS - 1} of the {SCAN_SLOTS}-slot semaphore")
        held = [holder.acquire(timeout=10) for _ in range(SCAN_SLOTS - 1)]
        if sorted(lease.slot for lease in held) != list(range(1, SCAN_SLOTS)):
            raise RuntimeError(f"holder got slots {sorted(lease.slot for lease in held)}")

        benches: dict[str, Callable[[int], list[float]]] = {
            "floor_declare_delete_ms": lambda n: time_floor(floor_ch, floor_queue, n),
            "sync_acquire_release_ms": lambda n: time_acquire_release(small, n),
            "async_acquire_release_ms": lambda n: time_async_acquire_release(
                url, names["small"], namespace, min(sizes.warmup, 50), n
            ),
            "uncontended_acquire_ms": lambda n: time_acquire_only(small, n),
            "scan64_acquire_ms": lambda n: time_acquire_only(scanner, n, SCAN_SLOTS),
        }
        progress(
            f"warm-up ({sizes.warmup} per metric), then {sizes.rounds} interleaved rounds of "
            f"{sizes.per_round} iterations per metric"
        )
        for name, bench in benches.items():
            if name != "async_acquire_release_ms":  # every async block warms up itself
                bench(sizes.warmup)
        samples: dict[str, list[float]] = {name: [] for name in benches}
        order = list(benches)
        for r in range(sizes.rounds):
            rotated = order[r % len(order) :] + order[: r % len(order)]
            for name in rotated:
                samples[name].extend(benches[name](sizes.per_round))
            progress(f"round {r + 1}/{sizes.rounds} done")
        for lease in held:
            lease.release()

        progress(
            f"handoff: {sizes.workers} spawned processes, 1-slot semaphore, "
            f"{sizes.handoffs} handoffs (+{sizes.handoff_warmup} warm-up), hold {sizes.hold_ms} ms"
        )
        handoff = run_handoff(url, names["handoff"], namespace, sizes)
        for error in handoff.errors:
            progress(f"handoff problem: {error}")
        if not handoff.gaps_ms:
            raise RuntimeError("the handoff run produced no handoffs: " + "; ".join(handoff.errors))

    metrics: dict[str, float] = {
        "floor_declare_delete_ms": statistics.median(samples["floor_declare_delete_ms"]),
        "sync_acquire_release_ms": statistics.median(samples["sync_acquire_release_ms"]),
        "async_acquire_release_ms": statistics.median(samples["async_acquire_release_ms"]),
        "uncontended_acquire_ms": statistics.median(samples["uncontended_acquire_ms"]),
        "scan64_acquire_ms": statistics.median(samples["scan64_acquire_ms"]),
        "handoff_median_ms": statistics.median(handoff.gaps_ms),
        "handoff_p99_ms": percentile(handoff.gaps_ms, 99),
        "collisions_per_handoff": handoff.collisions / len(handoff.gaps_ms),
    }
    ratios, passed = evaluate(metrics)
    details: dict[str, Any] = {name: summary(values) for name, values in samples.items()}
    details["handoff_gap_ms"] = summary(handoff.gaps_ms)
    return {
        **metrics,
        "ratios": ratios,
        "targets": {
            metric: {"reference": reference, "max_ratio": factor, "pass": passed[metric]}
            for metric, (reference, factor) in TARGETS.items()
        },
        "pass": passed,
        "all_pass": all(passed.values()),
        "iterations": {
            **{name: len(values) for name, values in samples.items()},
            "warmup_per_metric": sizes.warmup,
            "rounds": sizes.rounds,
            "handoffs": len(handoff.gaps_ms),
            "handoff_warmup": sizes.handoff_warmup,
            "handoff_acquisitions": handoff.acquisitions,
        },
        "handoff": {
            "workers": sizes.workers,
            "hold_ms": sizes.hold_ms,
            "collisions": handoff.collisions,
            "same_worker_reacquired": handoff.same_worker,
            "same_worker_median_ms": (
                statistics.median(handoff.same_worker_gaps_ms)
                if handoff.same_worker_gaps_ms
                else None
            ),
            "other_worker_handoffs": len(handoff.other_worker_gaps_ms),
            "other_worker_median_ms": (
                statistics.median(handoff.other_worker_gaps_ms)
                if handoff.other_worker_gaps_ms
                else None
            ),
            "gaps_over_100ms": sum(g > 100 for g in handoff.gaps_ms),
            "overlaps": handoff.overlaps,
            "errors": handoff.errors,
            "elapsed_s": handoff.elapsed_s,
        },
        "stats_ms": details,
        "sizes": asdict(sizes),
        "namespace": namespace,
        "environment": env,
        "run_seconds": time.monotonic() - t_start,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sizes = sizes_from(args)
    started = time.monotonic()
    with broker(args.url) as (url, source):
        result = run(url, source, sizes)
    result["total_seconds"] = time.monotonic() - started

    env = result["environment"]
    print()
    print(
        f"RabbitMQ {env['rabbitmq'] or '?'} ({env['broker']}), Python {env['python']}, "
        f"pika {env['pika']}, aio-pika {env['aio_pika']}, amqp_locks {env['amqp_locks']}, "
        f"{env['cpu_count']} CPUs ({env['cpus_usable']} usable), {env['platform']}"
    )
    if env["load_average"] is not None:
        print("load average at start: " + ", ".join(f"{x:.2f}" for x in env["load_average"]))
    counts = result["iterations"]
    print(
        f"{counts['floor_declare_delete_ms']} samples per single-process metric "
        f"({sizes.rounds} interleaved rounds, {sizes.warmup} warm-up); "
        f"{counts['handoffs']} handoffs among {sizes.workers} processes "
        f"(hold {sizes.hold_ms:g} ms); {result['total_seconds']:.0f} s in all"
    )
    print()
    ordered = [
        "floor_declare_delete_ms",
        "sync_acquire_release_ms",
        "async_acquire_release_ms",
        "uncontended_acquire_ms",
        "scan64_acquire_ms",
        "handoff_median_ms",
        "handoff_p99_ms",
        "collisions_per_handoff",
    ]
    metrics = {key: result[key] for key in ordered}
    print(format_table(metrics, result["pass"]))
    handoff = result["handoff"]

    def median_text(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} ms"

    print(
        f"\nhandoffs: {handoff['same_worker_reacquired']} re-acquired by the releasing process "
        f"(median {median_text(handoff['same_worker_median_ms'])}), "
        f"{handoff['other_worker_handoffs']} went to another process "
        f"(median {median_text(handoff['other_worker_median_ms'])})"
    )
    if handoff["overlaps"]:
        print(f"\nWARNING: {handoff['overlaps']} handoff(s) overlapped (two holders at once)")
    if handoff["errors"]:
        print("\nhandoff problems: " + "; ".join(handoff["errors"]))

    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2, sort_keys=False)
            fh.write("\n")
        print(f"\nwrote {args.json}")
    return 1 if args.check and not result["all_pass"] else 0


if __name__ == "__main__":
    sys.exit(main())
