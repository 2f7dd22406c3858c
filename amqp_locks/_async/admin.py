"""The asyncio face of semaphore administration."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from types import TracebackType

from .. import _flows
from .._common import SemaphorePlan, adopt_connection, make_policy
from .._config import check_timeout
from .connection import Connection

__all__ = ["SemaphoreAdmin"]


class SemaphoreAdmin:
    """Create, resize and destroy one semaphore; the asyncio twin of
    :class:`amqp_locks.SemaphoreAdmin`, with the same guarantees::

        async with SemaphoreAdmin("reports", url=url) as admin:
            await admin.ensure(3)
            await admin.remove(1, wait=True, timeout=60)
    """

    def __init__(
        self,
        name: str,
        url: str | None = None,
        *,
        namespace: str | None = None,
        connection: Connection | None = None,
        heartbeat: int = 10,
        connect_timeout: float = 5.0,
        client_id: str | None = None,
        overshoot: int = 8,
        admin_attempts: int = 100,
    ) -> None:
        self._plan = SemaphorePlan(
            name, namespace, make_policy(overshoot=overshoot, admin_attempts=admin_attempts)
        )
        self.connection, self._owns_connection = adopt_connection(
            connection,
            url,
            Connection,
            lambda: Connection(
                url, heartbeat=heartbeat, connect_timeout=connect_timeout, client_id=client_id
            ),
        )

    @property
    def name(self) -> str:
        return self._plan.name

    def _holder(self) -> str:
        task = asyncio.current_task()
        return f"{self.connection.client_id}:{task.get_name() if task else 'loop'}:admin"

    async def _change(
        self, flow: _flows.Flow[_flows.Resized], wait: bool, timeout: float | None
    ) -> int:
        outcome, _ = await self.connection._run(flow)
        after = self._plan.resized(outcome)
        if wait:
            await self.connection._run(self._plan.removal_wait(outcome, timeout))
        return after

    async def create(self, slots: int) -> int:
        return await self._change(self._plan.create(self._holder(), slots), False, None)

    async def ensure(self, slots: int) -> int:
        return await self._change(self._plan.ensure(self._holder(), slots), False, None)

    async def exists(self) -> bool:
        return (await self.connection._run(self._plan.exists()))[0]

    async def slots(self) -> int:
        return (await self.connection._run(self._plan.count()))[0]

    async def add(self, slots: int) -> int:
        return await self._change(self._plan.add(self._holder(), slots), False, None)

    async def remove(self, slots: int, wait: bool = False, timeout: float | None = None) -> int:
        seconds = check_timeout(timeout)
        return await self._change(self._plan.remove(self._holder(), slots), wait, seconds)

    async def resize(self, slots: int, wait: bool = False, timeout: float | None = None) -> int:
        seconds = check_timeout(timeout)
        return await self._change(self._plan.resize(self._holder(), slots), wait, seconds)

    async def held(self) -> list[int]:
        return list((await self.connection._run(self._plan.held()))[0])

    async def wait_released(
        self, slots: Iterable[int] | None = None, timeout: float | None = None
    ) -> bool:
        return (await self.connection._run(self._plan.wait_released(slots, timeout)))[0]

    async def destroy(self, wait: bool = False, timeout: float | None = None) -> None:
        seconds = check_timeout(timeout)
        await self._change(self._plan.destroy(self._holder()), wait, seconds)

    async def close(self) -> None:
        if self._owns_connection:
            await self.connection.close()

    async def __aenter__(self) -> SemaphoreAdmin:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<aio.SemaphoreAdmin {self.name!r}>"
