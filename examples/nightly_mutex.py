"""A cron job that must never run twice at once, on any host: a Mutex.

    AMQP_URL=amqp://guest:guest@localhost:5672/%2F python examples/nightly_mutex.py

Run it from two shells: the second waits (or, with --no-wait, exits at once).
"""

from __future__ import annotations

import sys
import time

from amqp_locks import Mutex

mutex = Mutex("examples.nightly-job")
mutex.ensure()  # idempotent; normally done once by a deploy script
if "--no-wait" in sys.argv:
    lease = mutex.try_acquire()
    if lease is None:
        print("another run is in progress; exiting")
        sys.exit(0)
else:
    lease = mutex.acquire(timeout=3600)
with lease:
    print(f"running the nightly job as {lease.holder_id}")
    for _step in range(3):
        time.sleep(0.3)
        if not lease.held:  # connection died: another run may start now
            print("lost the mutex; stopping early")
            break
mutex.close()
