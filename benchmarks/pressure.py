#!/usr/bin/env python
"""Benchmark pressure queues against raw pika on the same broker, side by side, in one run.

One producer process and one consumer process, each on its own connection, move N items of
1 KiB through a queue; throughput is N over the time from the first put to the last get, and
each item's latency is the time from just before its put to just after its get (the body
carries the send time; both processes are on this machine).

* ``raw_pika``: the floor. A durable classic queue; the producer publishes persistent
  messages with publisher confirms (``BlockingChannel.confirm_delivery``: each publish waits
  for its confirm), the consumer consumes with manual acks (``basic_qos(128)``, one
  ``basic_ack`` per message). Unbounded: nothing stops the producer running ahead.
* ``pressure``: ``PressureQueue.create(bound=128)``; the producer holds the role with
  ``producing()`` and calls ``put()``, the consumer holds ``consuming()`` and calls ``get()``.
  Every put and get is a committed transaction (item, credit and stats together).
* ``pressure_oneshot``: ``q.put()`` / ``q.get()`` without holding the roles, so each call
  takes and gives back its role (a semaphore acquire and release) — fewer items.
* ``pressure_batch32``: roles held, ``put_many()`` of 32 items and ``get_many(32)``: one
  transaction per batch instead of per item (the same guarantees per item).

Variants run in interleaved rounds (raw, pressure, raw, pressure, ...); the table shows the
median of the rounds. Target: ``pressure_msgs_per_s`` at least half ``raw_pika_msgs_per_s``.

Usage::

    python benchmarks/pressure.py                    # private broker, about a minute
    python benchmarks/pressure.py --quick            # smoke run
    python benchmarks/pressure.py --url amqp://...   # or $AMQP_URL
    python benchmarks/pressure.py --json benchmarks/results-pressure.json --check
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import platform
import secrets
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.context import SpawnContext
from typing import Any

import pika
from _common import broker, percentile, progress, version_of

import amqp_locks
from amqp_locks import PressureQueue

log = logging.getLogger("bench")

ITEM_SIZE = 1024
BOUND = 128
RAW_PREFETCH = 128
BATCH = 32
TARGET_RATIO = 0.5
_STAMP = struct.Struct("!d")


def body(index: int) -> bytes:
    stamp = _STAMP.pack(time.time())
    return stamp + index.to_bytes(8, "big") + b"x" * (ITEM_SIZE - _STAMP.size - 8)


def latency_ms(item: bytes, now: float) -> float:
    return (now - _STAMP.unpack_from(item)[0]) * 1000.0


# -- workers (spawned processes) ---------------------------------------------------------------


def raw_producer(url: str, queue: str, n: int, start: Any, out: Any) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    props = pika.BasicProperties(delivery_mode=2)
    start.wait()
    t0 = time.time()
    for i in range(n):
        ch.basic_publish("", queue, body(i), props)
    out.put(("producer", t0, time.time(), []))
    conn.close()


def raw_consumer(url: str, queue: str, n: int, start: Any, out: Any) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=RAW_PREFETCH)
    lat: list[float] = []
    start.wait()
    t0 = time.time()
    for method, _props, item in ch.consume(queue, auto_ack=False):
        ch.basic_ack(method.delivery_tag)
        lat.append(latency_ms(item, time.time()))
        if len(lat) == n:
            break
    ch.cancel()
    out.put(("consumer", t0, time.time(), lat))
    conn.close()


def pressure_producer(
    url: str, name: str, prefix: str, n: int, mode: str, start: Any, out: Any
) -> None:
    with PressureQueue(name, url=url, prefix=prefix) as q:
        q.exists()  # connect before the clock starts
        start.wait()
        t0 = time.time()
        if mode == "batch":
            with q.producing() as p:
                for first in range(0, n, BATCH):
                    p.put_many([body(i) for i in range(first, min(first + BATCH, n))])
        elif mode == "oneshot":
            for i in range(n):
                q.put(body(i))
        else:
            with q.producing() as p:
                for i in range(n):
                    p.put(body(i))
        out.put(("producer", t0, time.time(), []))


def pressure_consumer(
    url: str, name: str, prefix: str, n: int, mode: str, start: Any, out: Any
) -> None:
    lat: list[float] = []
    with PressureQueue(name, url=url, prefix=prefix) as q:
        q.exists()
        start.wait()
        t0 = time.time()
        if mode == "batch":
            with q.consuming() as c:
                while len(lat) < n:
                    items = c.get_many(BATCH)
                    now = time.time()
                    lat.extend(latency_ms(item, now) for item in items)
        elif mode == "oneshot":
            for _ in range(n):
                lat.append(latency_ms(q.get(), time.time()))
        else:
            with q.consuming() as c:
                for _ in range(n):
                    lat.append(latency_ms(c.get(), time.time()))
        out.put(("consumer", t0, time.time(), lat))


# -- one round of one variant ------------------------------------------------------------------


def pair(
    ctx: SpawnContext,
    target_p: Callable[..., None],
    target_c: Callable[..., None],
    args: tuple[Any, ...],
    n: int,
) -> dict[str, float]:
    start = ctx.Event()
    out: Any = ctx.Queue()
    procs = [
        ctx.Process(target=target_p, args=(*args, start, out)),
        ctx.Process(target=target_c, args=(*args, start, out)),
    ]
    for p in procs:
        p.start()
    time.sleep(1.5)  # both connected and waiting
    start.set()
    results = {}
    for _ in procs:
        role, t0, t1, lat = out.get(timeout=600)
        results[role] = (t0, t1, lat)
    for p in procs:
        p.join(30)
        if p.exitcode != 0:
            raise RuntimeError(f"a benchmark worker failed (exit code {p.exitcode})")
    first = min(results["producer"][0], results["consumer"][0])
    elapsed = results["consumer"][1] - first
    lat = results["consumer"][2]
    return {
        "msgs_per_s": n / elapsed,
        "latency_median_ms": statistics.median(lat),
        "latency_p99_ms": percentile(lat, 99),
    }


def round_raw(ctx: SpawnContext, url: str, n: int) -> dict[str, float]:
    queue = f"bench-raw-{os.getpid()}-{secrets.token_hex(3)}"
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.queue_declare(queue, durable=True, arguments={"x-queue-type": "classic"})
    try:
        args = (url, queue, n)
        return pair(ctx, raw_producer, raw_consumer, args, n)
    finally:
        ch.queue_delete(queue)
        conn.close()


def round_pressure(ctx: SpawnContext, url: str, n: int, mode: str) -> dict[str, float]:
    prefix = f"bench-{os.getpid()}-{secrets.token_hex(3)}"
    name = "frames"
    with PressureQueue(name, url=url, prefix=prefix) as q:
        q.create(bound=BOUND)
        try:
            args = (url, name, prefix, n, mode)
            return pair(
                ctx,
                pressure_producer,
                pressure_consumer,
                args,
                n,
            )
        finally:
            q.delete(timeout=30)


# -- report ------------------------------------------------------------------------------------


def format_table(rows: dict[str, dict[str, float]], ratio: float) -> str:
    lines = [
        f"{'variant':<20} {'msgs/s':>10} {'median ms':>10} {'p99 ms':>9}",
        "-" * 52,
    ]
    for variant, m in rows.items():
        lines.append(
            f"{variant:<20} {m['msgs_per_s']:>10.0f} {m['latency_median_ms']:>10.3f} "
            f"{m['latency_p99_ms']:>9.3f}"
        )
    verdict = "pass" if ratio >= TARGET_RATIO else "FAIL"
    lines.append("")
    lines.append(f"pressure / raw_pika = {ratio:.2f}  (target >= {TARGET_RATIO:g})  {verdict}")
    return "\n".join(lines)


def median_of(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--url", help="broker URL (default: $AMQP_URL, else a private node)")
    parser.add_argument("--items", type=int, default=3000, help="items per round")
    parser.add_argument("--oneshot-items", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 round of 500 items")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 if the target is missed")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        args.items, args.oneshot_items, args.rounds = 500, 100, 1
    ctx = multiprocessing.get_context("spawn")
    runs: dict[str, list[dict[str, float]]] = {
        "raw_pika": [],
        "pressure": [],
        "pressure_batch32": [],
        "pressure_oneshot": [],
    }
    with broker(args.url) as (url, source):
        for r in range(args.rounds):
            progress(f"round {r + 1}/{args.rounds}")
            runs["raw_pika"].append(round_raw(ctx, url, args.items))
            runs["pressure"].append(round_pressure(ctx, url, args.items, "held"))
            runs["pressure_batch32"].append(round_pressure(ctx, url, args.items, "batch"))
            runs["pressure_oneshot"].append(round_pressure(ctx, url, args.oneshot_items, "oneshot"))
    rows = {variant: median_of(rounds) for variant, rounds in runs.items()}
    ratio = rows["pressure"]["msgs_per_s"] / rows["raw_pika"]["msgs_per_s"]
    print(format_table(rows, ratio))
    result = {
        "pressure_msgs_per_s": rows["pressure"]["msgs_per_s"],
        "raw_pika_msgs_per_s": rows["raw_pika"]["msgs_per_s"],
        "pressure_oneshot_msgs_per_s": rows["pressure_oneshot"]["msgs_per_s"],
        "pressure_batch32_msgs_per_s": rows["pressure_batch32"]["msgs_per_s"],
        "ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "passed": ratio >= TARGET_RATIO,
        "variants": rows,
        "rounds": runs,
        "settings": {
            "items": args.items,
            "oneshot_items": args.oneshot_items,
            "rounds": args.rounds,
            "item_bytes": ITEM_SIZE,
            "bound": BOUND,
            "raw_prefetch": RAW_PREFETCH,
            "batch": BATCH,
        },
        "environment": {
            "broker": source,
            "python": platform.python_version(),
            "amqp_locks": amqp_locks.__version__,
            "pika": version_of("pika"),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 1 if args.check and not result["passed"] else 0


if __name__ == "__main__":
    sys.exit(main())
