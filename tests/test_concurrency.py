"""Concurrency and failure-injection tests on a real broker, with real processes.

Child processes are started with the ``spawn`` multiprocessing context and run the functions
of ``tests/_workers.py``; they report through JSON files in ``tmp_path``. Every child is
killed (after a SIGCONT, in case it is stopped) and reaped in a ``finally``, every wait has a
deadline, and every test has a pytest-timeout, so no test can hang.

Intervals from different processes are compared on ``time.time()`` of one machine.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import _workers
import pytest
from processes import SPAWN, children, join_all, read_json, start, wait_paths

from amqp_locks import Connection, Lease, Semaphore, SemaphoreAdmin, errors

# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def poll_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def check_intervals(records: list[tuple[int, float, float]], slots: int) -> int:
    """Assert no slot had two holders at once and never more than ``slots`` holders.

    Returns the largest number of intervals that overlapped.
    """
    by_slot: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for slot, t0, t1 in records:
        assert t0 <= t1
        by_slot[slot].append((t0, t1))
    assert set(by_slot) <= set(range(1, slots + 1)), f"slots out of range: {sorted(by_slot)}"
    for slot, intervals in by_slot.items():
        intervals.sort()
        for (a0, a1), (b0, b1) in pairwise(intervals):
            assert b0 >= a1, (
                f"slot {slot} held twice at once: [{a0:.6f}, {a1:.6f}] and [{b0:.6f}, {b1:.6f}]"
            )
    peak, when = max_overlap(records)
    assert peak <= slots, f"{peak} holders of a {slots}-slot semaphore at t={when:.6f}"
    return peak


def max_overlap(records: list[tuple[int, float, float]]) -> tuple[int, float]:
    """The largest number of intervals open at once, and when (ends sort before starts)."""
    events = sorted([(t0, 1) for _, t0, _ in records] + [(t1, -1) for _, _, t1 in records])
    now = peak = 0
    when = 0.0
    for t, delta in events:
        now += delta
        if now > peak:
            peak, when = now, t
    return peak, when


def test_interval_checker_catches_overlaps() -> None:
    """The checker the tests below rely on is not vacuous."""
    assert check_intervals([(1, 0.0, 1.0), (1, 1.0, 2.0), (2, 0.5, 1.5)], 2) == 2
    with pytest.raises(AssertionError, match="slot 1 held twice"):
        check_intervals([(1, 0.0, 1.0), (1, 0.9, 2.0)], 2)
    assert check_intervals([(1, 0.0, 1.0), (2, 0.1, 1.0), (3, 0.2, 1.0)], 3) == 3
    assert max_overlap([(1, 0.0, 1.0), (2, 0.1, 1.0), (3, 0.2, 1.0), (1, 1.0, 2.0)]) == (3, 0.2)
    assert max_overlap([(1, 0.0, 1.0), (1, 1.0, 2.0)]) == (1, 0.0)
    with pytest.raises(AssertionError, match="out of range"):
        check_intervals([(3, 0.0, 1.0)], 2)


@pytest.fixture
def make_admin(rabbitmq_url: str, amqp_namespace: str) -> Iterator[Callable[..., SemaphoreAdmin]]:
    """``make_admin(name, slots)``: a created semaphore's admin; destroyed after the test."""
    made: list[SemaphoreAdmin] = []

    def make(name: str, slots: int | None = None, url: str | None = None) -> SemaphoreAdmin:
        admin = SemaphoreAdmin(name, url=url or rabbitmq_url, namespace=amqp_namespace)
        made.append(admin)
        if slots is not None:
            admin.ensure(slots)
        return admin

    yield make
    for admin in made:
        with contextlib.suppress(Exception):
            admin.destroy()
        admin.close()


# ------------------------------------------------------------------------------------------
# 1. many processes, few slots
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_processes_never_overlap_on_a_slot_and_never_exceed_the_count(
    rabbitmq_url: str,
    amqp_namespace: str,
    make_admin: Callable[..., SemaphoreAdmin],
    tmp_path: Path,
) -> None:
    workers, rounds, slots = 16, 25, 3
    make_admin("churn", slots)
    go = SPAWN.Event()
    outs = [tmp_path / f"churn-{i}.json" for i in range(workers)]
    with children() as procs:
        for i, out in enumerate(outs):
            start(
                procs,
                _workers.churn,
                rabbitmq_url,
                amqp_namespace,
                "churn",
                rounds,
                go,
                str(out),
                i,
            )
        time.sleep(0.5)  # let most of them connect, so they start contending together
        go.set()
        join_all(procs, 120)
        reports = [read_json(out) for out in outs]

    errors_seen = [e for r in reports for e in r["errors"]]
    assert not errors_seen, errors_seen[0].get("traceback") or errors_seen
    records = [rec for r in reports for rec in r["records"]]
    assert len(records) == workers * rounds  # every acquisition finished, none timed out
    lost = [rec for rec in records if not rec[4]]
    assert not lost, f"leases lost while held: {lost[:5]}"
    peak = check_intervals([(s, t0, t1) for s, t0, t1, *_ in records], slots)
    print(f"collisions: {sum(rec[3] for rec in records)} over {len(records)} acquisitions")
    assert peak == slots  # sanity: there was real contention
    assert {rec[0] for rec in records} == set(range(1, slots + 1))


