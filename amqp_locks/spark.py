"""Throttle PySpark partitions with an amqp_locks semaphore: at most N tasks, on any executor.

Status: new in 0.1; needs ``pip install 'amqp-locks[spark]'`` only where Spark runs (this module
itself imports PySpark lazily and works without it). Guide: ``docs/spark.md``.

A :class:`Throttle` is a plain, picklable description — a semaphore name, a broker URL, a
timeout — that Spark ships to the executors with your partition function. On the executor it
takes a slot of the semaphore before the partition's first row is processed, and gives it back
when the partition is done::

    from amqp_locks.spark import Throttle

    api = Throttle("payments-api", url="amqp://user:pw@broker:5672/%2F", timeout=600)
    rdd.mapPartitions(api.wrap(call_api))              # or @api on call_api
    rdd.foreachPartition(api.wrap(write_rows))
    df.mapInPandas(api.wrap(enrich_batches), schema)   # and mapInArrow
    api = Throttle.from_conf(spark, "payments-api")    # URL from spark.amqp_locks.url

Guarantees (with those of :class:`amqp_locks.Semaphore`):

* **At most N partitions run at once**, across every executor, task attempt and speculative
  copy: each call of the wrapped function holds its own slot, so a retried or speculative
  attempt is just another holder and waits for a slot like any other.
* **A task never runs unguarded without failing.** The lease is checked before every item the
  function takes from its input and before every item it gives back, and asked of the broker
  once more when the partition ends; a lost lease (connection died, slot removed by an admin)
  raises :class:`~amqp_locks.errors.LockLostError`, which fails the task (Spark may retry it).
  Work done between the loss and the next check ran unguarded — make it idempotent, as Spark
  retries already require.
* **Bounded waiting.** No slot within ``timeout`` seconds raises :class:`ThrottleTimeoutError`
  (an :class:`~amqp_locks.errors.AcquireTimeoutError`) naming the semaphore, the timeout and
  the task; a broker that cannot be reached raises
  :class:`~amqp_locks.errors.BrokerUnavailableError` within ``connect_timeout``.
* **The slot is released** when the partition ends, fails, or is abandoned early (``take``,
  ``limit``: Python closes the generator); if the worker process dies, the broker frees it.

Connections: one per worker process, per broker URL and connection settings, reused by every
task the process runs (Spark reuses Python workers unless ``spark.python.worker.reuse`` is
false), closed at exit; a forked child opens its own. Only strings and numbers travel with a
Throttle — never a connection — so it pickles anywhere.

Error handling: every error is an :class:`amqp_locks.errors.AmqpLocksError`; the task fails
with it and Spark reports its message (and the exception's class name) on the driver.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from amqp_locks import Connection, Lease, Semaphore, errors, redact_url

__all__ = [
    "NAMESPACE_CONF_KEY",
    "URL_CONF_KEY",
    "Throttle",
    "ThrottleTimeoutError",
    "ThrottledFunction",
    "close_connections",
    "throttled",
]

log = logging.getLogger("amqp_locks.spark")

#: Spark conf key read by :meth:`Throttle.from_conf` for the broker URL.
URL_CONF_KEY = "spark.amqp_locks.url"
#: Spark conf key read by :meth:`Throttle.from_conf` for the namespace (optional).
NAMESPACE_CONF_KEY = "spark.amqp_locks.namespace"

T = TypeVar("T")
U = TypeVar("U")


class ThrottleTimeoutError(errors.AcquireTimeoutError):
    """A Spark task waited ``timeout`` seconds for a slot of its throttle without getting one."""

    def __init__(self, name: str, timeout: float, task: str) -> None:
        super().__init__(name, timeout)
        self.task = task
        self.args = (
            f"{task} waited {timeout:g} s for a slot of semaphore {name!r} "
            "(amqp_locks.spark.Throttle) and gave up; all slots stayed busy — raise the "
            "throttle's timeout, add slots, or run fewer partitions at once",
        )

    def __reduce__(self) -> tuple[type[ThrottleTimeoutError], tuple[str, float, str]]:
        return type(self), (self.name, self.timeout, self.task)


@dataclass(frozen=True)
class Throttle:
    """Run partition functions while holding a slot of the semaphore ``name``.

    Arguments (all plain values, so the object pickles to any executor):

    ``name``, ``namespace``
        The semaphore, as for :class:`amqp_locks.Semaphore`. Create it first
        (``SemaphoreAdmin(name).ensure(n)`` or ``amqp-locks ensure NAME --slots N``);
        otherwise tasks fail with :class:`~amqp_locks.errors.SemaphoreNotFoundError`.
    ``url``
        The broker URL, as the executors must reach it (a ``localhost`` URL names each
        executor's own host). Never taken from the executors' environment.
    ``timeout``
        Longest wait for a slot, in seconds (default 600; ``None`` waits forever, ``0``
        tries once). Then :class:`ThrottleTimeoutError` fails the task.
    ``heartbeat``, ``connect_timeout``, ``verify_interval``
        Passed to the worker's :class:`amqp_locks.Connection`: a frozen or cut-off executor
        loses its slot after about two heartbeats; a removed slot is noticed within
        ``verify_interval`` (default: the heartbeat) and at the end of the partition.

    Bad values fail here, on the driver, before any task runs. The URL's password is masked
    in ``repr``. Usage: :meth:`wrap` (or call the throttle: it is a decorator), :meth:`hold`.
    """

    name: str
    url: str = field(repr=False)
    timeout: float | None = 600.0
    namespace: str | None = None
    heartbeat: int = 10
    connect_timeout: float = 5.0
    verify_interval: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise errors.InvalidArgumentError(
                f"Throttle needs the broker URL as a str (executors do not read $AMQP_URL), "
                f"got {self.url!r}"
            )
        timeout = self.timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0
        ):
            raise errors.InvalidArgumentError(
                f"timeout must be None or a number >= 0 (seconds), got {timeout!r}"
            )
        # Building them validates the URL, the name and the settings; no I/O happens here.
        Semaphore(self.name, namespace=self.namespace, connection=self._new_connection())

    @classmethod
    def from_conf(
        cls,
        spark: Any,
        name: str,
        *,
        timeout: float | None = 600.0,
        namespace: str | None = None,
        heartbeat: int = 10,
        connect_timeout: float = 5.0,
        verify_interval: float | None = None,
    ) -> Throttle:
        """A Throttle whose URL (and namespace) come from the Spark configuration.

        Call it on the driver. ``spark`` is a ``SparkSession``, a ``SparkContext`` or a
        ``SparkConf``; the URL is ``spark.amqp_locks.url`` (required:
        :class:`~amqp_locks.errors.InvalidArgumentError` if unset) and the namespace
        ``spark.amqp_locks.namespace`` unless ``namespace`` is given::

            spark-submit --conf spark.amqp_locks.url=amqp://user:pw@broker/%2F job.py
            api = Throttle.from_conf(spark, "payments-api", timeout=300)

        The values are read once, here; the Throttle then carries them to the executors.
        """
        url = _conf_value(spark, URL_CONF_KEY)
        if url is None:
            raise errors.InvalidArgumentError(
                f"Spark conf {URL_CONF_KEY!r} is not set; pass "
                f"--conf {URL_CONF_KEY}=amqp://user:password@host:5672/%2F, or build "
                "Throttle(name, url) yourself"
            )
        if namespace is None:
            namespace = _conf_value(spark, NAMESPACE_CONF_KEY)
        return cls(
            name,
            url,
            timeout=timeout,
            namespace=namespace,
            heartbeat=heartbeat,
            connect_timeout=connect_timeout,
            verify_interval=verify_interval,
        )

    def wrap(self, fn: Callable[[Iterator[T]], Iterable[U] | None]) -> ThrottledFunction[T, U]:
        """``fn``, made to hold a slot while it runs: for ``mapPartitions``,
        ``foreachPartition``, ``mapInPandas`` and ``mapInArrow``.

        ``fn`` takes the partition's iterator (of rows, or of pandas/Arrow batches) and returns
        an iterable of results, or ``None`` (as ``foreachPartition`` functions do). The result
        is a picklable callable returning an iterator; the slot is taken on its first item.
        """
        if not callable(fn):
            raise errors.InvalidArgumentError(f"wrap() needs a callable, got {fn!r}")
        return ThrottledFunction(self, fn)

    def __call__(self, fn: Callable[[Iterator[T]], Iterable[U] | None]) -> ThrottledFunction[T, U]:
        """Same as :meth:`wrap`, so a Throttle is a decorator: ``@Throttle("api", url)``."""
        return self.wrap(fn)

    @contextlib.contextmanager
    def hold(self) -> Iterator[Lease]:
        """Hold a slot for the ``with`` block, for work that is not shaped as an iterator::

            def write_partition(rows):
                with api.hold() as lease:
                    client.bulk_write(list(rows))     # check lease.held in long loops

        Leaving the block verifies the lease with the broker; a lost lease raises
        :class:`~amqp_locks.errors.LockLostError` (unless another exception propagates).
        """
        task = _task_description()
        lease = self._acquire(task)
        try:
            yield lease
            self._check(lease, task, verify=True)
        finally:
            lease.release()

    def __repr__(self) -> str:
        return (
            f"Throttle(name={self.name!r}, url={redact_url(self.url)!r}, "
            f"timeout={self.timeout!r}, namespace={self.namespace!r})"
        )

    # -- on the executor ------------------------------------------------------------------

    def _new_connection(self) -> Connection:
        return Connection(
            self.url,
            heartbeat=self.heartbeat,
            connect_timeout=self.connect_timeout,
            verify_interval=self.verify_interval,
        )

    def _acquire(self, task: str) -> Lease:
        semaphore = _semaphore_for(self)
        started = time.monotonic()
        try:
            lease = semaphore.acquire(timeout=self.timeout)
        except errors.AcquireTimeoutError:
            assert self.timeout is not None
            raise ThrottleTimeoutError(semaphore.name, self.timeout, task) from None
        except errors.AmqpLocksError as exc:
            log.error("%s could not take a slot of %r: %s", task, semaphore.name, exc)
            raise
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s holds slot %d of %r after %.1f ms",
                task,
                lease.slot,
                lease.name,
                (time.monotonic() - started) * 1e3,
            )
        return lease

    def _check(self, lease: Lease, task: str, *, verify: bool = False) -> None:
        """Raise LockLostError unless the lease is held (``verify``: ask the broker)."""
        if lease.held and (not verify or lease.verify()):
            return
        reason = lease.lost_reason or "the broker no longer has its slot"
        raise errors.LockLostError(lease.name, lease.slot, f"{reason} (during {task})")

    def _run(
        self, fn: Callable[[Iterator[T]], Iterable[U] | None], rows: Iterable[T]
    ) -> Iterator[U]:
        task = _task_description()
        lease = self._acquire(task)
        try:
            check = self._check

            def guarded_input() -> Iterator[T]:
                for row in rows:
                    check(lease, task)
                    yield row

            results = fn(guarded_input())
            if results is not None:
                for item in results:
                    check(lease, task)
                    yield item
            check(lease, task, verify=True)
        finally:
            lease.release()


class ThrottledFunction(Generic[T, U]):
    """A partition function that holds a slot of its :class:`Throttle` while it runs.

    Made by :meth:`Throttle.wrap`; picklable (with ``pickle`` too, when ``fn`` is a
    module-level function). Calling it returns a generator: the slot is taken when the first
    item is asked for, and released when it is exhausted, fails or is closed.
    """

    def __init__(self, throttle: Throttle, fn: Callable[[Iterator[T]], Iterable[U] | None]):
        self.throttle = throttle
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, rows: Iterable[T]) -> Iterator[U]:
        return self.throttle._run(self.fn, rows)

    def __repr__(self) -> str:
        return f"<ThrottledFunction {self.__name__} {self.throttle!r}>"


def throttled(
    fn: Callable[[Iterator[T]], Iterable[U] | None],
    name: str,
    url: str,
    *,
    timeout: float | None = 600.0,
    namespace: str | None = None,
    heartbeat: int = 10,
    connect_timeout: float = 5.0,
    verify_interval: float | None = None,
) -> ThrottledFunction[T, U]:
    """``Throttle(name, url, ...).wrap(fn)`` in one call::

    rdd.mapPartitions(throttled(call_api, "payments-api", url, timeout=300))
    """
    throttle = Throttle(
        name,
        url,
        timeout=timeout,
        namespace=namespace,
        heartbeat=heartbeat,
        connect_timeout=connect_timeout,
        verify_interval=verify_interval,
    )
    return throttle.wrap(fn)


# -- the per-process cache ------------------------------------------------------------------

# (pid, url, heartbeat, connect_timeout, verify_interval)
_ConnectionKey = tuple[int, str, int, float, float | None]

_cache_lock = threading.Lock()
_connections: dict[_ConnectionKey, Connection] = {}
_semaphores: dict[tuple[_ConnectionKey, str, str | None], Semaphore] = {}
_atexit_pids: set[int] = set()


def _semaphore_for(throttle: Throttle) -> Semaphore:
    """This process's Semaphore for ``throttle``, over this process's cached connection.

    Keyed by pid as well: a forked child never uses (or closes) its parent's connection, and
    Semaphore objects are kept because they remember the slot count and the idle fast path.
    """
    pid = os.getpid()
    key: _ConnectionKey = (
        pid,
        throttle.url,
        throttle.heartbeat,
        float(throttle.connect_timeout),
        throttle.verify_interval,
    )
    with _cache_lock:
        semaphore = _semaphores.get((key, throttle.name, throttle.namespace))
        if semaphore is not None:
            return semaphore
        connection = _connections.get(key)
        if connection is None:
            connection = throttle._new_connection()
            _connections[key] = connection
            log.debug("new broker connection for this worker: %r", connection)
            if pid not in _atexit_pids:
                _atexit_pids.add(pid)
                atexit.register(close_connections)
        semaphore = Semaphore(throttle.name, namespace=throttle.namespace, connection=connection)
        _semaphores[(key, throttle.name, throttle.namespace)] = semaphore
        return semaphore


def close_connections() -> None:
    """Close this process's cached connections (their slots are freed). Runs at exit.

    Throttled functions open new ones when they next run. PySpark's forked workers leave by
    ``os._exit``, which skips ``atexit``: their sockets close with the process and the broker
    frees their slots at once all the same.
    """
    pid = os.getpid()
    with _cache_lock:
        mine = [key for key in _connections if key[0] == pid]
        closing = [_connections.pop(key) for key in mine]
        for key in [k for k in _semaphores if k[0][0] == pid]:
            del _semaphores[key]
    for connection in closing:
        try:
            connection.close()
        except Exception:
            log.warning("could not close %r cleanly", connection, exc_info=True)


def _after_fork_in_child() -> None:
    # The lock may have been held by another thread of the parent at the fork; the cached
    # entries are the parent's (keyed by its pid) and are never used here.
    global _cache_lock
    _cache_lock = threading.Lock()
    _connections.clear()
    _semaphores.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -- Spark glue (PySpark imported lazily) ---------------------------------------------------


def _task_description() -> str:
    """``Spark task (stage 3.0, partition 5, attempt 1)``, or ``this process`` outside Spark."""
    try:
        from pyspark import TaskContext
    except ImportError:
        return f"process {os.getpid()}"
    context = TaskContext.get()
    if context is None:
        return f"process {os.getpid()}"
    return (
        f"Spark task (stage {context.stageId()}, partition {context.partitionId()}, "
        f"attempt {context.attemptNumber()})"
    )


def _conf_value(spark: Any, key: str) -> str | None:
    """``key`` from a SparkSession's, a SparkContext's or a SparkConf's configuration."""
    if hasattr(spark, "getConf"):  # SparkContext
        conf = spark.getConf()
    elif hasattr(spark, "sparkContext") or hasattr(spark, "conf"):  # SparkSession
        conf = spark.conf
    else:  # SparkConf
        conf = spark
    value = conf.get(key, None)
    if value is None or value == "":
        return None
    return str(value)
