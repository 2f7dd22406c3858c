"""Helpers shared by the integration tests (the broker fixtures come from amqp_locks'
own pytest plugin, the one users get)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import pika
import pika.exceptions
import pytest
from helpers import existing_queues, semaphore_queues


@pytest.fixture
def queues_on_broker(rabbitmq_url: str) -> Callable[[Iterable[str]], set[str]]:
    return lambda queues: existing_queues(rabbitmq_url, queues)


@pytest.fixture
def purge_namespace(rabbitmq_url: str, amqp_namespace: str) -> Iterator[list[str]]:
    """Names appended to the yielded list are deleted with all their queues after the test."""
    bases: list[str] = []
    yield bases
    conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        for base in bases:
            for queue in semaphore_queues(base):
                ch = conn.channel()
                try:
                    ch.queue_delete(queue)
                    ch.close()
                except pika.exceptions.ChannelClosedByBroker:
                    pass
    finally:
        conn.close()