# ------------------------------------------------------------------------------------------
# 2. a SIGKILLed holder frees its slot at once
# ------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_sigkilled_holder_frees_the_slot_within_a_second(
    rabbitmq_url: str,
    amqp_namespace: str,
    make_admin: Callable[..., SemaphoreAdmin],
    tmp_path: Path,
) -> None:
    make_admin("killed", 1)
    ready, proceed, out = tmp_path / "ready", tmp_path / "proceed", tmp_path / "out.json"
    sem = Semaphore("killed", url=rabbitmq_url, namespace=amqp_namespace)
    try:
        with children() as procs:
            holder = start(
                procs,
                _workers.hold,
                rabbitmq_url,
                amqp_namespace,
                "killed",
                10,
                str(ready),
                str(proceed),
                str(out),
            )
            wait_paths([ready], 30, procs)
            assert sem.try_acquire() is None  # the child holds the only slot

            holder.kill()  # SIGKILL
            killed_at = time.monotonic()
            lease: Lease | None = None
            while lease is None and time.monotonic() - killed_at < 5:
                lease = sem.try_acquire()
                if lease is None:
                    time.sleep(0.02)
            elapsed = time.monotonic() - killed_at
            assert lease is not None, "slot still held 5 s after its holder was SIGKILLed"
            print(f"slot free {elapsed * 1000:.0f} ms after SIGKILL")
            assert elapsed < 1.0, f"slot freed {elapsed:.3f} s after SIGKILL"
            assert lease.slot == 1 and lease.verify()
            lease.release()
    finally:
        sem.close()


