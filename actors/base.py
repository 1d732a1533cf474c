"""What every fleetlease actor shares: the runtime context passed into its
constructor, an inbox that refuses (instead of silently dropping) messages once
the actor is gone, and the receive loop's error policy.

Error policy of :meth:`FleetActor.on_receive`:

* not a :class:`~actors.messages.Message`, or a type the actor does not handle,
  or a field of the wrong shape: ``Invalid`` reply (if there is a reply), logged,
  the actor keeps serving;
* a typed repository error: that error is the reply, the actor keeps serving and
  its cache is unchanged (handlers change their cache only after a commit);
* any other exception: ``Unavailable`` reply (retryable), logged, the actor keeps
  serving;
* :class:`~actors.failpoints.FailPointError` or :class:`CrashRequested`: the
  reply (if not already sent) is ``Unavailable`` and the exception escapes, so
  pykka calls ``on_failure`` and the supervisor starts a replacement that
  rebuilds its state from the database. This is how tests crash actors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import queue
import threading
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar

import pykka
import structlog
from pykka import ActorDeadError

from fleetlease.actors import failpoints
from fleetlease.actors.bridge import Bridge, Reply
from fleetlease.actors.messages import Crash, Message
from fleetlease.persistence.clock import Clock
from fleetlease.persistence.errors import Invalid, RepositoryError, Unavailable
from fleetlease.persistence.model import Assignment, LeaseStatus, TaskState
from fleetlease.persistence.repository import Renewal, Repository, Transition

if TYPE_CHECKING:
    from pykka._actor import ActorInbox
    from pykka._envelope import Envelope

    from fleetlease.actors.supervisor import Supervisor

log = structlog.get_logger("fleetlease.actors")


class CrashRequested(Exception):
    """A deliberate crash (the :class:`~actors.messages.Crash` message)."""


class NotDelivered(Unavailable):
    """The actor stopped before it handled the message: nothing was done, so the
    message may be re-sent (to the actor's replacement) as it is."""


#: How often a message the Lease actor never handled is re-sent to its replacement.
REDELIVERIES = 3


class Stats:
    """Thread-safe counters (assign calls, restarts, wake-ups, ...)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@dataclass(kw_only=True)
class Context:
    """Everything an actor needs, passed into its constructor (no globals).

    ``emit`` and ``wake_hosts`` are safe to call from any thread: they hop onto
    the event loop. ``renew`` is the coroutine factory used for renewals (group
    commit through ``renew_many`` when enabled), ``transition`` the one for the
    other host transitions."""

    repo: Repository
    bridge: Bridge
    clock: Clock
    db_timeout_s: float = 15.0
    assign_batch: int = 64
    expire_batch: int = 500
    reaper_max_sleep_s: float = 5.0
    reaper_idle_recheck_s: float = 1.0
    emit: Callable[[list[dict[str, Any]]], None] = lambda events: None
    #: ``emit`` for the event loop's own thread (no hop).
    emit_on_loop: Callable[[list[dict[str, Any]]], None] = lambda events: None
    #: Wake parked long-polls: host ids (every poll of the host),
    #: ``(host_id, device_id)`` pairs (the polls that may claim that device) or
    #: new assignments (each handed to one poll that may claim it).
    wake_hosts: Callable[[Iterable[str | tuple[str, str] | Assignment]], None] = lambda hosts: None
    renew: Callable[[Renewal], Coroutine[Any, Any, LeaseStatus]] | None = None
    #: Runs a fenced host transition (claim, ack, progress, result): group commit
    #: through ``run_many`` when enabled, else ``repo.run_one``.
    transition: Callable[[Transition], Coroutine[Any, Any, Any]] | None = None
    #: One assignment pass of ``limit`` on the loop: the assignments, and the
    #: task ids of those already claimed by a parked long-poll in the same
    #: transaction (their Lease actors, events and answers done). None:
    #: ``repo.assign`` alone.
    assign: Callable[[int], Coroutine[Any, Any, tuple[list[Assignment], frozenset[str]]]] | None = (
        None
    )
    stats: Stats = field(default_factory=Stats)
    supervisor: Supervisor | None = None

    @property
    def sup(self) -> Supervisor:
        if self.supervisor is None:
            raise RuntimeError("Context.supervisor is not set")
        return self.supervisor

    def db(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run a repository coroutine on the loop, from an actor thread."""
        return self.bridge.run(coro, self.db_timeout_s)

    def run_transition(self, t: Transition) -> Any:
        """Run a fenced host transition on the loop (committed when it returns),
        from an actor thread."""
        run = self.transition or self.repo.run_one
        return self.bridge.run(run(t), self.db_timeout_s)

    def hand_off(self, kind: str, t: Transition, reply: Reply[Any] | None, task_id: str) -> None:
        """From a Lease actor thread: run the fenced host transition ``t`` on the
        loop and return at once. The loop answers ``reply`` right after the
        commit, then tells the task's Lease actor (whichever is current then)
        :class:`~actors.messages.Committed`. Two thread hops fewer per claim, ack
        and result than :meth:`run_transition`: the actor does not wait for the
        commit, and the answer does not come back through it."""
        run = self.transition or self.repo.run_one
        if not self.bridge.spawn(self._commit_then_reply(kind, run(t), reply, task_id, t.host_id)):
            raise Unavailable("the event loop is closed")

    async def _commit_then_reply(
        self,
        kind: str,
        commit: Coroutine[Any, Any, Any],
        reply: Reply[Any] | None,
        task_id: str,
        host_id: str,
    ) -> None:
        from fleetlease.actors.messages import Committed, Crash

        def answer(value: Any, exc: BaseException | None = None) -> None:
            if reply is not None:
                reply.settle_on_loop(value, exc)

        try:
            async with asyncio.timeout(self.db_timeout_s):
                outcome = await commit
        except RepositoryError as exc:
            answer(None, exc)
            return
        except TimeoutError:
            # The outcome of the commit in flight is unknown: retryable, as
            # Bridge.run's timeout (writes are fenced, replays recorded).
            answer(None, Unavailable(f"no commit within {self.db_timeout_s} s; retry"))
            return
        except Exception as exc:
            log.error("lease.transition_error", error=repr(exc), exc_info=True, task_id=task_id)
            answer(None, Unavailable("internal error; retry"))
            return
        ref = self.supervisor.lease_for(task_id) if self.supervisor is not None else None
        try:
            failpoints.hit(failpoints.LEASE_AFTER_COMMIT_BEFORE_REPLY, may_pause=False)
        except failpoints.FailPointError as exc:
            # The actor crashes between the commit and the answer, as a bug
            # there would; the host gets the retryable Unavailable (the outcome
            # is unknown to it) and its retry is a replay, or reaches the
            # replacement.
            _tell(ref, Crash(reason=str(exc)))
            answer(None, Unavailable("the actor crashed; retry"))
            return
        answer(outcome)
        # The transition's event, here rather than by the actor (one thread hop
        # fewer): a claim always moved its task, an ack or a result unless it
        # was a replay. (A progress report's is the actor's: only its cache
        # tells whether the state changed.)
        state = _moved_to(kind, outcome)
        if state is not None:
            self.emit_on_loop(
                [self.event(task_id=task_id, state=state, attempt=outcome.attempt, host_id=host_id)]
            )
        _tell(ref, Committed(kind=kind, outcome=outcome))

    def event(
        self, *, task_id: str, state: str, attempt: int, host_id: str | None
    ) -> dict[str, Any]:
        return {
            "task_id": task_id,
            "state": str(state),
            "attempt": attempt,
            "host_id": host_id,
            "at": self.clock.now().isoformat(),
        }


def _moved_to(kind: str, outcome: Any) -> str | None:
    """The state a committed claim, ack or result moved its task to (None: it
    was a replay, or another kind: no event from the loop)."""
    if kind == "claim":
        return str(TaskState.DISPATCHED)
    if kind == "ack":
        return str(outcome.state) if outcome.moved else None
    if kind == "result":
        return None if outcome.replayed else str(outcome.state)
    return None


def _tell(ref: pykka.ActorRef[Any] | None, message: Message) -> bool:
    if ref is None:
        return False
    try:
        ref.tell(message)
    except ActorDeadError:
        return False
    return True


def _refuse(envelope: Envelope[Any], reason: str) -> None:
    """Answer a message that will never be handled: asks get ``ActorDeadError``
    (as pykka does), our ``Reply`` gets the retryable ``Unavailable``."""
    message = envelope.message
    if isinstance(message, Message) and message.reply is not None:
        message.reply.set_exception(NotDelivered(reason))
    if envelope.reply_to is not None:
        with contextlib.suppress(queue.Full):  # already answered
            envelope.reply_to.set_exception(exc_info=(ActorDeadError, ActorDeadError(reason), None))


class ClosableInbox:
    """pykka's inbox (a queue) plus ``close()``: once the actor is stopping,
    every queued and every later message is answered at once with a retryable
    error instead of being dropped. pykka's own teardown drops ``tell``
    messages, and a ``Reply`` inside one would then only fail by timeout."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Envelope[Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self.reason = "actor stopped; retry"

    def put(self, envelope: Envelope[Any], /) -> None:
        with self._lock:
            if not self._closed:
                self._queue.put(envelope)
                return
        _refuse(envelope, self.reason)

    def get(self) -> Envelope[Any]:
        return self._queue.get()

    def empty(self) -> bool:
        return self._queue.empty()

    def qsize(self) -> int:
        return self._queue.qsize()

    def close(self, reason: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.reason = reason
            pending: list[Envelope[Any]] = []
            while not self._queue.empty():
                pending.append(self._queue.get_nowait())
        for envelope in pending:
            _refuse(envelope, reason)


# ``threading.Thread.start`` waits until the new thread runs, and it runs only
# once it gets the GIL, which a busy event loop holds: the Scheduler would spend
# that wait between an assignment's commit and waking the host. Lease actors are started on these
# threads instead, several at once; messages sent meanwhile wait in the inbox.
_STARTERS = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="actor-start")


class ActorThreads:
    """The threads Lease actors run on. A thread whose actor stopped waits up
    to ``idle_s`` for the next actor instead of ending, so a Lease actor (one per
    task in flight) usually starts on a thread that exists: a thread started and
    ended for every task. Daemon threads, as pykka's: a thread never keeps the
    interpreter alive."""

    def __init__(self, idle_s: float = 10.0) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._next: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._numbers = itertools.count(1)
        #: Threads started, and actors run on a thread that ran one before.
        self.started = 0
        self.reused = 0

    @property
    def idle(self) -> int:
        """Threads waiting for an actor."""
        with self._lock:
            return self._idle

    def run(self, actor_loop: Callable[[], None]) -> bool:
        """Hand ``actor_loop`` to an idle thread: False when none is idle (the
        caller starts one with :meth:`start`)."""
        with self._lock:
            if not self._idle:
                return False
            self._idle -= 1
            self.reused += 1
            self._next.put(actor_loop)
            return True

    def start(self, actor_loop: Callable[[], None]) -> None:
        """A new thread that runs ``actor_loop``, then the next ones handed over
        (waits until it holds the GIL: call it off the event loop)."""
        thread = threading.Thread(
            target=self._work,
            args=(actor_loop,),
            name=f"lease-actor-{next(self._numbers)}",
            daemon=True,
        )
        thread.start()
        with self._lock:
            self.started += 1

    def _work(self, actor_loop: Callable[[], None] | None) -> None:
        while actor_loop is not None:
            try:
                actor_loop()
            except Exception as exc:  # pykka's loop handles its own; never lose the thread
                log.error("actor.loop_error", error=repr(exc))
            actor_loop = self._wait()

    def _wait(self) -> Callable[[], None] | None:
        with self._lock:
            self._idle += 1
        try:
            return self._next.get(timeout=self.idle_s)
        except queue.Empty:
            with self._lock:
                # One may have been handed over since: every hand-over counted
                # one idle thread out, and this one takes it.
                try:
                    return self._next.get_nowait()
                except queue.Empty:
                    self._idle -= 1
                    return None


LEASE_THREADS = ActorThreads()


class FleetActor(pykka.ThreadingActor):
    """Base of the Lease, Scheduler and Reaper actors."""

    # Daemon threads: an actor left running by a crashed test or a killed process
    # never keeps the interpreter alive; graceful shutdown is ControlPlane.stop().
    use_daemon_thread = True
    kind: ClassVar[str] = "actor"
    # Start the thread on ``_STARTERS`` rather than waiting for it (Lease actors).
    start_in_background: ClassVar[bool] = False

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self.ctx = ctx
        self._stopping_expected = False
        self._crash_reply: Reply[Any] | None = None
        self._handlers: dict[type[Message], Callable[[Any], None]] = {}

    @staticmethod
    def _create_actor_inbox() -> ActorInbox:
        return ClosableInbox()

    def _start_actor_loop(self) -> None:
        if not self.start_in_background:
            super()._start_actor_loop()
        elif not LEASE_THREADS.run(self._actor_loop):
            _STARTERS.submit(self._start_thread)

    def _start_thread(self) -> None:
        try:
            LEASE_THREADS.start(self._actor_loop)
        except Exception as exc:  # no thread to be had: as if it had stopped at once
            log.error("actor.start_failed", error=repr(exc), **self.describe())
            pykka.ActorRegistry.unregister(self.actor_ref)
            self.actor_stopped.set()
            self._inbox().close("the actor could not start; retry")

    def _inbox(self) -> ClosableInbox:
        inbox = self.actor_inbox
        assert isinstance(inbox, ClosableInbox)
        return inbox

    def handle(self, kind: type[Message], handler: Callable[[Any], None]) -> None:
        self._handlers[kind] = handler

    def stop_self(self) -> None:
        """Stop after the messages already queued (an expected stop: no restart)."""
        self._stopping_expected = True
        self.stop()

    def describe(self) -> dict[str, Any]:
        return {"actor": self.kind}

    # --- pykka hooks -------------------------------------------------------------------
    def on_receive(self, message: Any) -> Any:
        if self._crash_reply is not None:  # a crash inside an ask(): no on_failure came
            self._crash_reply.set_exception(Unavailable("the actor crashed; retry"))
            self._crash_reply = None
        if not isinstance(message, Message):
            log.warning("actor.bad_message", type=type(message).__name__, **self.describe())
            return None
        reply = message.reply if isinstance(message.reply, Reply) else None
        handler = self._handlers.get(type(message))
        try:
            if handler is None:
                raise Invalid(
                    f"{type(message).__name__} is not handled by {self.kind}", field="message"
                )
            message.validate()
            if isinstance(message, Crash):
                raise CrashRequested(message.reason or f"crash requested for {self.kind}")
            handler(message)
        except RepositoryError as exc:
            if isinstance(exc, Invalid):
                log.info(
                    "actor.invalid_message", error=exc.message, field=exc.field, **self.describe()
                )
            if reply is not None:
                reply.set_exception(exc)
        except (failpoints.FailPointError, CrashRequested) as exc:
            log.warning("actor.crash", reason=str(exc), **self.describe())
            # Answered in on_failure, once the replacement exists, so that an
            # immediate retry reaches the new actor rather than the dying one.
            self._crash_reply = reply
            raise
        except Exception as exc:
            log.error("actor.handler_error", error=repr(exc), exc_info=True, **self.describe())
            if reply is not None:
                reply.set_exception(Unavailable("internal error; retry"))
        return None

    def on_stop(self) -> None:
        self._inbox().close("actor stopped; retry")
        try:
            if self.ctx.supervisor is not None:
                self.ctx.supervisor.child_stopped(self, expected=self._stopping_expected)
        finally:
            self._let_go()

    def _let_go(self) -> None:
        """Drop the handler table: its bound methods hold the actor in a
        reference cycle, which left each finished Lease actor (about 30 objects)
        to the cyclic collector; with 10,000 leases ending together, one full
        collection of 0.47 s. Nothing is handled after a stop or a crash."""
        self._handlers.clear()

    def on_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._inbox().close("actor crashed; retry")
        try:
            if self.ctx.supervisor is not None:
                self.ctx.supervisor.child_failed(self, exception_value)
        finally:
            if self._crash_reply is not None:
                # The outcome of the crashed message is unknown (it may have
                # committed): plain Unavailable, not NotDelivered.
                self._crash_reply.set_exception(Unavailable("the actor crashed; retry"))
                self._crash_reply = None
            self._let_go()
