"""At most 3 of 10 threads call a fragile service at once, across every process that uses
the same semaphore name.

    AMQP_URL=amqp://guest:guest@localhost:5672/%2F python examples/throttle_threads.py
"""

from __future__ import annotations

import threading
import time

from amqp_locks import Semaphore, SemaphoreAdmin

NAME = "examples.fragile-service"


def main() -> None:
    with SemaphoreAdmin(NAME) as admin:  # url: $AMQP_URL, else localhost
        admin.ensure(3)
    sem = Semaphore(NAME)  # one connection, shared by all threads
    active = 0
    peak = 0
    lock = threading.Lock()

    def call_service(i: int) -> None:
        nonlocal active, peak
        with sem.acquire(timeout=60) as lease:
            with lock:
                active += 1
                peak = max(peak, active)
            time.sleep(0.2)  # the "service call"
            with lock:
                active -= 1
            print(f"request {i} done on slot {lease.slot}")

    threads = [threading.Thread(target=call_service, args=(i,)) for i in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sem.close()
    print(f"at most {peak} calls ran at once")
    assert peak <= 3


if __name__ == "__main__":
    main()
