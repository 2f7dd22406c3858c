"""asyncio: 20 tasks share 2 slots; a lost lease is reported, not ignored.

    AMQP_URL=amqp://guest:guest@localhost:5672/%2F python examples/async_workers.py
"""

from __future__ import annotations

import asyncio

from amqp_locks import errors
from amqp_locks.aio import Semaphore, SemaphoreAdmin

NAME = "examples.async-workers"


async def main() -> None:
    async with SemaphoreAdmin(NAME) as admin:
        await admin.ensure(2)
    sem = Semaphore(NAME)

    async def job(i: int) -> int:
        try:
            async with sem.acquire(timeout=60) as lease:
                await asyncio.sleep(0.05)
                return lease.slot
        except errors.LockLostError as exc:
            print(f"job {i}: {exc}")  # the work may have overlapped: redo or compensate
            raise

    slots = await asyncio.gather(*(job(i) for i in range(20)))
    await sem.close()
    print(f"20 jobs ran on slots {sorted(set(slots))}")


if __name__ == "__main__":
    asyncio.run(main())
