"""An in-memory model of the RabbitMQ semantics the pressure flows rely on, and drivers for it.

It extends :class:`broker_model.BrokerModel` (the semaphore model), so the semaphore operations
that pressure flows yield (create, delete, taking a role) keep working, and adds what
:mod:`amqp_locks._pressure` assumes of the broker -- and no more:

* **Queues hold messages** (body, type, message_id, headers, redelivered flag) in FIFO order.
  Every message gets a global sequence number when first published; a requeued message goes
  back to its *original position* (ordered by that number), which for a FIFO consumer is the
  head. This is RabbitMQ's behaviour for classic queues.
* **x-max-length with drop-head** is applied on publish and counts *ready* messages only, as in
  RabbitMQ: a requeue may exceed it. Records (1) keep the newest, ``B:bound`` (0) keeps nothing,
  ``B:space`` (bound) drops the oldest credit if one were ever extra.
* **Sessions** (``OpenSession``): transactional channels of one connection, with their own
  delivery tags and unacknowledged deliveries.

  - ``Subscribe``: a consumer with a prefetch. Deliveries are pushed at once (the model
    dispatches eagerly after every operation, a valid order of what the broker does
    asynchronously) into the session's buffer; ``Take(stream=True)`` pops that buffer
    locally, without a round trip (recorded in :attr:`PressureModel.local`).
  - ``Take(stream=False)``: ``basic.get`` of the head. On a missing queue it is a 404: the
    channel closes (its unacked deliveries go back) and the answer is ``GONE``.
  - ``Commit``: atomic. Publishes (mandatory) are applied first, then acks and rejects, in that
    order (as RabbitMQ's ``tx.commit`` does; the model shows no state in between). Publishes
    to missing queues come back as the returned routing keys (``()`` for ``wait=False``,
    whose answer the flow does not wait for); acks remove; rejects requeue at the original
    position with ``redelivered`` set -- except on quorum queues (``x-queue-type: quorum``),
    where a rejected message goes to the *tail* (what ``_pressure._put_back`` works around).
    An unknown or repeated delivery tag is a 406: the channel closes, nothing of the
    transaction applies, and the flow is aborted (:class:`UnknownDeliveryTagError`).
  - ``CloseSession``, and a connection closing (a crash, :meth:`PressureModel.close_connection`),
    requeue every unacknowledged delivery of the channel at its original position with
    ``redelivered`` set (quorum queues too), cancel its consumer and discard its uncommitted
    actions (there are none to discard here: ``Commit`` is one atomic step, so a crash falls
    *between* two operations).
  - A deleted queue cancels its consumers (``Take(stream=True)`` then answers ``GONE`` once the
    buffer is empty -- credits already delivered stay in the buffer, as in the client library);
    unacknowledged deliveries of a deleted queue are forgotten (an ack is a no-op, a requeue
    drops them). A queue declared again under the same name is a new queue.

* ``Inspect`` answers ``QueueInfo(ready, consumers)`` or ``None``; ``ReadAll`` takes every
  ready message and puts them back (redelivered), answering the bodies, or ``None``.
  ``PublishConfirmed`` to a missing queue fails the flow (``BrokerUnavailableError``), as the
  pika driver does.

**Blocking.** A ``Take`` that would wait (nothing there, ``wait != 0``) is *blocked*: the
model refuses to execute it (:meth:`PressureModel.blocked`). :func:`run_pressure` then lets the
wait pass (the fake clock advances by ``wait``; the answer is ``None``), or fails the test for
``wait=None``. :class:`PressureInterleaver` treats a blocked flow as not runnable until a
message arrives or the queue disappears, and offers :meth:`PressureInterleaver.time_out` so a
test (or hypothesis) can choose when its wait runs out.

**Split reads.** In RabbitMQ ``ReadAll`` is not atomic: the reader holds the messages between
its ``basic.get`` calls and its ``nack``. With ``split_reads=True`` a :class:`PressureRun`
executes it in two steps (take everything ready; later, put it back and answer), and other
flows may act in between. By default it is atomic.

**Not modelled**: broker restarts or a commit half-applied by a broker crash; publisher
confirms that nack; consumer cancels while a ``Take(stream=False)`` waits (a deleted queue
answers ``GONE`` through the 404 path instead, which closes the session -- the flows then only
close it); a connection's death taking effect in steps (the model drops its exclusive queues
and requeues its deliveries in one step, whereas RabbitMQ does these in separate processes);
other quorum-queue specifics (delivery counts, leader elections).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from broker_model import BrokerModel, FlowRun, Interleaver, Record

from amqp_locks import _pressure as P
from amqp_locks import errors
from amqp_locks._pressure import (
    GONE,
    Ack,
    CloseSession,
    Commit,
    Delivery,
    Inspect,
    OpenSession,
    Publish,
    PublishConfirmed,
    QueueInfo,
    ReadAll,
    Reject,
    Subscribe,
    Take,
)

__all__ = [
    "CommitEffect",
    "Message",
    "PressureInterleaver",
    "PressureModel",
    "PressureRun",
    "Session",
    "UnknownDeliveryTagError",
    "run_pressure",
]


class UnknownDeliveryTagError(errors.BrokerError):
    """406 PRECONDITION_FAILED: an ack or reject of a tag the channel does not hold."""


@dataclass(eq=False)
class Message:
    body: bytes
    kind: str | None  # the AMQP ``type`` property (None for confirmed publishes)
    message_id: str | None
    headers: dict[str, Any]
    seq: int
    redelivered: bool = False

    def delivery(self, tag: int) -> Delivery:
        return Delivery(
            tag=tag,
            body=self.body,
            redelivered=self.redelivered,
            kind=self.kind or P.ITEM,
            message_id=self.message_id,
            headers=dict(self.headers),
        )


class Queue:
    """One incarnation of a queue: deleting it and declaring the name again makes another."""

    def __init__(self, name: str, arguments: dict[str, Any]) -> None:
        self.name = name
        self.arguments = dict(arguments)
        self.ready: list[Message] = []

    @property
    def max_length(self) -> int | None:
        value = self.arguments.get("x-max-length")
        return None if value is None else int(value)

    def publish(self, message: Message) -> None:
        self.ready.append(message)
        cap = self.max_length
        if cap is not None and len(self.ready) > cap:
            del self.ready[: len(self.ready) - cap]  # drop-head

    @property
    def quorum(self) -> bool:
        return self.arguments.get("x-queue-type") == "quorum"

    def requeue(self, message: Message, *, rejected: bool = False) -> None:
        """Back to its original position; a *rejected* message of a quorum queue to the tail."""
        message.redelivered = True
        if rejected and self.quorum:
            self.ready.append(message)
            return
        at = len(self.ready)
        for i, other in enumerate(self.ready):
            if other.seq > message.seq:
                at = i
                break
        self.ready.insert(at, message)

    def __repr__(self) -> str:
        return f"<Queue {self.name} ready={len(self.ready)}>"


@dataclass(eq=False)
class Unacked:
    queue: Queue
    message: Message
    via_stream: bool


@dataclass(eq=False)
class Stream:
    queue: Queue
    prefetch: int
    gone: bool = False


class Session:
    """A transactional channel of one connection (or, ``hidden``, a pooled channel reading)."""

    def __init__(self, number: int, conn: str, *, hidden: bool = False) -> None:
        self.number = number
        self.conn = conn
        self.hidden = hidden
        self.closed = False
        self.close_reason: str | None = None  # "not_found", "closed", "connection", "406"
        self.unacked: dict[int, Unacked] = {}
        self.buffer: deque[Delivery] = deque()
        self.stream: Stream | None = None
        self._tags = itertools.count(1)

    def next_tag(self) -> int:
        return next(self._tags)

    def stream_unacked(self) -> int:
        return sum(1 for u in self.unacked.values() if u.via_stream)

    def __repr__(self) -> str:
        state = f" closed:{self.close_reason}" if self.closed else ""
        return f"<Session {self.number} of {self.conn}{state}>"


@dataclass(frozen=True)
class CommitEffect:
    """What one committed transaction did (for checking stats and order)."""

    seq: int  # of its Record in the log
    conn: str
    flow: str | None
    session: int
    published: tuple[tuple[str, Message], ...]  # routed publishes, in order
    returned: tuple[str, ...]
    acked: tuple[tuple[str, Message], ...]  # (queue name, message), live queues only
    rejected: tuple[tuple[str, Message], ...]
    #: "all" (atomic), or, with split commits, "route" (publishes) then "settle" (acks).
    phase: str = "all"
    actions: tuple[Any, ...] = ()

    def publishes(self, queue: str, kind: str | None = None) -> list[Message]:
        return [
            m
            for q, m in self.published
            if q == queue and (kind is None or (m.kind or P.ITEM) == kind)
        ]

    def acks(self, queue: str, kind: str | None = None) -> list[Message]:
        return [
            m for q, m in self.acked if q == queue and (kind is None or (m.kind or P.ITEM) == kind)
        ]


#: The answer logged for the first half of a split commit (publishes routed, acks pending).
ROUTED = "routed"


@dataclass(eq=False)
class Routed:
    """A commit whose publishes are routed and whose acks and rejects are not applied yet."""

    op: Commit
    conn: str
    flow: str | None
    returned: tuple[str, ...]


@dataclass(eq=False)
class Job:
    """A commit sent without waiting (``wait=False``), not yet done by the broker."""

    number: int
    op: Commit
    conn: str
    flow: str | None
    routed: Routed | None = None

    @property
    def name(self) -> str:
        return f"job{self.number}"


@dataclass
class _Read:
    session: Session
    queue: Queue
    taken: list[int]


@dataclass
class PressureModel(BrokerModel):
    """The semaphore model plus message-bearing queues, sessions and transactions."""

    #: Live queue incarnations by name (created lazily for every declared queue).
    queues: dict[str, Queue] = field(default_factory=dict)
    sessions: list[Session] = field(default_factory=list)
    commits: list[CommitEffect] = field(default_factory=list)
    #: Log positions of operations the client answered by itself (no round trip).
    local: set[int] = field(default_factory=set)
    #: Split commits: routed, not yet settled.
    in_flight: list[Routed] = field(default_factory=list)
    #: Commits sent without waiting, in the order sent (see :meth:`defer`).
    jobs: list[Job] = field(default_factory=list)
    _job_numbers: Any = field(default_factory=lambda: itertools.count(1), repr=False)
    _seq: Any = field(default_factory=lambda: itertools.count(1), repr=False)
    _session_numbers: Any = field(default_factory=lambda: itertools.count(1), repr=False)
    _flow: str | None = field(default=None, repr=False)
    _served_locally: bool = field(default=False, repr=False)

    # -- executing operations --------------------------------------------------------------------

    def execute(self, op: Any, conn: str, *, flow: str | None = None) -> Any:
        assert not self.blocked(op), f"{op!r} would wait: time it out or wait for a message"
        self._flow, self._served_locally = flow, False
        try:
            return super().execute(op, conn, flow=flow)
        finally:
            if self._served_locally:
                self.local.add(len(self.log) - 1)
            self._dispatch()

    def _execute(self, op: Any, conn: str) -> Any:
        if isinstance(op, Inspect):
            queue = self.queue(op.queue)
            if queue is None:
                return None
            consumers = sum(
                1
                for s in self.sessions
                if not s.closed
                and s.stream is not None
                and s.stream.queue is queue
                and not s.stream.gone
            )
            return QueueInfo(len(queue.ready), consumers)
        if isinstance(op, ReadAll):
            read = self.read_begin(op.queue, conn)
            return None if read is None else self.read_end(read)
        if isinstance(op, PublishConfirmed):
            queue = self.queue(op.queue)
            if queue is None:
                raise errors.BrokerUnavailableError(
                    f"the broker did not take the publishes to {op.queue!r} (queue missing)"
                )
            for body in op.bodies:
                queue.publish(self._message(body, None, None, None))
            return None
        if isinstance(op, OpenSession):
            session = Session(next(self._session_numbers), conn)
            self.sessions.append(session)
            return session
        if isinstance(op, CloseSession):
            self.close_session(op.session, "closed")
            return None
        if isinstance(op, Subscribe):
            return self._subscribe(op)
        if isinstance(op, Take):
            return self._take(op)
        if isinstance(op, Commit):
            return self._commit(op, conn)
        return super()._execute(op, conn)

    def _log(
        self,
        conn: str,
        op: Any,
        result: Any = None,
        *,
        error: BaseException | None = None,
        flow: str | None = None,
    ) -> None:
        """Log an operation executed outside :meth:`execute` (split steps, time-outs)."""
        self.log.append(Record(len(self.log), conn, op, result, error=error, flow=flow))

    def _message(
        self, body: bytes, kind: str | None, message_id: str | None, headers: Any
    ) -> Message:
        return Message(bytes(body), kind, message_id, dict(headers or {}), next(self._seq))

    @staticmethod
    def _closed_answer(op: Any, session: Session) -> Any:
        """What the driver answers for an operation on a channel that is already closed."""
        if isinstance(op, (Take, Subscribe)) and session.close_reason == "not_found":
            return GONE
        raise errors.BrokerUnavailableError(
            f"session channel closed ({session.close_reason}) before {type(op).__name__}"
        )

    def _subscribe(self, op: Subscribe) -> Any:
        session: Session = op.session
        if session.closed:
            return self._closed_answer(op, session)
        queue = self.queue(op.queue)
        if queue is None:
            self.close_session(session, "not_found")
            return GONE
        assert session.stream is None, "one Subscribe per session"
        session.stream = Stream(queue, op.prefetch)
        return None

    def _get(self, session: Session, queue: Queue) -> Delivery | None:
        if not queue.ready:
            return None
        message = queue.ready.pop(0)
        tag = session.next_tag()
        session.unacked[tag] = Unacked(queue, message, via_stream=False)
        return message.delivery(tag)

    def _take(self, op: Take) -> Any:
        session: Session = op.session
        if session.closed:
            self._served_locally = True
            return self._closed_answer(op, session)
        if op.stream:
            if session.buffer:
                self._served_locally = True
                return session.buffer.popleft()
            if session.stream is not None and session.stream.gone:
                self._served_locally = True
                return GONE
            assert op.wait == 0
        queue = self.queue(op.queue)
        if queue is None:
            self.close_session(session, "not_found")  # basic.get on a missing queue: 404
            return GONE
        return self._get(session, queue)

    def _commit(self, op: Commit, conn: str) -> tuple[str, ...]:
        self._check_commit(op)
        published, returned = self._route(op)
        acked, rejected = self._settle(op)
        self._effect(op, conn, self._flow, "all", published, returned, acked, rejected)
        return self._answer(op, returned)

    @staticmethod
    def _answer(op: Commit, returned: tuple[str, ...]) -> tuple[str, ...]:
        # Sent without waiting: the flow is answered at once, and learns of nothing returned.
        return returned if op.wait else ()

    def _check_commit(self, op: Commit) -> None:
        session: Session = op.session
        if session.closed:
            self._closed_answer(op, session)  # raises
        tags = [a.tag for a in op.actions if isinstance(a, (Ack, Reject))]
        bad = [t for t in tags if t not in session.unacked]
        bad += [t for t in set(tags) if tags.count(t) > 1]
        if bad:
            self.close_session(session, "406")
            raise UnknownDeliveryTagError(f"unknown delivery tag(s) {sorted(set(bad))}")

    def _route(self, op: Commit) -> tuple[list[tuple[str, Message]], tuple[str, ...]]:
        published: list[tuple[str, Message]] = []
        returned: list[str] = []
        for action in op.actions:
            if isinstance(action, Publish):
                queue = self.queue(action.queue)
                if queue is None:
                    returned.append(action.queue)
                    continue
                message = self._message(action.body, action.kind, action.message_id, action.headers)
                queue.publish(message)
                published.append((queue.name, message))
        return published, tuple(returned)

    def _settle(self, op: Commit) -> tuple[list[tuple[str, Message]], list[tuple[str, Message]]]:
        session: Session = op.session
        acked: list[tuple[str, Message]] = []
        rejected: list[tuple[str, Message]] = []
        for action in op.actions:
            if isinstance(action, (Ack, Reject)):
                held = session.unacked.pop(action.tag, None)
                if held is None or not self.alive(held.queue):
                    continue  # gone with its queue
                if isinstance(action, Ack):
                    acked.append((held.queue.name, held.message))
                else:
                    held.queue.requeue(held.message, rejected=True)
                    rejected.append((held.queue.name, held.message))
        return acked, rejected

    def _effect(
        self,
        op: Commit,
        conn: str,
        flow: str | None,
        phase: str,
        published: Any,
        returned: Any,
        acked: Any,
        rejected: Any,
    ) -> None:
        self.commits.append(
            CommitEffect(
                seq=len(self.log),
                conn=conn,
                flow=flow,
                session=op.session.number,
                published=tuple(published),
                returned=tuple(returned),
                acked=tuple(acked),
                rejected=tuple(rejected),
                phase=phase,
                actions=op.actions,
            )
        )

    # -- commits in two steps, and commits sent without waiting ----------------------------------

    def commit_begin(self, op: Commit, conn: str, *, flow: str | None = None) -> Routed:
        """The first half of a commit: its publishes are routed (what ``tx.commit`` does
        first); its acks and rejects wait for :meth:`commit_end`. Other clients may act in
        between -- and take what was just published."""
        assert not self.blocked(op), f"{op!r} waits for an earlier commit of its session"
        try:
            self._check_commit(op)
        except errors.BrokerError as exc:
            self._log(conn, op, error=exc, flow=flow)
            raise
        published, returned = self._route(op)
        self._effect(op, conn, flow, "route", published, returned, (), ())
        self._log(conn, op, ROUTED, flow=flow)
        routed = Routed(op, conn, flow, returned)
        self.in_flight.append(routed)
        self._dispatch()
        return routed

    def commit_end(self, routed: Routed) -> tuple[str, ...]:
        """The second half: acks and rejects applied; the answer (Commit-Ok) comes back."""
        self.in_flight.remove(routed)
        acked, rejected = self._settle(routed.op)
        self._effect(routed.op, routed.conn, routed.flow, "settle", (), (), acked, rejected)
        answer = self._answer(routed.op, routed.returned)
        self._log(routed.conn, routed.op, answer, flow=routed.flow)
        self._dispatch()
        return answer

    def defer(self, op: Commit, conn: str, *, flow: str | None = None) -> Job:
        """``Commit(wait=False)`` sent: the broker does it later (:meth:`job_step`); the
        session's later operations wait for it (:meth:`blocked`), as in the drivers."""
        assert not op.wait
        job = Job(next(self._job_numbers), op, conn, flow)
        self.jobs.append(job)
        return job

    def ready_jobs(self) -> list[Job]:
        """The oldest job of each session: the ones the broker can do next."""
        first: dict[int, Job] = {}
        for job in self.jobs:
            first.setdefault(id(job.op.session), job)
        return list(first.values())

    def job_step(self, job: Job) -> None:
        """Route the job's commit, or settle it (then it is done)."""
        assert job in self.ready_jobs(), f"{job.name} waits for an earlier commit"
        if job.routed is None:
            session: Session = job.op.session
            try:
                self._check_commit(job.op)
            except errors.BrokerError as exc:
                # The driver only logs it; the session's next operation reports the failure.
                self._log(job.conn, job.op, error=exc, flow=job.flow)
                self.jobs.remove(job)
                assert session.closed
                return
            published, returned = self._route(job.op)
            self._effect(job.op, job.conn, job.flow, "route", published, returned, (), ())
            self._log(job.conn, job.op, ROUTED, flow=job.flow)
            job.routed = Routed(job.op, job.conn, job.flow, returned)
            self.in_flight.append(job.routed)
            self._dispatch()
        else:
            self.commit_end(job.routed)
            self.jobs.remove(job)

    # -- blocking --------------------------------------------------------------------------------

    def blocked(self, op: Any) -> bool:
        """Would ``op`` wait: for a message (a Take with nothing to deliver yet and
        ``wait != 0``), or for a commit its session sent without waiting?"""
        return self.session_busy(op) or self.waiting_for_message(op)

    def session_busy(self, op: Any) -> bool:
        session = getattr(op, "session", None)
        return session is not None and any(j.op.session is session for j in self.jobs)

    def waiting_for_message(self, op: Any) -> bool:
        if not isinstance(op, Take) or op.wait == 0:
            return False
        session: Session = op.session
        if session.closed:
            return False
        if op.stream:
            if session.buffer:
                return False
            return session.stream is None or not session.stream.gone
        queue = self.queue(op.queue)
        return queue is not None and not queue.ready

    def expire(self, op: Take, conn: str, *, flow: str | None = None) -> None:
        """A blocked Take whose wait runs out: the clock advances by ``wait``; answer None."""
        assert self.waiting_for_message(op), f"{op!r} is not waiting for a message"
        assert not self.session_busy(op), f"{op!r} waits for an earlier commit"
        assert op.wait is not None, f"{op!r} waits forever"
        self.now_ += op.wait
        self._log(conn, op, None, flow=flow)
        return None

    # -- reads (ReadAll, atomic or in two steps) --------------------------------------------------

    def read_begin(self, name: str, conn: str) -> _Read | None:
        """basic.get every ready message on a pooled channel of ``conn``; None if missing."""
        queue = self.queue(name)
        if queue is None:
            return None
        session = Session(next(self._session_numbers), conn, hidden=True)
        self.sessions.append(session)
        taken = []
        while queue.ready:
            delivery = self._get(session, queue)
            assert delivery is not None
            taken.append(delivery.tag)
        return _Read(session, queue, taken)

    def read_end(self, read: _Read) -> tuple[bytes, ...]:
        """nack(requeue) what ``read_begin`` took; the bodies, oldest first."""
        session = read.session
        bodies = tuple(session.unacked[t].message.body for t in read.taken)
        self.close_session(session, "closed")  # requeues them all, redelivered
        self.sessions.remove(session)
        return bodies

    def finish_read(self, read: _Read, op: ReadAll, conn: str, *, flow: str | None) -> Any:
        bodies = self.read_end(read)
        self._log(conn, op, bodies, flow=flow)
        self._dispatch()
        return bodies

    # -- sessions and connections ----------------------------------------------------------------

    def close_session(self, session: Session, reason: str) -> None:
        """The channel closes: its unacked deliveries go back to where they were, redelivered."""
        if session.closed:
            return
        session.closed = True
        session.close_reason = reason
        held = sorted(session.unacked.values(), key=lambda u: u.message.seq)
        session.unacked.clear()
        session.buffer.clear()
        session.stream = None
        for u in held:
            if self.alive(u.queue):
                u.queue.requeue(u.message)
        self._dispatch()

    def close_connection(self, conn: str) -> None:
        """The connection closed or died: exclusive queues go, every channel closes.

        Commits the broker had received (split commits half done, commits sent without
        waiting) are done first: a channel processes its frames in order before it closes.
        """
        for routed in [r for r in self.in_flight if r.conn == conn and r.op.wait]:
            self.commit_end(routed)
        while any(j.conn == conn for j in self.jobs):
            self.job_step(next(j for j in self.ready_jobs() if j.conn == conn))
        super().close_connection(conn)
        for session in [s for s in self.sessions if s.conn == conn]:
            self.close_session(session, "connection")
            if session.hidden:
                self.sessions.remove(session)

    def _drop(self, queue: str) -> None:
        super()._drop(queue)
        gone = self.queues.pop(queue, None)
        if gone is None:
            return
        for session in self.sessions:
            if session.stream is not None and session.stream.queue is gone:
                session.stream.gone = True  # basic.cancel from the broker

    def _dispatch(self) -> None:
        """Push ready messages to subscribed sessions, up to their prefetch."""
        for session in self.sessions:
            stream = session.stream
            if session.closed or stream is None or stream.gone or not self.alive(stream.queue):
                continue
            while stream.queue.ready and session.stream_unacked() < stream.prefetch:
                message = stream.queue.ready.pop(0)
                tag = session.next_tag()
                session.unacked[tag] = Unacked(stream.queue, message, via_stream=True)
                session.buffer.append(message.delivery(tag))

    # -- inspecting state ------------------------------------------------------------------------

    def queue(self, name: str) -> Queue | None:
        """The live incarnation of ``name`` (made on first use for any declared queue)."""
        if not self.exists(name):
            return None
        queue = self.queues.get(name)
        if queue is None:
            queue = self.queues[name] = Queue(name, self.durable.get(name, {}))
        return queue

    def alive(self, queue: Queue) -> bool:
        return self.queues.get(queue.name) is queue

    def held(self, name: str) -> list[Message]:
        """Messages of ``name`` delivered on open channels and not yet settled."""
        queue = self.queues.get(name)
        if queue is None:
            return []
        return [
            u.message
            for s in self.sessions
            if not s.closed
            for u in s.unacked.values()
            if u.queue is queue
        ]

    def ready(self, name: str) -> list[Message]:
        queue = self.queue(name)
        return [] if queue is None else list(queue.ready)

    def everything(self, name: str) -> list[Message]:
        """Ready and held messages of ``name``, in queue order (by original position)."""
        return sorted(self.ready(name) + self.held(name), key=lambda m: m.seq)

    def count(self, name: str, kind: str | None = None) -> int:
        return sum(1 for m in self.everything(name) if kind is None or (m.kind or P.ITEM) == kind)

    def record(self, name: str, kind: type[P.R]) -> P.R | None:
        """The newest record in ``name``, ready or held by a reader."""
        return P.decode(kind, [m.body for m in self.everything(name)])

    def broker_ops(self, *, conn: str | None = None, since: int = 0) -> list[Any]:
        """Executed operations that cost a round trip (not those the client answered itself)."""
        return [
            r.op
            for r in self.log[since:]
            if r.seq not in self.local and (conn is None or r.conn == conn)
        ]

    def round_trips(self, *, conn: str | None = None, since: int = 0) -> list[Any]:
        """Executed operations a flow waited for: neither answered by the client itself nor
        commits sent without waiting (``Commit(wait=False)``)."""
        return [
            op
            for op in self.broker_ops(conn=conn, since=since)
            if not (isinstance(op, Commit) and not op.wait)
        ]

    def open_sessions(self, conn: str | None = None) -> list[Session]:
        return [
            s for s in self.sessions if not s.closed and not s.hidden and conn in (None, s.conn)
        ]