# ------------------------------------------------------------------------------------------
# 3. a frozen (SIGSTOPped) holder loses its slot after missed heartbeats, and learns it
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_frozen_holder_loses_the_slot_and_learns_it_after_sigcont(
    rabbitmq_url: str,
    amqp_namespace: str,
    make_admin: Callable[..., SemaphoreAdmin],
    tmp_path: Path,
) -> None:
    heartbeat = 2
    make_admin("frozen", 1)
    ready, proceed, out = tmp_path / "ready", tmp_path / "proceed", tmp_path / "out.json"
    sem = Semaphore("frozen", url=rabbitmq_url, namespace=amqp_namespace)
    try:
        with children() as procs:
            holder = start(
                procs,
                _workers.hold,
                rabbitmq_url,
                amqp_namespace,
                "frozen",
                heartbeat,
                str(ready),
                str(proceed),
                str(out),
            )
            wait_paths([ready], 30, procs)
            assert sem.try_acquire() is None

            os.kill(holder.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            lease: Lease | None = None
            while lease is None and time.monotonic() - stopped_at < 15:
                lease = sem.try_acquire()
                if lease is None:
                    time.sleep(0.1)
            took_over = time.monotonic() - stopped_at
            assert lease is not None, "frozen holder still held the slot after 15 s"
            print(f"slot taken over {took_over:.2f} s after SIGSTOP")
            # Not before the broker could have missed a heartbeat, either.
            assert took_over > heartbeat * 0.5, f"slot taken only {took_over:.2f} s after SIGSTOP"

            os.kill(holder.pid, signal.SIGCONT)
            _workers.touch(proceed)
            join_all([holder], 30)
            report = read_json(out)
            assert "error" not in report, report["error"]["traceback"]
            assert report["proceed_seen"]
            assert report["lost"] is True and report["held"] is False, report
            assert report["lost_reason"], report
            assert report["verify"] is False
            assert report["raised"] == "LockLostError", report
            assert report["on_lost_fired_at"], "on_lost never fired in the frozen holder"
            # Our lease is unaffected by the old holder waking up.
            assert lease.held and lease.verify()
            lease.release()
    finally:
        sem.close()


# ------------------------------------------------------------------------------------------
# 4. broker restart: slots persist, leases are lost (and told so), acquiring works again
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.private_broker
@pytest.mark.timeout(150)
def test_broker_restart_keeps_slots_and_marks_leases_lost(
    local_broker: Any, amqp_namespace: str, make_admin: Callable[..., SemaphoreAdmin]
) -> None:
    url = local_broker.url
    make_admin("restart", 4, url=url)
    fired: list[tuple[int, float]] = []
    lock = threading.Lock()

    def on_lost(lease: Lease) -> None:
        with lock:
            fired.append((lease.slot, time.monotonic()))

    conn = Connection(url, heartbeat=2)
    sem = Semaphore("restart", connection=conn, namespace=amqp_namespace)
    try:
        leases = [sem.acquire(timeout=10, on_lost=on_lost) for _ in range(2)]
        assert sorted(lease.slot for lease in leases) == [1, 2]
        assert all(lease.held for lease in leases)

        local_broker.restart()
        restarted_at = time.monotonic()

        assert poll_until(lambda: len(fired) == 2 and not any(x.held for x in leases), 10), (
            f"after the restart: held={[x.held for x in leases]}, on_lost fired for {fired}"
        )
        assert sorted(slot for slot, _ in fired) == [1, 2]
        for lease in leases:
            assert lease.lost and lease.lost_reason
            assert not lease.verify()
        with pytest.raises(errors.LockLostError), leases[0]:
            pass
        leases[1].release()  # no-op for a lost lease, must not raise

        with SemaphoreAdmin("restart", url=url, namespace=amqp_namespace) as fresh:
            assert fresh.slots() == 4
            assert fresh.held() == []

        # A new acquire (the shared Connection reconnects) works, and takes a real slot.
        lease = sem.acquire(timeout=10)
        assert lease.slot == 1 and lease.held and lease.verify()
        other = Semaphore("restart", url=url, namespace=amqp_namespace)
        try:
            got = [other.try_acquire() for _ in range(4)]
            assert sorted(x.slot for x in got if x is not None) == [2, 3, 4]
            assert got[-1] is None
        finally:
            other.close()
        lease.release()
        assert time.monotonic() - restarted_at < 60
    finally:
        conn.close()


# ------------------------------------------------------------------------------------------
# 5. concurrent administrators keep the A queues contiguous
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_concurrent_admins_leave_contiguous_slot_queues(
    rabbitmq_url: str,
    amqp_namespace: str,
    make_admin: Callable[..., SemaphoreAdmin],
    tmp_path: Path,
) -> None:
    admins, ops = 8, 10
    admin = make_admin("admins", 3)
    go = SPAWN.Event()
    outs = [tmp_path / f"admin-{i}.json" for i in range(admins)]
    with children() as procs:
        for i, out in enumerate(outs):
            start(
                procs,
                _workers.admin_churn,
                rabbitmq_url,
                amqp_namespace,
                "admins",
                ops,
                go,
                str(out),
                1000 + i,
            )
        time.sleep(0.5)
        go.set()
        join_all(procs, 120)
        reports = [read_json(out) for out in outs]

    errors_seen = [e for r in reports for e in r["errors"]]
    assert not errors_seen, errors_seen[0].get("traceback") or errors_seen
    log = [entry for r in reports for entry in r["log"]]
    assert len(log) == admins * ops
    succeeded = [entry for entry in log if entry[3] is None]
    assert len(succeeded) >= admins * ops // 2, log
    highest = max([3, *(entry[2] for entry in succeeded)])

    count = admin.slots()
    base = f"{amqp_namespace}admins"
    present = _workers.existing_slot_queues(rabbitmq_url, base, max(40, highest + 20))
    assert present == list(range(1, count + 1)), (
        f"A queues {present} but slots() == {count}; operations: {log}"
    )


# ------------------------------------------------------------------------------------------
# 6. threads sharing one Connection
# ------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_threads_sharing_a_connection_never_share_a_slot(
    rabbitmq_url: str, amqp_namespace: str, make_admin: Callable[..., SemaphoreAdmin]
) -> None:
    threads, rounds, slots = 8, 30, 2
    make_admin("threads", slots)
    records: list[tuple[int, float, float]] = []
    failures: list[BaseException] = []
    lost: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(threads)

    with Connection(rabbitmq_url) as conn:
        sem = Semaphore("threads", connection=conn, namespace=amqp_namespace)

        def work(seed: int) -> None:
            rng = random.Random(seed)
            try:
                barrier.wait(10)
                for _ in range(rounds):
                    lease = sem.acquire(timeout=60)
                    t0 = time.monotonic()
                    time.sleep(rng.uniform(0.0005, 0.003))
                    held = lease.held
                    t1 = time.monotonic()
                    lease.release()
                    with lock:
                        records.append((lease.slot, t0, t1))
                        if not held:
                            lost.append(lease.slot)
            except BaseException as exc:
                with lock:
                    failures.append(exc)

        pool = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(90)
        assert not any(t.is_alive() for t in pool), "worker threads hung"

    assert not failures, repr(failures[0])
    assert not lost
    assert len(records) == threads * rounds
    assert check_intervals(records, slots) == slots


