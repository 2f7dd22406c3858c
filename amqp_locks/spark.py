"""PySpark with amqp_locks: throttle partitions with a semaphore, feed a bounded pipe.

Two tools: a :class:`Throttle` (at most N tasks in a section, on any executor) and a
:class:`Pipe` (partitions write their rows into a bounded pressure queue, whose bound holds
the job back while readers are slow).

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

A :class:`Pipe` is a plain, picklable description of a pressure queue (name, prefix, URL,
row encoding, timeouts). Its :meth:`~Pipe.writer` is a partition function; :func:`read_pipe`
(or :meth:`Pipe.reader`) drains the queue in a driver thread or any other process::

    from amqp_locks.spark import Pipe, write_to_pipe

    pipe = Pipe("results", url="amqp://user:pw@broker:5672/%2F", encoding="json")
    pipe.create(bound=1000)                          # once
    # a consumer elsewhere: for row in pipe.reader(): ...  (until closed and drained)
    write_to_pipe(df, pipe)                          # one job, then pipe.close()
    df.foreachPartition(pipe.writer())               # or by hand (then pipe.close())

Pipe guarantees (with those of :class:`amqp_locks.PressureQueue`):

* **Bounded.** The queue never holds more than its bound; a task whose put finds it full
  waits (up to ``put_timeout``), so the job runs no faster than its readers.
* **Ordered.** A partition's rows reach the queue in the partition's order: each partition
  takes the producer role for all its rows (or for turns of ``rows_per_turn`` rows).
* **Exactly once per row at a deduplicating reader, at least once on the queue.** A retried
  or speculative attempt writes its partition again; every row carries an envelope
  (``{"pipe":1,"enc","run","stage","partition","attempt","index"}`` then a newline, then the
  payload) and :class:`PipeReader` drops rows whose index it has delivered already.
* **Fails, never hangs or goes unguarded:** an unreachable broker, a missing queue, a lost
  producer role (:class:`~amqp_locks.errors.LockLostError`), a row that cannot be encoded,
  or no room or role within its timeout fail the task with a message naming it.

Connections: one per worker process, per broker URL and connection settings, reused by every
task the process runs (Spark reuses Python workers unless ``spark.python.worker.reuse`` is
false), closed at exit; a forked child opens its own; throttles and pipes with the same
settings share it. Only strings and numbers travel with a Throttle or a Pipe — never a
connection — so they pickle anywhere.

Error handling: every error is an :class:`amqp_locks.errors.AmqpLocksError`; the task fails
with it and Spark reports its message (and the exception's class name) on the driver.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import datetime
import decimal
import json
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from amqp_locks import (
    Connection,
    Lease,
    PressureQueue,
    Producing,
    Semaphore,
    errors,
    redact_url,
)

__all__ = [
    "ENCODINGS",
    "NAMESPACE_CONF_KEY",
    "PREFIX_CONF_KEY",
    "URL_CONF_KEY",
    "Pipe",
    "PipeFormatError",
    "PipeItem",
    "PipeReader",
    "PipeWriter",
    "Throttle",
    "ThrottleTimeoutError",
    "ThrottledFunction",
    "close_connections",
    "encode_json",
    "read_pipe",
    "throttled",
    "write_to_pipe",
]

log = logging.getLogger("amqp_locks.spark")

#: Spark conf key read by :meth:`Throttle.from_conf` for the broker URL.
URL_CONF_KEY = "spark.amqp_locks.url"
#: Spark conf key read by :meth:`Throttle.from_conf` for the namespace (optional).
NAMESPACE_CONF_KEY = "spark.amqp_locks.namespace"
#: Spark conf key read by :meth:`Pipe.from_conf` for the pressure-queue prefix (optional).
PREFIX_CONF_KEY = "spark.amqp_locks.pressure_prefix"

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
        _check_url(self.url, "Throttle")
        _check_timeout(self.timeout, "timeout")
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


# -- feeding a bounded pipe (pressure queues) -----------------------------------------------

#: The row encodings a :class:`Pipe` knows.
ENCODINGS = ("bytes", "json")

# Every enveloped item starts with these bytes (the header's first key, version 1).
_ENVELOPE_START = b'{"pipe":1,'


class PipeFormatError(errors.AmqpLocksError, ValueError):
    """An item read from a pipe is not what its :class:`Pipe` says it should be.

    Raised by :class:`PipeReader` for an item without a valid envelope (something other than
    a :class:`PipeWriter` put it there), or whose payload does not decode. The item is put
    back at the head of the queue, untouched: take it out with ``PressureQueue.get()`` (or
    create the queue with a ``delivery_limit``, which moves it to the dead letters).
    """

    def __init__(self, queue: str, detail: str) -> None:
        self.queue = queue
        self.detail = detail
        super().__init__(f"pipe {queue!r}: {detail}")

    def __reduce__(self) -> tuple[type[PipeFormatError], tuple[str, str]]:
        return type(self), (self.queue, self.detail)


@dataclass(frozen=True)
class PipeItem:
    """One row read from a pipe, with where it came from (:meth:`PipeReader.items`).

    ``run`` names the :class:`PipeWriter` (a fresh one per :meth:`Pipe.writer` call),
    ``stage``/``partition``/``attempt`` the Spark task that wrote the row, ``index`` its
    position in the partition (from 0). All but ``value`` are None for a pipe without
    envelopes (``envelope=False``).
    """

    value: Any
    partition: int | None
    index: int | None
    attempt: int | None
    stage: int | None
    run: str | None


@dataclass(frozen=True)
class Pipe:
    """A bounded pressure queue that Spark partitions write rows into, and readers drain.

    Arguments (plain values, so the object pickles to any executor):

    ``name``, ``prefix``
        The pressure queue, as for :class:`amqp_locks.PressureQueue`. ``prefix=None`` is
        resolved here, on the driver (``$PRESSURE_PREFIX``, else ``"__pressure__"``): the
        executors never read their environment. Create the queue first (:meth:`create`).
    ``url``
        The broker URL, as the executors reach it (required: never taken from ``$AMQP_URL``).
    ``encoding``
        How rows become bytes: ``"json"`` (default: a ``pyspark.sql.Row`` becomes a JSON
        object, anything else goes through ``json.dumps``; see :func:`encode_json`) or
        ``"bytes"`` (rows must be ``bytes``, ``bytearray`` or ``memoryview``).
    ``envelope``
        Wrap each row in the pipe envelope (default True): one line of JSON naming the writer,
        the Spark task and the row's index, then the payload. :class:`PipeReader` uses it to
        drop the rows a retried or speculative task attempt writes again. ``False`` puts bare
        payloads (for consumers that know nothing of pipes), delivered at least once.
    ``rows_per_turn``
        ``None`` (default): a partition takes the producer role at its first row and keeps it
        to its last, so its rows are contiguous in the queue; partitions write one after the
        other, and the rows are computed while the role is held. An int ``k``: a partition
        computes up to ``k`` rows without the role, then takes it, puts them and gives it
        back; partitions compute concurrently and their rows interleave in turns of at most
        ``k`` rows (each partition's rows stay in order).
    ``put_timeout``
        Longest wait for room for one row, in seconds (default 600; None: forever). A full
        queue blocks the task (backpressure); no room in time fails it with
        :class:`~amqp_locks.errors.OperationTimeoutError`.
    ``role_timeout``
        Longest wait for the producer role, per turn (default 3600; None: forever): other
        partitions hold it while they write.
    ``heartbeat``, ``connect_timeout``, ``verify_interval``
        For the worker's :class:`amqp_locks.Connection` (shared with :class:`Throttle` when
        the settings are equal). An unreachable broker fails the task within
        ``connect_timeout`` with :class:`~amqp_locks.errors.BrokerUnavailableError`.

    Bad values fail here, on the driver. The URL's password is masked in ``repr``.
    """

    name: str
    url: str = field(repr=False)
    prefix: str | None = None
    encoding: str = "json"
    envelope: bool = True
    rows_per_turn: int | None = None
    put_timeout: float | None = 600.0
    role_timeout: float | None = 3600.0
    heartbeat: int = 10
    connect_timeout: float = 5.0
    verify_interval: float | None = None

    def __post_init__(self) -> None:
        _check_url(self.url, "Pipe")
        if self.prefix is None:
            # Resolved here, on the driver, as PressureQueue resolves it (no I/O: the queue's
            # connection opens lazily and is never used).
            object.__setattr__(self, "prefix", PressureQueue(self.name, url=self.url).prefix)
        if self.encoding not in ENCODINGS:
            raise errors.InvalidArgumentError(
                f"encoding must be one of {', '.join(map(repr, ENCODINGS))}, got {self.encoding!r}"
            )
        if not isinstance(self.envelope, bool):
            raise errors.InvalidArgumentError(f"envelope must be a bool, got {self.envelope!r}")
        turn = self.rows_per_turn
        if turn is not None and (isinstance(turn, bool) or not isinstance(turn, int) or turn < 1):
            raise errors.InvalidArgumentError(
                f"rows_per_turn must be None or an int >= 1, got {turn!r}"
            )
        _check_timeout(self.put_timeout, "put_timeout")
        _check_timeout(self.role_timeout, "role_timeout")
        # Validates the name, the prefix, the URL and the connection settings; no I/O here.
        PressureQueue(self.name, prefix=self.prefix, connection=self._new_connection())

    @classmethod
    def from_conf(cls, spark: Any, name: str, **kwargs: Any) -> Pipe:
        """A Pipe whose URL (and prefix) come from the Spark configuration.

        Call it on the driver. The URL is ``spark.amqp_locks.url`` (required), the prefix
        ``spark.amqp_locks.pressure_prefix`` unless ``prefix=`` is given; other keyword
        arguments are the Pipe's own::

            spark-submit --conf spark.amqp_locks.url=amqp://user:pw@broker/%2F job.py
            pipe = Pipe.from_conf(spark, "results", encoding="json")
        """
        url = _conf_value(spark, URL_CONF_KEY)
        if url is None:
            raise errors.InvalidArgumentError(
                f"Spark conf {URL_CONF_KEY!r} is not set; pass "
                f"--conf {URL_CONF_KEY}=amqp://user:password@host:5672/%2F, or build "
                "Pipe(name, url) yourself"
            )
        if kwargs.get("prefix") is None:
            kwargs["prefix"] = _conf_value(spark, PREFIX_CONF_KEY)
        return cls(name, url, **kwargs)

    def __repr__(self) -> str:
        return (
            f"Pipe(name={self.name!r}, url={redact_url(self.url)!r}, prefix={self.prefix!r}, "
            f"encoding={self.encoding!r}, envelope={self.envelope!r}, "
            f"rows_per_turn={self.rows_per_turn!r})"
        )

    # -- on the driver (or any process) ---------------------------------------------------

    def writer(self) -> PipeWriter:
        """A partition function that writes its rows into the pipe, for ``foreachPartition``.

        ``rdd.foreachPartition(pipe.writer())`` or ``df.foreachPartition(pipe.writer())``.
        Each call draws a new run id, so two jobs written with two writers never look like
        retries of each other. One writer may serve several jobs (Spark stage ids differ).
        """
        return PipeWriter(self, secrets.token_hex(6))

    def queue(self) -> PressureQueue:
        """A :class:`~amqp_locks.PressureQueue` for this pipe, on a connection of its own.

        For anything this class does not wrap (``peek``, ``kick``, ...); call ``disconnect()``
        on it when done.
        """
        return PressureQueue(
            self.name,
            self.url,
            prefix=self.prefix,
            heartbeat=self.heartbeat,
            connect_timeout=self.connect_timeout,
        )

    def create(
        self,
        bound: int,
        *,
        exist_ok: bool = False,
        replicated: bool = False,
        delivery_limit: int | None = None,
    ) -> bool:
        """Create the queue with room for ``bound`` rows (0: unbounded, no backpressure).

        Returns False if it existed and ``exist_ok`` (its bound is then left as it was);
        otherwise an existing queue raises :class:`~amqp_locks.errors.QueueAlreadyExistsError`.
        """
        with self.queue() as q:
            try:
                q.create(bound, replicated=replicated, delivery_limit=delivery_limit)
            except errors.QueueAlreadyExistsError:
                if not exist_ok:
                    raise
                return False
            return True

    def close(self, timeout: float | None = None) -> bool:
        """Close the pipe: readers drain it, then end. Call it when the writing job is done.

        Takes the producer role (waiting up to ``timeout`` s while a task still writes).
        Returns False if it was already closed.
        """
        with self.queue() as q:
            try:
                q.close(timeout=timeout)
            except errors.QueueClosedError:
                return False
            return True

    def delete(self, timeout: float | None = None, *, missing_ok: bool = True) -> None:
        """Delete the queue and every row in it. Blocked writers and readers fail at once with
        :class:`~amqp_locks.errors.QueueDoesNotExistError` — the way to abort a pipe."""
        with self.queue() as q:
            try:
                q.delete(timeout=timeout)
            except errors.QueueDoesNotExistError:
                if not missing_ok:
                    raise

    def stats(self) -> dict[str, int]:
        """The queue's counters (``produced_messages``, ``produced_bytes``, ``consumed_*``)."""
        with self.queue() as q:
            return q.stats()

    def length(self) -> int:
        """Rows waiting in the queue now (not those being read)."""
        with self.queue() as q:
            return q.length()

    def reader(
        self,
        *,
        timeout: float | None = None,
        role_timeout: float | None = None,
        dedup: bool | None = None,
        decode: Callable[[bytes], Any] | None = None,
        connection: Connection | None = None,
    ) -> PipeReader:
        """A :class:`PipeReader`: iterate it for the rows, until the pipe is closed and drained.

        ``timeout``: longest wait for each row (None: forever). ``role_timeout``: longest
        wait for the consumer role (default: the pipe's). ``dedup`` (default: with envelopes)
        drops rows already delivered. ``decode`` replaces the payload decoding (default: by
        the encoding named in the envelope, else the pipe's). ``connection``: use this one
        instead of opening one (it is then not closed by the reader).
        """
        return PipeReader(
            self,
            timeout=timeout,
            role_timeout=self.role_timeout if role_timeout is None else role_timeout,
            dedup=dedup,
            decode=decode,
            connection=connection,
        )

    # -- on the executor ------------------------------------------------------------------

    def _new_connection(self) -> Connection:
        return Connection(
            self.url,
            heartbeat=self.heartbeat,
            connect_timeout=self.connect_timeout,
            verify_interval=self.verify_interval,
        )

    def _encoder(self) -> Callable[[Any], bytes]:
        return _encode_bytes if self.encoding == "bytes" else encode_json

    def _write_partition(self, rows: Iterable[Any], run: str) -> int:
        """Put ``rows`` into the queue, in order, as this task; returns how many."""
        task, (stage, partition, attempt) = _task_identity()
        if stage < 0:  # outside Spark: every call is a stream of its own
            run = f"{run}~{secrets.token_hex(4)}"
        queue = _pipe_queue_for(self, task)
        encode = self._encoder()
        head = b""
        if self.envelope:
            head = (
                f'{{"pipe":1,"enc":"{self.encoding}","run":"{run}","stage":{stage},'
                f'"partition":{partition},"attempt":{attempt},"index":'
            ).encode()
            assert head.startswith(_ENVELOPE_START)
        started = time.monotonic()
        written = 0
        producing: Producing | None = None
        pending: list[bytes] = []
        try:
            for row in rows:
                try:
                    payload = encode(row)
                except (TypeError, ValueError) as exc:  # e.g. UnicodeEncodeError: a ValueError
                    kind = TypeError if isinstance(exc, TypeError) else ValueError
                    raise kind(f"{task}, row {written}: {exc}") from exc
                body = head + str(written).encode() + b"}\n" + payload if self.envelope else payload
                written += 1
                if self.rows_per_turn is None:
                    if producing is None:
                        producing = self._take_role(queue, task)
                    self._put(producing, body, task, written - 1)
                else:
                    pending.append(body)
                    if len(pending) >= self.rows_per_turn:
                        self._turn(queue, pending, task, written - len(pending))
                        pending = []
            if pending:
                self._turn(queue, pending, task, written - len(pending))
        except errors.AmqpLocksError as exc:
            log.error("%s could not write to pipe %r: %s", task, self.name, exc)
            raise
        finally:
            if producing is not None:
                producing.release()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s wrote %d rows to pipe %r in %.1f ms",
                task,
                written,
                self.name,
                (time.monotonic() - started) * 1e3,
            )
        return written

    def _turn(self, queue: PressureQueue, bodies: list[bytes], task: str, first: int) -> None:
        # One transaction per batch of room rather than one per row (put_many).
        with self._take_role(queue, task) as producing:
            try:
                producing.put_many(bodies, timeout=self.put_timeout)
            except errors.OperationTimeoutError as exc:
                assert self.put_timeout is not None
                raise errors.OperationTimeoutError(
                    self.name,
                    f"{task}: put of rows {first + exc.done}.. (waiting for room: is a reader "
                    "draining the pipe?)",
                    self.put_timeout,
                    done=exc.done,
                ) from None

    def _take_role(self, queue: PressureQueue, task: str) -> Producing:
        try:
            return queue.producing(timeout=self.role_timeout)
        except errors.OperationTimeoutError:
            assert self.role_timeout is not None
            raise errors.OperationTimeoutError(
                self.name,
                f"{task}: waiting for the producer role (other tasks kept it; raise the "
                "pipe's role_timeout, or use rows_per_turn)",
                self.role_timeout,
            ) from None

    def _put(self, producing: Producing, body: bytes, task: str, index: int) -> None:
        try:
            producing.put(body, timeout=self.put_timeout)
        except errors.OperationTimeoutError:
            assert self.put_timeout is not None
            raise errors.OperationTimeoutError(
                self.name,
                f"{task}: put of row {index} (waiting for room: is a reader draining the pipe?)",
                self.put_timeout,
            ) from None


