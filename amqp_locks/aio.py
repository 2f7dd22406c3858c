"""amqp_locks for asyncio (aio-pika): the same classes as :mod:`amqp_locks`, awaitable.

::

    from amqp_locks.aio import Semaphore, SemaphoreAdmin

    async with SemaphoreAdmin("reports", url=url) as admin:
        await admin.ensure(3)
    sem = Semaphore("reports", url=url)
    async with sem.acquire(timeout=5) as lease:
        ...
    await sem.close()

    async with PressureQueue("frames", url=url) as q:
        await q.create(bound=100)
        await q.put(b"frame-1")
        item = await q.get(timeout=5)
"""

from __future__ import annotations

from . import errors
from ._async.admin import SemaphoreAdmin
from ._async.connection import Connection
from ._async.pressure import Consuming, PressureQueue, Producing
from ._async.semaphore import Lease, Mutex, Semaphore

__all__ = [
    "Connection",
    "Consuming",
    "Lease",
    "Mutex",
    "PressureQueue",
    "Producing",
    "Semaphore",
    "SemaphoreAdmin",
    "errors",
]

for _obj in (
    Connection,
    Consuming,
    Lease,
    Mutex,
    PressureQueue,
    Producing,
    Semaphore,
    SemaphoreAdmin,
):
    _obj.__module__ = __name__
del _obj
