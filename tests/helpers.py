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