@dataclass(frozen=True)
class PipeWriter:
    """Writes a partition's rows into a :class:`Pipe`; made by :meth:`Pipe.writer`.

    A picklable callable for ``rdd.foreachPartition`` / ``df.foreachPartition``. In a Spark
    task, the rows are tagged with the task (stage, partition, attempt) and their index; the
    producer role is taken when the first row is ready (an empty partition touches nothing)
    and given back when the partition is written, fails, or the task is killed (its worker
    dies: the broker frees the role).
    """

    pipe: Pipe
    run: str

    def __call__(self, rows: Iterable[Any]) -> None:
        self.write(rows)

    def write(self, rows: Iterable[Any]) -> int:
        """Write ``rows``; returns how many. Outside Spark, each call is a stream of its own."""
        return self.pipe._write_partition(rows, self.run)

    def counted(self, rows: Iterable[Any]) -> Iterator[int]:
        """For ``mapPartitions``: write ``rows``, then yield how many (one int)."""
        yield self.write(rows)


def write_to_pipe(data: Any, pipe: Pipe, *, close: bool = True) -> int:
    """Write a DataFrame's or an RDD's rows into ``pipe``; returns how many rows were written.

    Runs one Spark job (call it on the driver): each partition writes its rows as
    :class:`PipeWriter` does. The count is that of the successful task attempts, so retried
    rows count once. Then, if ``close``, closes the pipe, so its readers end once they have
    drained it. If the job fails the pipe stays open and the error propagates: ``delete()``
    the pipe to make readers fail, or write again and close. Start a reader before calling
    this on a bounded pipe: with nobody draining it, tasks fail after ``put_timeout``.
    """
    rdd = data if hasattr(data, "mapPartitions") else getattr(data, "rdd", None)
    if rdd is None or not hasattr(rdd, "mapPartitions"):
        raise errors.InvalidArgumentError(
            f"write_to_pipe needs a pyspark DataFrame or RDD, got {type(data).__name__}"
        )
    if not isinstance(pipe, Pipe):
        raise errors.InvalidArgumentError(f"write_to_pipe needs a Pipe, got {pipe!r}")
    with pipe.queue() as q:
        # On the driver, before any task runs: a bad URL or a missing queue fails here.
        if not q.exists():
            raise errors.QueueDoesNotExistError(pipe.name)
    started = time.monotonic()
    count = int(rdd.mapPartitions(pipe.writer().counted).sum())
    log.info("wrote %d rows to pipe %r in %.1f s", count, pipe.name, time.monotonic() - started)
    if close:
        pipe.close(timeout=pipe.role_timeout)
    return count


