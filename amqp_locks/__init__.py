"""amqp_locks: distributed semaphores and locks backed by RabbitMQ.

The sync API (pika, with a background I/O thread per connection)::

    from amqp_locks import Semaphore, SemaphoreAdmin, Mutex

    SemaphoreAdmin("reports", url=url).ensure(3)
    with Semaphore("reports", url=url).acquire(timeout=5) as lease:
        ...

The asyncio API has the same names in :mod:`amqp_locks.aio`.
"""

from __future__ import annotations

import logging

from . import errors
from ._config import DEFAULT_URL
from ._config import redact as redact_url
from ._flows import HOLDER_ID_ARGUMENT
from ._sync.admin import SemaphoreAdmin
from ._sync.connection import Connection
from ._sync.pressure import Consuming, PressureQueue, Producing
from ._sync.semaphore import Lease, Mutex, Semaphore

__all__ = [
    "DEFAULT_URL",
    "HOLDER_ID_ARGUMENT",
    "Connection",
    "Consuming",
    "Lease",
    "Mutex",
    "PressureQueue",
    "Producing",
    "Semaphore",
    "SemaphoreAdmin",
    "__version__",
    "errors",
    "redact_url",
]

__version__ = "0.1.0"

# A library logs; the application decides where it goes (no "lastResort" output on stderr).
logging.getLogger(__name__).addHandler(logging.NullHandler())

_PUBLIC = (Connection, Consuming, Lease, Mutex, PressureQueue, Producing, Semaphore, SemaphoreAdmin)
for _obj in _PUBLIC:
    _obj.__module__ = __name__
del _obj, _PUBLIC