# ------------------------------------------------------------------------------------------------
# Drivers
# ------------------------------------------------------------------------------------------------


class PressureRun(FlowRun):
    """A flow on the pressure model: knows blocked Takes, split reads and split commits."""

    def __init__(
        self,
        name: str,
        flow: Any,
        conn: str,
        *,
        split_reads: bool = False,
        split_commits: bool = False,
    ) -> None:
        self.split_reads = split_reads
        self.split_commits = split_commits
        self.reading: _Read | None = None
        self.committing: Routed | None = None
        super().__init__(name, flow, conn)

    def midway(self) -> bool:
        return self.reading is not None or self.committing is not None

    def blocked(self, model: PressureModel) -> bool:
        return not self.done and not self.midway() and model.blocked(self.pending)

    def can_time_out(self, model: PressureModel) -> bool:
        if not self.blocked(model) or model.session_busy(self.pending):
            return False
        return getattr(self.pending, "wait", None) is not None

    def step(self, model: BrokerModel) -> None:
        assert isinstance(model, PressureModel)
        assert not self.done and self.pending is not None, f"{self.name} has finished"
        op = self.pending
        try:
            if self.reading is not None:
                read, self.reading = self.reading, None
                answer = model.finish_read(read, op, self.conn, flow=self.name)  # type: ignore[arg-type]
            elif self.committing is not None:
                routed, self.committing = self.committing, None
                answer = model.commit_end(routed)
            elif isinstance(op, ReadAll) and self.split_reads:
                self.reading = model.read_begin(op.queue, self.conn)
                if self.reading is not None:
                    return  # the messages are out; the next step puts them back and answers
                answer = model.execute(op, self.conn, flow=self.name)
            elif isinstance(op, Commit) and self.split_commits and op.wait:
                self.committing = model.commit_begin(op, self.conn, flow=self.name)
                return  # routed; the next step settles it and answers
            elif isinstance(op, Commit) and self.split_commits:
                model.defer(op, self.conn, flow=self.name)
                answer = ()  # sent; the broker does it when the interleaver says
            else:
                answer = model.execute(op, self.conn, flow=self.name)
        except errors.BrokerError as exc:
            self.abort(exc)
            return
        self._advance(lambda: self.flow.send(answer))

    def time_out(self, model: PressureModel) -> None:
        """Let the blocked Take's wait run out."""
        model.expire(self.pending, self.conn, flow=self.name)  # type: ignore[arg-type]
        self._advance(lambda: self.flow.send(None))