class PipeReader:
    """Reads a :class:`Pipe`'s rows until it is closed and drained; made by
    :meth:`Pipe.reader` or :func:`read_pipe`.

    ::

        with pipe.reader() as rows:           # in a driver thread, or any process
            for row in rows:                  # decoded rows
                handle(row)
        for item in pipe.reader().items():    # PipeItem: value, partition, index, attempt…
            ...

    The consumer role is taken when iteration starts and kept until the pipe is closed and
    drained, the iterator is closed, or :meth:`close` is called. A row is acknowledged (gone
    from the queue) when the next one is asked for or the iteration stops; if this process
    dies before that, the broker gives it to the next reader (at least once on the queue).

    With envelopes, the reader keeps, for each (writer run, stage, partition), the index of
    the next row it expects; it drops a row whose index is lower (a retried or speculative
    attempt writing again) and counts it in :attr:`duplicates`. A higher index (rows taken
    by an earlier reader, or lost) is delivered and counted in :attr:`skipped`. So, in one
    reader, each (run, stage, partition, index) is delivered at most once and in order.
    """

    def __init__(
        self,
        pipe: Pipe,
        *,
        timeout: float | None = None,
        role_timeout: float | None = None,
        dedup: bool | None = None,
        decode: Callable[[bytes], Any] | None = None,
        connection: Connection | None = None,
    ) -> None:
        _check_timeout(timeout, "timeout")
        _check_timeout(role_timeout, "role_timeout")
        if dedup is None:
            dedup = pipe.envelope
        if dedup and not pipe.envelope:
            raise errors.InvalidArgumentError(
                "dedup needs envelopes: this pipe has envelope=False, so rows carry no "
                "partition or index to tell a duplicate by"
            )
        if decode is not None and not callable(decode):
            raise errors.InvalidArgumentError(f"decode must be callable, got {decode!r}")
        self.pipe = pipe
        self.timeout = timeout
        self.role_timeout = role_timeout
        self.dedup = dedup
        self._decode = decode
        #: Rows delivered by this reader.
        self.delivered = 0
        #: Rows dropped because their (run, stage, partition, index) was delivered already.
        self.duplicates = 0
        #: Rows never seen before a delivered one of the same partition (another reader took
        #: them, or they were lost): should stay 0 with one reader from the start.
        self.skipped = 0
        self._next: dict[tuple[str, int, int], int] = {}
        self._queue = PressureQueue(
            pipe.name,
            None if connection is not None else pipe.url,
            prefix=pipe.prefix,
            connection=connection,
            heartbeat=pipe.heartbeat,
            connect_timeout=pipe.connect_timeout,
        )
        self._active: Generator[PipeItem, None, None] | None = None

    def __iter__(self) -> Iterator[Any]:
        for item in self.items():
            yield item.value

    def items(self) -> Iterator[PipeItem]:
        """The rows as :class:`PipeItem` (value and origin), until closed and drained."""
        if self._active is not None:
            raise RuntimeError(f"pipe {self.pipe.name!r}: this reader is already being read")
        active = self._active = self._items()
        return active

    def _items(self) -> Generator[PipeItem, None, None]:
        consuming = self._queue.consuming(timeout=self.role_timeout)
        try:
            while True:
                receiving = consuming.receive(timeout=self.timeout)
                try:
                    body = receiving.__enter__()
                except errors.QueueClosedError:
                    return
                try:
                    item = self._item(body)
                    if item is not None:
                        self.delivered += 1
                        yield item
                except GeneratorExit:  # the caller stopped: it has seen this row
                    receiving.__exit__(None, None, None)
                    raise
                except BaseException:  # a bad item goes back, untouched
                    if not receiving.__exit__(*sys.exc_info()):
                        raise
                else:
                    receiving.__exit__(None, None, None)
        finally:
            self._active = None
            consuming.release()

    def _item(self, body: bytes) -> PipeItem | None:
        """The decoded item, or None for a duplicate."""
        pipe = self.pipe
        if not pipe.envelope:
            return PipeItem(self._payload(body, pipe.encoding), None, None, None, None, None)
        header, payload = _split_envelope(pipe.name, body)
        key = (header["run"], header["stage"], header["partition"])
        index = header["index"]
        if self.dedup:
            expected = self._next.get(key, 0)
            if index < expected:
                self.duplicates += 1
                log.debug(
                    "pipe %r: dropped row %d of partition %d (attempt %d): delivered already",
                    pipe.name,
                    index,
                    header["partition"],
                    header["attempt"],
                )
                return None
            if index > expected:
                self.skipped += index - expected
                log.warning(
                    "pipe %r: %s of partition %d (stage %d, run %s) never reached this reader "
                    "(another reader took them, or they were lost)",
                    pipe.name,
                    f"row {expected}" if index == expected + 1 else f"rows {expected}-{index - 1}",
                    header["partition"],
                    header["stage"],
                    header["run"],
                )
            self._next[key] = index + 1
        value = self._payload(payload, header["enc"])
        return PipeItem(
            value, header["partition"], index, header["attempt"], header["stage"], header["run"]
        )

    def _payload(self, payload: bytes, encoding: str) -> Any:
        if self._decode is not None:
            return self._decode(payload)
        if encoding == "bytes":
            return payload
        try:
            return json.loads(payload)
        except ValueError as exc:
            raise PipeFormatError(self.pipe.name, f"a row is not valid JSON ({exc})") from None

    def close(self) -> None:
        """Stop reading: acknowledge the row being read, give the role back, disconnect."""
        active, self._active = self._active, None
        if active is not None:
            active.close()
        self._queue.disconnect()

    def __enter__(self) -> PipeReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<PipeReader {self.pipe.name!r} delivered={self.delivered} "
            f"duplicates={self.duplicates}>"
        )


