"""What the agent's collaborators share: the counters, the attempts this process
holds, the devices those hold, the journal, the events that wake the loops, and
the plumbing every part uses (background tasks, failpoints, device flips,
calls from runner threads)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from fleetlease.hostagent.config import AgentConfig
from fleetlease.hostagent.devices import DeviceManager
from fleetlease.hostagent.errors import AgentError, BrokerRefused, RegistrationRefused
from fleetlease.hostagent.journal import Journal, JournalRecord, JournalThread
from fleetlease.hostagent.retry import Backoff

__all__ = ["AgentState", "AgentStats", "Attempt"]

log = structlog.get_logger("fleetlease.agent")


@dataclass
class AgentStats:
    """Counters, for tests and ``agent_stopped``."""

    registrations: int = 0
    heartbeats_sent: int = 0
    assignments: int = 0
    results_reported: int = 0
    results_rejected: int = 0
    leases_lost: int = 0
    acks_given_up: int = 0
    handed_back: int = 0
    #: Assignments that arrived for a device whose last attempt was still
    #: reporting its result, and waited for that report's answer.
    handovers_waited: int = 0
    log_lines_sent: int = 0
    logs_dropped: int = 0
    artifacts_sent: int = 0
    artifacts_dropped: int = 0


@dataclass(eq=False)
class Attempt:
    """One attempt this process holds (running, reporting, or being resumed)."""

    record: JournalRecord
    ack_deadline: float | None = None
    #: Set on cancel request or handback: the runner's ``ctx.cancelled``.
    cancel_event: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when the lease is lost: stop and report nothing further.
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    lost_reason: str = ""
    cancel_requested: bool = False
    handback: bool = False
    reporting: bool = False
    #: The journal entry may go: reported, or known stale.
    entry_done: bool = False
    #: Set when a resumed attempt cannot run here (its device is gone, or it was
    #: resumed too often: it kills the agent).
    unrunnable: str | None = None
    #: Taken over from the journal after a restart (not claimed by this process).
    resumed: bool = False
    holds_device: bool = False
    log_seq: int = 0
    progress_seq: int = 0
    progress_message: str | None = None
    task: asyncio.Task[None] | None = None
    renewer: asyncio.Task[None] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.record.key

    def lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()


class AgentState:
    """The state the agent's session, claims, attempts and shipping share.

    Device bookkeeping: ``held`` devices run (or report) one of this process's
    attempts; ``releasing`` ones are held by an attempt reporting its result and
    are claimed for already; ``handover`` maps a releasing device to the next
    assignment's wait for it (the finished attempt passes the device on, still
    held and busy, instead of freeing it)."""

    def __init__(
        self,
        config: AgentConfig,
        devices: DeviceManager,
        *,
        journal: Journal | None,
        rng: random.Random,
    ) -> None:
        self.config = config
        self.devices = devices
        self.rng = rng
        self.stats = AgentStats()
        self.journal = journal
        #: Every journal call after the journal is open, in order, off the loop.
        self.journal_calls = JournalThread(f"fleetlease-journal-{config.host_id}")
        self.journal_lock = asyncio.Lock()
        self.attempts: dict[tuple[str, int], Attempt] = {}
        self.held: set[str] = set()
        self.releasing: set[str] = set()
        self.handover: dict[str, asyncio.Future[None]] = {}
        self.stopping = asyncio.Event()
        #: Wakes the claim dispatcher (a device freed, a session ready, a stop).
        self.wake = asyncio.Event()
        #: A device changed from outside: the heartbeat goes out at once.
        self.devices_changed = asyncio.Event()
        #: Set while the agent itself flips a device for one of its leases.
        self.lease_flip = False
        self.fatal: BaseException | None = None
        self.fatal_event = asyncio.Event()
        self.background: set[asyncio.Task[None]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None

    def backoff(self) -> Backoff:
        """A fresh backoff with the configured base and cap."""
        return Backoff(self.config.backoff_base_s, self.config.backoff_cap_s, rng=self.rng)

    def journal_or_fail(self) -> Journal:
        if self.journal is None:
            raise AgentError("journal is not open")
        return self.journal

    def bind_loop(self) -> None:
        """Called on the agent's loop as it starts."""
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.loop_thread

    def set_stopping(self) -> None:
        self.stopping.set()
        # The claim dispatcher waits for ``wake`` alone (one event: no waiter tasks).
        self.wake.set()

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        """A background task; its failure is fatal to the agent."""
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self.background.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self.background.discard(t)
            if t.cancelled():
                return
            exc = t.exception()
            if exc is not None:
                self.set_fatal(exc, where=name)

        task.add_done_callback(done)
        return task

    def set_fatal(self, exc: BaseException, *, where: str) -> None:
        if self.fatal is None:
            self.fatal = exc
            if not isinstance(exc, RegistrationRefused | BrokerRefused):
                log.error(
                    "agent_task_crashed",
                    task=where,
                    error_type=type(exc).__name__,
                    error=str(exc)[:500],
                    exc_info=exc,
                )
        self.fatal_event.set()

    def mark(self, device_id: str, *, busy: bool) -> None:
        """Mark a device busy (idle) as one of this agent's leases starts (ends).

        No heartbeat is sent for these flips: the control plane knows them from its
        device reservations (a result frees the device), and the periodic heartbeat
        carries the state anyway. Only changes from outside (a device attached,
        detached, gone offline) are sent at once."""
        self.lease_flip = True
        try:
            if busy:
                self.devices.mark_busy(device_id)
            else:
                self.devices.mark_idle(device_id)
        finally:
            self.lease_flip = False

    def free(self, device_id: str) -> None:
        """The held ``device_id`` is free again (idle, claimable)."""
        self.held.discard(device_id)
        self.mark(device_id, busy=False)
        self.wake.set()

    def in_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the agent's loop thread (now if already there)."""
        loop = self.loop
        if loop is None or self.on_loop_thread():
            fn()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(fn)

    def failpoint(self, name: str, **fields: Any) -> None:
        if name in self.config.failpoints:
            log.warning("agent_failpoint_kill", failpoint=name, **fields)
            os.kill(os.getpid(), signal.SIGKILL)
