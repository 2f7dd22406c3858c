"""Independent checks of what is on the broker, for the integration tests."""

from __future__ import annotations

from collections.abc import Iterable

import pika
import pika.exceptions


def existing_queues(url: str, queues: Iterable[str]) -> set[str]:
    """Which of ``queues`` exist, by confirmed mandatory publishes (an independent check,
    not the library's own probe code)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        found = set()
        for queue in queues:
            try:
                ch.basic_publish("", queue, b"", mandatory=True)
            except pika.exceptions.UnroutableError:
                continue
            found.add(queue)
        return found
    finally:
        conn.close()


def semaphore_queues(base: str, upto: int = 40) -> list[str]:
    """Every queue name a semaphore with base name ``base`` may use, slots 1..upto."""
    names = [base, f"{base}-0-W"]
    for k in range(1, upto + 1):
        names += [f"{base}-{k}-A", f"{base}-{k}-B"]
    return names


def slot_queues_present(url: str, base: str, upto: int = 40) -> list[int]:
    found = existing_queues(url, [f"{base}-{k}-A" for k in range(1, upto + 1)])
    return [k for k in range(1, upto + 1) if f"{base}-{k}-A" in found]


# -- pressure queues ---------------------------------------------------------------------------


def pressure_queues(base: str) -> list[str]:
    """Every queue name a pressure queue with prefixed name ``base`` may use (its data, credit,
    record, attempts, dead-letter and lock queues, and the queues of its two role mutexes)."""
    names = [
        base,
        f"{base}:bound",
        f"{base}:space",
        f"{base}:stats:produced",
        f"{base}:stats:consumed",
        f"{base}:stats:credited",
        f"{base}:stats:producing",
        f"{base}:stats:consuming",
        f"{base}:attempts",
        f"{base}:dead",
        f"{base}:lock",
    ]
    for role in ("producer", "consumer"):
        names += semaphore_queues(f"{base}:{role}", upto=2)
    return names


def declared_queues(url: str, queues: Iterable[str]) -> dict[str, tuple[int, int] | None]:
    """Which of ``queues`` exist, by passive declares (non-destructive, unlike
    :func:`existing_queues`, whose probes add a message to every queue they find).

    Maps each existing queue to ``(ready messages, consumers)``; a queue held exclusively by
    another connection (405 RESOURCE_LOCKED) exists but cannot be inspected: ``None``.
    """
    conn = pika.BlockingConnection(pika.URLParameters(url))
    found: dict[str, tuple[int, int] | None] = {}
    try:
        ch = conn.channel()
        for queue in queues:
            try:
                frame = ch.queue_declare(queue, passive=True)
            except pika.exceptions.ChannelClosedByBroker as exc:
                ch = conn.channel()
                if exc.reply_code == 405:
                    found[queue] = None
                elif exc.reply_code != 404:
                    raise
                continue
            found[queue] = (frame.method.message_count, frame.method.consumer_count)
        return found
    finally:
        conn.close()


def queue_info(url: str, queue: str) -> tuple[int, int]:
    """(ready messages, consumers) of ``queue``, by a passive declare over pika."""
    info = declared_queues(url, [queue]).get(queue)
    assert info is not None, f"{queue} missing (or exclusive to another connection)"
    return info


def credits(url: str, base: str) -> int:
    """Ready credits in the credit queue of the pressure queue ``base``."""
    return queue_info(url, f"{base}:space")[0]


def assert_pressure_gone(url: str, base: str) -> None:
    """No queue of the pressure queue ``base`` is left on the broker."""
    left = existing_queues(url, pressure_queues(base))
    assert not left, f"queues left on the broker: {sorted(left)}"


def expected_stats(produced: list[bytes], consumed: list[bytes]) -> dict[str, int]:
    """``PressureQueue.stats()`` after putting ``produced`` and taking ``consumed``."""
    return {
        "produced_messages": len(produced),
        "produced_bytes": sum(map(len, produced)),
        "consumed_messages": len(consumed),
        "consumed_bytes": sum(map(len, consumed)),
    }