def read_pipe(
    name: str,
    url: str,
    *,
    prefix: str | None = None,
    encoding: str = "json",
    envelope: bool = True,
    timeout: float | None = None,
    role_timeout: float | None = None,
    dedup: bool | None = None,
    decode: Callable[[bytes], Any] | None = None,
    heartbeat: int = 10,
    connect_timeout: float = 5.0,
) -> PipeReader:
    """``Pipe(name, url, ...).reader(...)`` in one call, for a plain consumer process::

    with read_pipe("results", url) as rows:
        for row in rows:
            handle(row)
    """
    pipe = Pipe(
        name,
        url,
        prefix=prefix,
        encoding=encoding,
        envelope=envelope,
        heartbeat=heartbeat,
        connect_timeout=connect_timeout,
    )
    return pipe.reader(timeout=timeout, role_timeout=role_timeout, dedup=dedup, decode=decode)


def encode_json(row: Any) -> bytes:
    """A row as UTF-8 JSON, as ``Pipe(encoding="json")`` writes it.

    * A ``pyspark.sql.Row`` with field names becomes an object, fields in schema order
      (``Row.asDict(recursive=True)``: nested Rows become objects too); a Row without field
      names, an array.
    * Anything else goes through ``json.dumps``: dicts are objects (keys must be str, int,
      float, bool or None), lists and tuples arrays.
    * Values JSON lacks: ``datetime``, ``date`` and ``time`` become ISO 8601 strings
      (``isoformat()``, naive as PySpark gives them); ``Decimal`` a string of its exact
      digits; ``bytes``/``bytearray`` (BinaryType) a base64 string. ``NaN`` and infinities
      are written as ``NaN``/``Infinity`` (Python's ``json`` reads them back; strict JSON
      parsers do not). Any other type raises ``TypeError``.
    """
    if isinstance(row, tuple) and callable(getattr(row, "asDict", None)):
        row = _row_value(row)
    return json.dumps(
        row, separators=(",", ":"), ensure_ascii=False, default=_json_default
    ).encode()