# ------------------------------------------------------------------------------------------
# 7. a long hold in the sync API keeps the slot (heartbeats flow from the I/O thread)
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_long_hold_without_library_calls_keeps_the_slot(
    rabbitmq_url: str,
    amqp_namespace: str,
    make_admin: Callable[..., SemaphoreAdmin],
    tmp_path: Path,
) -> None:
    heartbeat, hold = 2, 7.0
    make_admin("long", 1)
    ready, stop, out = tmp_path / "ready", tmp_path / "stop", tmp_path / "out.json"
    sem = Semaphore("long", url=rabbitmq_url, namespace=amqp_namespace, heartbeat=heartbeat)
    try:
        with children() as procs:
            lease = sem.acquire(timeout=10)
            prober = start(
                procs,
                _workers.probe_while_held,
                rabbitmq_url,
                amqp_namespace,
                "long",
                str(ready),
                str(stop),
                str(out),
            )
            wait_paths([ready], 30, procs)
            sleep_from = time.time()
            time.sleep(hold)  # no library calls: only the I/O thread keeps the connection alive
            sleep_to = time.time()
            assert lease.verify() is True
            assert lease.held is True and not lease.lost
            _workers.touch(stop)
            join_all([prober], 30)
            report = read_json(out)
            lease.release()
    finally:
        sem.close()

    assert "error" not in report, report["error"]["traceback"]
    probes = [p for p in report["probes"] if sleep_from <= p[0] <= sleep_to]
    assert len(probes) >= 10, report["probes"]
    assert any(p[0] > sleep_from + 2 * heartbeat + 0.5 for p in probes)  # past 2 heartbeats
    assert not [p for p in report["probes"] if p[1]], "another process got the held slot"


# ------------------------------------------------------------------------------------------
# 8. thundering herd: one release wakes one waiter; every waiter gets its turn
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_release_hands_off_to_one_waiter_without_a_herd(
    rabbitmq_url: str,
    amqp_namespace: str,
    make_admin: Callable[..., SemaphoreAdmin],
    tmp_path: Path,
) -> None:
    waiters = 8
    make_admin("herd", 1)
    readies = [tmp_path / f"ready-{i}" for i in range(waiters)]
    outs = [tmp_path / f"out-{i}.json" for i in range(waiters)]
    sem = Semaphore("herd", url=rabbitmq_url, namespace=amqp_namespace)
    try:
        with children() as procs:
            lease = sem.acquire(timeout=10)
            for ready, out in zip(readies, outs):
                start(
                    procs,
                    _workers.wait_once,
                    rabbitmq_url,
                    amqp_namespace,
                    "herd",
                    str(ready),
                    str(out),
                )
            wait_paths(readies, 60, procs)
            time.sleep(2.0)  # every waiter is now blocked in acquire (past its first scan)
            released_at = time.time()
            lease.release()
            join_all(procs, 60)
            reports = [read_json(out) for out in outs]
    finally:
        sem.close()

    failed = [r for r in reports if "error" in r]
    assert not failed, failed[0]["error"]["traceback"]
    assert all(r["slot"] == 1 and r["held"] for r in reports)
    # Every waiter really blocked (lease.waits, where the library reports it).
    assert all(r["waits"] is None or r["waits"] >= 1 for r in reports), reports
    reports.sort(key=lambda r: r["t_acquired"])
    check_intervals([(1, r["t_acquired"], r["t_release"]) for r in reports], 1)
    collisions = sum(r["collisions"] for r in reports)
    print("collisions", [r["collisions"] for r in reports], "waits", [r["waits"] for r in reports])
    assert collisions / waiters <= 2, [r["collisions"] for r in reports]
    # Hand-off latencies: from a release to the next holder's acquire.
    ends = [released_at, *(r["t_release"] for r in reports[:-1])]
    gaps = [r["t_acquired"] - end for r, end in zip(reports, ends)]
    print("hand-off gaps (s)", [round(g, 4) for g in gaps])
    assert statistics.median(gaps) < 0.5, f"hand-offs took {[round(g, 3) for g in gaps]} s"
