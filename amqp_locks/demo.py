"""A live demonstration: 8 worker processes share a semaphore that is resized under them;
then two producer processes feed a bounded pressure queue that one consumer process drains.

Run ``python -m amqp_locks.demo`` (or ``bash scripts/demo.sh``). With no ``--url`` and no
``$AMQP_URL`` it starts a private RabbitMQ node of its own and stops it afterwards. It uses
only the public API, so it doubles as an example.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import random
import secrets
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from . import PressureQueue, Semaphore, SemaphoreAdmin, errors
from .broker import LocalBroker, LocalBrokerError

__all__ = ["main", "run_demo"]

NAME = "demo"


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _worker(url: str, namespace: str, worker: int, events: Any, stop: Any) -> None:
    """Loop: acquire a slot, hold it a little, release; report every step to the parent."""
    rng = random.Random(worker)
    sem = Semaphore(NAME, url=url, namespace=namespace, heartbeat=5)
    try:
        while not stop.is_set():
            try:
                lease = sem.acquire(timeout=1)
            except errors.AcquireTimeoutError:
                continue
            except errors.SemaphoreNotFoundError:
                break
            events.put(("acquired", worker, lease.slot, time.time(), lease.waits))
            deadline = time.monotonic() + rng.uniform(0.2, 0.7)
            while time.monotonic() < deadline and lease.held and not stop.is_set():
                time.sleep(0.02)
            lost = not lease.held
            events.put(("released", worker, lease.slot, time.time(), int(lost)))
            lease.release()
            time.sleep(rng.uniform(0.0, 0.1))
    finally:
        sem.close()


PIPE = "demo-pipe"
PIPE_BOUND = 8
PIPE_ITEMS = 150


def _producer(url: str, prefix: str, producer: int, done: Any) -> None:
    """Put PIPE_ITEMS numbered items, a few at a time (each batch holds the producer role)."""
    with PressureQueue(PIPE, url=url, prefix=prefix, client_id=f"producer-{producer}") as q:
        i = 0
        while i < PIPE_ITEMS:
            with q.producing(timeout=30) as p:
                for _ in range(min(10, PIPE_ITEMS - i)):
                    p.put(f"{producer}:{i}".encode(), timeout=30)
                    i += 1
    done.put(producer)


def _consumer(url: str, prefix: str, out: Any) -> None:
    """Receive until the queue is closed and drained, a little slower than the producers."""
    got: list[str] = []
    with (
        PressureQueue(PIPE, url=url, prefix=prefix, client_id="consumer") as q,
        q.consuming(timeout=30) as c,
    ):
        while True:
            try:
                with c.receive(timeout=30) as item:
                    got.append(item.decode())
                    time.sleep(0.002)
            except errors.QueueClosedError:
                break
    out.put(got)


def _pressure_demo(url: str, prefix: str, ctx: Any) -> bool:
    """Two producers and one consumer share a bounded queue; check bound, order and stats."""
    _out("")
    _out(
        f"pressure queue {PIPE!r}, bound {PIPE_BOUND}: 2 producer processes x {PIPE_ITEMS} "
        "items, 1 consumer process"
    )
    q = PressureQueue(PIPE, url=url, prefix=prefix)
    q.create(bound=PIPE_BOUND)
    done, out = ctx.Queue(), ctx.Queue()
    producers = [ctx.Process(target=_producer, args=(url, prefix, i, done)) for i in (1, 2)]
    consumer = ctx.Process(target=_consumer, args=(url, prefix, out))
    for proc in (*producers, consumer):
        proc.start()
    longest = 0
    finished = 0
    deadline = time.monotonic() + 120
    try:
        while finished < 2 and time.monotonic() < deadline:
            longest = max(longest, q.length())
            with suppress(queue.Empty):
                done.get(timeout=0.01)
                finished += 1
        q.close(timeout=30)
        got: list[str] = out.get(timeout=60)
        stats = q.stats()
    finally:
        for proc in (*producers, consumer):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        with suppress(errors.AmqpLocksError):
            q.delete(timeout=10)
        q.disconnect()
    in_order = all(
        [int(x.split(":")[1]) for x in got if x.startswith(f"{p}:")] == list(range(PIPE_ITEMS))
        for p in (1, 2)
    )
    _out(f"  items received          {len(got)} of {2 * PIPE_ITEMS}")
    _out(f"  longest queue seen      {longest} (bound {PIPE_BOUND})")
    _out(f"  each producer in order  {'yes' if in_order else 'NO'}")
    _out(f"  stats                   {stats}")
    ok = (
        len(got) == 2 * PIPE_ITEMS
        and in_order
        and longest <= PIPE_BOUND
        and stats["produced_messages"] == stats["consumed_messages"] == 2 * PIPE_ITEMS
    )
    verdict = "held" if ok else "VIOLATED"
    _out(f"  invariant (bounded, FIFO per producer, nothing lost): {verdict}")
    return ok


@dataclass
class _Tally:
    holders: dict[int, int] = field(default_factory=dict)  # worker -> slot
    acquisitions: int = 0
    waits: int = 0
    lost: int = 0
    max_holders: int = 0
    max_by_phase: dict[str, int] = field(default_factory=dict)

    phases: list[tuple[float, str]] = field(default_factory=list)

    def phase_at(self, when: float) -> str:
        current = self.phases[0][1]
        for start, name in self.phases:
            if when >= start:
                current = name
        return current

    def apply(self, event: tuple[Any, ...]) -> None:
        kind, worker, slot, when, extra = event
        phase = self.phase_at(when)
        if kind == "acquired":
            clash = [w for w, s in self.holders.items() if s == slot]
            if clash:
                raise AssertionError(f"slot {slot} held by workers {clash} and {worker}")
            self.holders[worker] = slot
            self.acquisitions += 1
            self.waits += int(extra > 0)
            self.max_holders = max(self.max_holders, len(self.holders))
            self.max_by_phase[phase] = max(self.max_by_phase.get(phase, 0), len(self.holders))
        else:
            self.holders.pop(worker, None)
            self.lost += int(extra)


@contextmanager
def _broker(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    _out("starting a private RabbitMQ node (amqp_locks.broker.LocalBroker)…")
    with LocalBroker() as broker:
        _out(f"  node {broker.node_name} at {broker.url}")
        yield broker.url


def _show(tally: _Tally, slots: int, phase: str, live: bool) -> None:
    by_slot = {s: w for w, s in tally.holders.items()}
    top = max([slots, *by_slot])
    cells = []
    for k in range(1, top + 1):
        who = f"w{by_slot[k]}" if k in by_slot else "--"
        cells.append(f"[{k}:{who}]" if k <= slots else f"({k}:{who})")
    line = f"{phase:<22} {' '.join(cells):<48} holders={len(by_slot)}/{slots}"
    if live:
        sys.stdout.write("\r" + line)
        sys.stdout.flush()
    else:
        _out(line)


def run_demo(url: str | None = None, *, workers: int = 8, phase_seconds: float = 4.0) -> int:
    """Run the demo; return a process exit code (0: the invariant held throughout)."""
    namespace = f"amqp-locks-demo-{secrets.token_hex(3)}."
    ctx = multiprocessing.get_context("spawn")
    live = sys.stdout.isatty()
    with _broker(url or os.environ.get("AMQP_URL")) as broker_url:
        admin = SemaphoreAdmin(NAME, url=broker_url, namespace=namespace)
        admin.create(3)
        _out(f"created semaphore {namespace}{NAME!r} with 3 slots; starting {workers} workers")
        _out("  [k:wN] = worker N holds slot k;  (k:wN) = holds a removed slot")
        events = ctx.Queue()
        stop = ctx.Event()
        procs = [
            ctx.Process(target=_worker, args=(broker_url, namespace, i, events, stop))
            for i in range(1, workers + 1)
        ]
        for proc in procs:
            proc.start()
        tally = _Tally()
        slots = 3
        phase = "3 slots"
        tally.phases.append((0.0, phase))

        def drain() -> None:
            while True:
                try:
                    tally.apply(events.get_nowait())
                except queue.Empty:
                    return

        def pump(seconds: float) -> None:
            # What happened while we were busy resizing is shown before anything new.
            drain()
            end = time.monotonic() + seconds
            last = 0.0
            while time.monotonic() < end:
                with suppress(queue.Empty):
                    tally.apply(events.get(timeout=0.05))
                if time.monotonic() - last > (0.1 if live else 1.0):
                    _show(tally, slots, phase, live)
                    last = time.monotonic()

        try:
            pump(phase_seconds + 3.0)  # the workers' interpreters take a moment to start
            slots, phase = admin.resize(5), "resized to 5"
            tally.phases.append((time.time(), phase))
            if live:
                _out()
            pump(phase_seconds)
            if live:
                _out()
            _out("resizing to 2 and waiting for the holders of slots 3-5 to let go…")
            phase = "shrinking to 2"
            tally.phases.append((time.time(), phase))
            slots = admin.resize(2, wait=True, timeout=30)
            phase = "resized to 2"
            # Holders of removed slots may run until they let go; from here on, none may.
            tally.phases.append((time.time(), phase))
            pump(phase_seconds)
        finally:
            stop.set()
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
            drain()
            admin.destroy()
            admin.close()
        if live:
            _out()
        _out("")
        _out("summary")
        _out(f"  acquisitions            {tally.acquisitions}")
        _out(f"  acquisitions that waited {tally.waits}")
        _out(f"  leases lost to a resize {tally.lost}")
        for name, count in tally.max_by_phase.items():
            _out(f"  max simultaneous holders, {name:<13} {count}")
        ok = (
            tally.max_by_phase.get("3 slots", 0) <= 3
            and tally.max_by_phase.get("resized to 2", 0) <= 2
        )
        _out(
            "  invariant (never more holders than slots, never two per slot): "
            + ("held" if ok else "VIOLATED")
        )
        piped = _pressure_demo(broker_url, namespace.rstrip("."), ctx)
        return 0 if ok and piped and tally.acquisitions > 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m amqp_locks.demo", description=__doc__)
    parser.add_argument("--url", help="broker URL (default: $AMQP_URL, else a private node)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--phase-seconds", type=float, default=4.0)
    args = parser.parse_args(argv)
    try:
        return run_demo(args.url, workers=args.workers, phase_seconds=args.phase_seconds)
    except (LocalBrokerError, errors.AmqpLocksError) as exc:
        sys.stderr.write(f"demo: {exc}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