def _json_default(value: Any) -> Any:
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, tuple) and callable(getattr(value, "asDict", None)):
        return _row_value(value)
    raise TypeError(
        f"a {type(value).__name__} value has no JSON form in a pipe (encoding='json' takes "
        "JSON types, Rows, dates and times, Decimal and bytes); convert it first, or use "
        "encoding='bytes'"
    )


def _row_value(row: Any) -> Any:
    """A pyspark Row as a dict (fields in order), or a list if it has no field names."""
    if hasattr(row, "__fields__"):
        return row.asDict(recursive=True)
    return list(row)


def _encode_bytes(row: Any) -> bytes:
    if isinstance(row, bytes):
        return row
    if isinstance(row, (bytearray, memoryview)):
        return bytes(row)
    raise TypeError(
        f"a pipe with encoding='bytes' takes bytes rows, got {type(row).__name__} — "
        "encode the rows first (rdd.map(...)), or use encoding='json'"
    )


def _split_envelope(name: str, body: bytes) -> tuple[dict[str, Any], bytes]:
    end = body.find(b"\n")
    if not body.startswith(_ENVELOPE_START) or end < 0:
        raise PipeFormatError(
            name,
            f"an item has no pipe envelope (starts {body[:24]!r}); was it put by something "
            "other than a PipeWriter, or with envelope=False?",
        )
    try:
        header = json.loads(body[:end])
    except ValueError as exc:
        raise PipeFormatError(name, f"an item's envelope is not valid JSON ({exc})") from None
    ints = ("stage", "partition", "attempt", "index")
    if (
        not isinstance(header, dict)
        or not all(type(header.get(key)) is int for key in ints)
        or not isinstance(header.get("run"), str)
        or header.get("enc") not in ENCODINGS
    ):
        raise PipeFormatError(name, f"an item's envelope is malformed: {body[:end]!r}")
    return header, body[end + 1 :]