def _unblock(handle: PressureRun, model: PressureModel) -> None:
    """Get a blocked flow going without any other flow acting: the broker does the commits
    its session sent without waiting, or the Take's wait runs out."""
    session = getattr(handle.pending, "session", None)
    jobs = [j for j in model.ready_jobs() if j.op.session is session]
    if jobs:
        model.job_step(jobs[0])
    elif handle.can_time_out(model):
        handle.time_out(model)
    else:
        raise AssertionError(f"{handle!r} would wait forever")


def run_pressure(
    flow: Any,
    model: PressureModel,
    conn: str,
    *,
    name: str = "run",
    limit: int = 100_000,
) -> Any:
    """Drive ``flow`` to completion for ``conn``; return its value or raise its error.

    Reads and commits are atomic. A blocked Take waits its ``wait`` out on the fake clock
    (nobody else can act meanwhile); ``wait=None`` with nothing to take fails the test
    instead of hanging.
    """
    handle = PressureRun(name, flow, conn)
    for _ in range(limit):
        if handle.done:
            return handle.value()
        if handle.blocked(model):
            _unblock(handle, model)
        else:
            handle.step(model)
    raise AssertionError(f"flow did not finish in {limit} operations; last: {handle!r}")


class PressureInterleaver(Interleaver):
    """Several pressure flows on one model, one operation at a time, in a chosen order.

    A flow whose next operation is a blocked Take is not runnable (:meth:`runnable`) until a
    message arrives or its queue goes; :meth:`time_out` lets its wait run out instead.
    ``crash(conn)`` (inherited) aborts the connection's flows between two operations and
    closes the connection: its channels' deliveries go back, its exclusive queues go.

    ``split_reads``: a ReadAll takes two steps (see the module docstring). ``split_commits``:
    a Commit takes two steps -- its publishes are routed, then its acks and rejects applied,
    as RabbitMQ's ``tx.commit`` does them, with other flows acting in between; and a
    ``Commit(wait=False)`` becomes a job (:attr:`PressureModel.jobs`) the broker does later,
    in two steps of its own (:meth:`job_step`), while the flow goes on. A crash completes what
    the broker had received.
    """

    def __init__(
        self, model: PressureModel, *, split_reads: bool = False, split_commits: bool = False
    ) -> None:
        super().__init__(model)
        self.model = model
        self.split_reads = split_reads
        self.split_commits = split_commits

    def start(self, name: str, flow: Any, conn: str) -> FlowRun:
        assert name not in self.runs or self.runs[name].done, f"{name} is still running"
        self.runs[name] = handle = PressureRun(
            name, flow, conn, split_reads=self.split_reads, split_commits=self.split_commits
        )
        return handle

    def run_of(self, name: str) -> PressureRun:
        handle = self.runs[name]
        assert isinstance(handle, PressureRun)
        return handle

    def runnable(self) -> list[str]:
        return [n for n, r in self.runs.items() if not r.done and not self.blocked(n)]

    def blocked(self, name: str) -> bool:
        return self.run_of(name).blocked(self.model)

    def can_time_out(self, name: str) -> bool:
        return self.run_of(name).can_time_out(self.model)

    def time_out(self, name: str) -> FlowRun:
        handle = self.run_of(name)
        handle.time_out(self.model)
        return handle

    def step(self, name: str) -> FlowRun:
        assert not self.blocked(name), f"{name} is blocked on {self.pending(name)!r}"
        return super().step(name)

    def jobs(self) -> list[Job]:
        """Commits sent without waiting that the broker can do next."""
        return self.model.ready_jobs()

    def job_step(self, job: Job) -> None:
        self.model.job_step(job)

    def finish(self, name: str, *, limit: int = 10_000) -> Any:
        """Step ``name`` to completion (its session's jobs done, blocked waits run out)."""
        handle = self.run_of(name)
        for _ in range(limit):
            if handle.done:
                return handle.value()
            if handle.blocked(self.model):
                _unblock(handle, self.model)
            else:
                handle.step(self.model)
        raise AssertionError(f"{name} did not finish in {limit} steps")
