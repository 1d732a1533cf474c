"""Claiming work: keep every idle device covered by one outstanding long-poll
claim, and accept what the claims return.

The idle devices are split between up to ``claim_polls`` claims, each listing
the idle device ids it covers; a claim returns at most one assignment, for one
of its devices, so the agent never holds more assignments than idle devices,
and devices run their attempts in parallel. Errors back off exponentially with
jitter; a claim that comes back empty faster than ``min_poll_interval_s`` is
paced, so an idle agent never spins.

A device whose attempt is reporting its result is claimed for already: the
control plane frees and assigns it again at the result's commit, and the
assignment waits for the report's answer, then takes the device over (never
idle in between, never two attempts on it).

An accepted assignment is written to the journal (committed, fsynced) before
it is handed to the attempts; without a durable entry there is no ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

import structlog

from fleetlease.hostagent.config import FAILPOINT_AFTER_JOURNAL_ADD, FALLBACK_LEASE_S
from fleetlease.hostagent.devices import UnknownDevice
from fleetlease.hostagent.journal import JournalError, JournalRecord
from fleetlease.hostagent.retry import Backoff, sleep_or_event
from fleetlease.hostagent.session import Session
from fleetlease.hostagent.state import AgentState
from fleetlease.transport import wire
from fleetlease.transport.wire import RemoteError

__all__ = ["Claims", "StartAttempt"]

log = structlog.get_logger("fleetlease.agent")

#: Starts an accepted attempt (journaled, its device held): the record and the
#: claim's ack deadline.
StartAttempt = Callable[[JournalRecord, float | None], None]


class Claims:
    """The claim dispatcher of one agent and the claims it has in flight."""

    def __init__(self, state: AgentState, session: Session, *, start: StartAttempt) -> None:
        self._state = state
        self._config = state.config
        self._session = session
        self._start = start
        #: Claimable devices (idle, or releasing) covered by an outstanding
        #: claim -> that claim's number.
        self.covered: dict[str, int] = {}
        #: The claims sent and not answered yet: number -> the devices each
        #: lists. No device is listed by two of them.
        self.outstanding: dict[int, tuple[str, ...]] = {}
        self.polls: set[asyncio.Task[None]] = set()
        self._numbers = itertools.count(1)
        self._backoff = Backoff(
            self._config.backoff_base_s, self._config.backoff_cap_s, rng=state.rng
        )

    async def dispatch(self) -> None:
        """Keep every idle device covered by one outstanding claim."""
        state = self._state
        try:
            while not state.stopping.is_set():
                await self._session.wait_ready()
                state.wake.clear()
                devices_now = state.devices.snapshot()
                idle = {d.device_id for d in devices_now if d.state == "idle"}
                # A device whose attempt is reporting its result is claimed for
                # now: the control plane frees and assigns it again at the
                # result's commit, and a claim parked for it takes the new
                # assignment at once, not after the report's answer, the
                # journal clean-up and a new claim's round trip.
                claimable = (idle - state.held) | (state.releasing - state.handover.keys())
                uncovered = sorted(claimable - self.covered.keys())
                size = max(1, -(-len(devices_now) // self._config.claim_polls))
                for i in range(0, len(uncovered), size):
                    devices = uncovered[i : i + size]
                    number = next(self._numbers)
                    self.covered.update(dict.fromkeys(devices, number))
                    self.outstanding[number] = tuple(devices)
                    poll = asyncio.ensure_future(self._poll(devices, number))
                    self.polls.add(poll)
                    poll.add_done_callback(self.polls.discard)
                await sleep_or_event(3600.0, state.wake)  # a stop sets it too
        finally:
            await self.cancel_polls()

    async def cancel_polls(self) -> None:
        """Abandon the claims in flight."""
        for poll in list(self.polls):
            poll.cancel()
        if self.polls:
            await asyncio.gather(*list(self.polls), return_exceptions=True)

    def _uncover(self, devices: Iterable[str], number: int) -> None:
        """Those of ``devices`` still covered by claim ``number`` are not any more
        (a newer claim may cover some of them already: they stay its own)."""
        freed = False
        for d in devices:
            if self.covered.get(d) == number:
                del self.covered[d]
                freed = True
        if freed:
            self._state.wake.set()

    async def _poll(self, devices: list[str], number: int) -> None:
        cfg = self._config
        stopping = self._state.stopping
        loop = asyncio.get_running_loop()
        try:
            started = loop.time()
            try:
                try:
                    assignment = await self._session.call(
                        lambda c: c.claim(cfg.claim_wait_s, devices)
                    )
                finally:
                    self.outstanding.pop(number, None)  # answered, refused or cut short
            except RemoteError as exc:
                delay = self._backoff.next_delay()
                log.warning(
                    "claim_failed",
                    host_id=cfg.host_id,
                    code=exc.code,
                    error=exc.message,
                    retry_in_s=round(delay, 3),
                )
                await sleep_or_event(delay, stopping)
                return
            self._backoff.reset()
            if assignment is None:
                remaining = cfg.min_poll_interval_s - (loop.time() - started)
                if remaining > 0:
                    await sleep_or_event(remaining, stopping)
                return
            # The claim's other devices may be claimed for again at once, not
            # after this assignment's journal write: several tasks reaching one
            # host together do not wait for each other's. (``accept`` marks
            # the assigned device held before it first yields.)
            self._uncover(devices, number)
            await self.accept(assignment, devices)
        finally:
            self._uncover(devices, number)

    async def accept(self, a: wire.Assignment, devices: list[str]) -> None:
        """Take an assignment returned by the claim listing ``devices``: hold its
        device, journal it, start the attempt; or decline it (left unacked)."""
        state = self._state
        fields = {"task_id": a.task_id, "attempt": a.attempt, "device_id": a.device_id}
        handed = False
        if (
            a.device_id in devices
            and a.device_id in state.releasing
            and a.device_id not in state.handover
            and (a.task_id, a.attempt) not in state.attempts
        ):
            # The device's last attempt is still reporting: the control plane
            # assigned it again, so it has that result; wait for the report's
            # answer, then take the device over from it.
            await self._take_over(a.device_id)
            handed = True
        elif (
            a.device_id not in devices
            or a.device_id in state.held
            or (a.task_id, a.attempt) in state.attempts
        ):
            # Not ours to run: leave it unacked; the ack deadline returns it.
            log.warning("assignment_declined", reason="unexpected device", **fields)
            return
        try:
            state.mark(a.device_id, busy=True)
        except UnknownDevice:
            if handed:
                state.held.discard(a.device_id)
                state.wake.set()
            log.warning("assignment_declined", reason="unknown device", **fields)
            return
        state.held.add(a.device_id)
        record = JournalRecord(
            task_id=a.task_id,
            attempt=a.attempt,
            lease_id=a.lease_id,
            lease_token=a.lease_token,
            device_id=a.device_id,
            kind=a.kind,
            goal=a.goal,
            workflow=a.workflow,
            payload=dict(a.payload),
            lease_s=a.lease_s if a.lease_s > 0 else FALLBACK_LEASE_S,
            created_at=datetime.now(UTC),
        )
        journal = state.journal_or_fail()
        try:
            async with state.journal_lock:
                await state.journal_calls.call(journal.add, record)
        except JournalError as exc:
            # Without a durable entry there is no ack: the attempt returns to the
            # control plane at its ack deadline.
            log.error("journal_write_failed", error=exc.message, **fields)
            state.held.discard(a.device_id)
            state.mark(a.device_id, busy=False)
            return
        state.stats.assignments += 1
        log.info(
            "assignment_received",
            kind=str(a.kind),
            lease_id=a.lease_id,
            lease_s=a.lease_s,
            **fields,
        )
        state.failpoint(FAILPOINT_AFTER_JOURNAL_ADD, **fields)
        self._start(record, a.ack_deadline)

    async def _take_over(self, device_id: str) -> None:
        """Wait until the attempt reporting on ``device_id`` passes the device on
        (held and busy). Cancelled (the agent stops), it leaves the device to be
        freed as usual, or frees it if it was passed on already."""
        state = self._state
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        state.handover[device_id] = fut
        state.stats.handovers_waited += 1
        # The control plane has reserved the device for the new attempt: busy
        # again from now on (the finished run left it idle).
        with contextlib.suppress(UnknownDevice):
            state.mark(device_id, busy=True)
        try:
            await fut
        except asyncio.CancelledError:
            if state.handover.get(device_id) is fut:
                del state.handover[device_id]
            elif fut.done() and not fut.cancelled():
                with contextlib.suppress(UnknownDevice):
                    state.free(device_id)  # passed on to nobody now
            raise