def _check_url(url: object, who: str) -> None:
    if not isinstance(url, str):
        raise errors.InvalidArgumentError(
            f"{who} needs the broker URL as a str (executors do not read $AMQP_URL), got {url!r}"
        )


def _check_timeout(value: object, what: str) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0
    ):
        raise errors.InvalidArgumentError(
            f"{what} must be None or a number >= 0 (seconds), got {value!r}"
        )


# -- the per-process cache ------------------------------------------------------------------

# (pid, url, heartbeat, connect_timeout, verify_interval)
_ConnectionKey = tuple[int, str, int, float, float | None]

_cache_lock = threading.Lock()
_connections: dict[_ConnectionKey, Connection] = {}
_semaphores: dict[tuple[_ConnectionKey, str, str | None], Semaphore] = {}
_atexit_pids: set[int] = set()


def _connection_for(
    url: str, heartbeat: int, connect_timeout: float, verify_interval: float | None
) -> tuple[_ConnectionKey, Connection]:
    """This process's cached connection for these settings, opened (lazily) on first use.

    Keyed by pid as well: a forked child never uses (or closes) its parent's connection.
    Call with ``_cache_lock`` held.
    """
    pid = os.getpid()
    key: _ConnectionKey = (pid, url, heartbeat, float(connect_timeout), verify_interval)
    connection = _connections.get(key)
    if connection is None:
        connection = Connection(
            url,
            heartbeat=heartbeat,
            connect_timeout=connect_timeout,
            verify_interval=verify_interval,
        )
        _connections[key] = connection
        log.debug("new broker connection for this worker: %r", connection)
        if pid not in _atexit_pids:
            _atexit_pids.add(pid)
            atexit.register(close_connections)
    return key, connection


def _semaphore_for(throttle: Throttle) -> Semaphore:
    """This process's Semaphore for ``throttle``, over this process's cached connection.

    Semaphore objects are kept because they remember the slot count and the idle fast path.
    """
    with _cache_lock:
        key, connection = _connection_for(
            throttle.url, throttle.heartbeat, throttle.connect_timeout, throttle.verify_interval
        )
        semaphore = _semaphores.get((key, throttle.name, throttle.namespace))
        if semaphore is None:
            semaphore = Semaphore(
                throttle.name, namespace=throttle.namespace, connection=connection
            )
            _semaphores[(key, throttle.name, throttle.namespace)] = semaphore
        return semaphore


def _pipe_queue_for(pipe: Pipe, task: str) -> PressureQueue:
    """A PressureQueue for ``pipe`` over this process's cached connection.

    A new (cheap, I/O-free) object per task, so the queue's producer record names the task.
    """
    with _cache_lock:
        _, connection = _connection_for(
            pipe.url, pipe.heartbeat, pipe.connect_timeout, pipe.verify_interval
        )
    return PressureQueue(
        pipe.name,
        prefix=pipe.prefix,
        client_id=f"{task} on {connection.client_id}",
        connection=connection,
    )


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


def _task_identity() -> tuple[str, tuple[int, int, int]]:
    """The task's description and (stage, partition, attempt); (-1, 0, 0) outside Spark."""
    try:
        from pyspark import TaskContext
    except ImportError:
        return f"process {os.getpid()}", (-1, 0, 0)
    context = TaskContext.get()
    if context is None:
        return f"process {os.getpid()}", (-1, 0, 0)
    stage, partition, attempt = (
        int(context.stageId()),
        int(context.partitionId()),
        int(context.attemptNumber()),
    )
    return f"Spark task (stage {stage}, partition {partition}, attempt {attempt})", (
        stage,
        partition,
        attempt,
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
