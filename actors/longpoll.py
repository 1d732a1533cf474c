"""The long-poll broker: hosts' parked claims and what wakes them.

A host asks for work with a long-poll claim (``ControlPlane.claim``). The
broker keeps each parked poll (``_Waiter``) per host, with the devices it claims
for and its session, and settles it with the first of: an assignment claimed for
it, the end of its wait, or the control plane stopping. It never polls the
database in a loop: a poll waits on a future that a new assignment, or a wake
notice from another control-plane process, completes.

* New assignments from the Scheduler are handed (``wake_hosts`` with an
  :class:`Assignment`) to one poll that may claim their device, which claims
  them without reading the pending ones first; with no poll parked for them
  they are kept (``_Kept``) for the host's next poll.
* An assignment pass (``assign_pass``, the Scheduler's ``Context.assign``) may
  claim a new assignment for a poll parked on its device in the transaction
  that assigns it.
* An empty read of a host's devices is trusted for ``_KNOWN_EMPTY_S``, for that
  session: every assignment made since came through the hand-off.

Every claim goes through the task's Lease actor (``Claim``); the facade owns
the actors, the request accounting and the event listeners, and the broker
reaches them through it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from pykka import ActorDeadError, ActorRef

from fleetlease.actors.base import REDELIVERIES, NotDelivered
from fleetlease.actors.lease import LeaseActor
from fleetlease.actors.messages import Claim, Committed
from fleetlease.persistence.errors import Conflict, Gone, Unavailable
from fleetlease.persistence.model import Assignment, Claimed, Session

if TYPE_CHECKING:
    from fleetlease.actors.runtime import ControlPlane

log = structlog.get_logger("fleetlease.runtime")

#: How long an empty read of a host's pending assignments on some devices is
#: trusted (see ``LongPollBroker.claim``).
_KNOWN_EMPTY_S = 1.0
#: Assignments kept per host that no long-poll was parked to take.
_UNHANDED_MAX = 1024
#: New assignments one long-poll holds at most (it claims one; the others are
#: its fallbacks if that claim loses a race). Past it they are kept for the
#: host's next polls: otherwise a host given a thousand assignments at once has
#: them spread over its few parked polls, and every claim sorts and hands back
#: hundreds of them.
_HINTS_PER_POLL = 2


class _Kept:
    """A host's assignments no long-poll was parked to take, in the order they
    were kept, indexed by device: taking a few costs a few, not a walk of the
    whole list (which may hold a thousand)."""

    __slots__ = ("by_device", "order")

    def __init__(self) -> None:
        self.order: dict[tuple[str, int], Assignment] = {}
        self.by_device: dict[str, dict[tuple[str, int], Assignment]] = {}

    def __len__(self) -> int:
        return len(self.order)

    def add(self, a: Assignment) -> None:
        key = (a.task_id, a.attempt)
        self.order[key] = a
        self.by_device.setdefault(a.device_id, {})[key] = a

    def take(self, wanted: frozenset[str] | None, limit: int) -> list[Assignment]:
        """At most ``limit`` that a poll for ``wanted`` (None: any device) may
        claim, removed: the first kept first, or, for a poll naming fewer
        devices than are kept, the earliest claim deadlines of its devices."""
        if limit <= 0 or not self.order:
            return []
        mine: list[Assignment] = []
        if wanted is not None and len(wanted) < len(self.order):
            for d in wanted:
                mine.extend(self.by_device.get(d, {}).values())
            mine.sort(key=lambda a: a.claim_deadline)
            del mine[limit:]
        else:
            for a in self.order.values():
                if wanted is None or a.device_id in wanted:
                    mine.append(a)
                    if len(mine) == limit:
                        break
        for a in mine:
            key = (a.task_id, a.attempt)
            del self.order[key]
            on_device = self.by_device[a.device_id]
            del on_device[key]
            if not on_device:
                del self.by_device[a.device_id]
        return mine


@dataclass(eq=False)
class _Waiter:
    """A parked long-poll: the devices it claims for (None: any device of the
    host), its session, and the new assignments ``wake_hosts`` handed to it to
    claim.

    While ``parked`` (waiting, nothing in hand), an assignment pass may take it
    as a claimer (``reserved``, see ``LongPollBroker.assign_pass``): the poll
    then waits for the pass to settle that future, and answers with
    ``claimed`` if the pass claimed an assignment for it."""

    wanted: frozenset[str] | None
    session: Session
    hints: list[Assignment] = field(default_factory=list)
    parked: bool = False
    reserved: asyncio.Future[None] | None = None
    claimed: Claimed | None = None
    #: The poll stopped waiting for good (cancelled): nothing can answer it.
    gone: bool = False

    @property
    def generation(self) -> int:
        return self.session.generation

    def may_claim(self, device_id: str) -> bool:
        return self.wanted is None or device_id in self.wanted


class LongPollBroker:
    """The parked long-polls of every host served by one ``ControlPlane``, and
    their wake-ups. Runs on the control plane's event loop only."""

    def __init__(self, cp: ControlPlane) -> None:
        self._cp = cp
        #: Parked long-polls per host: the future that wakes each, and what it
        #: may claim and was handed.
        self._waiters: dict[str, dict[asyncio.Future[None], _Waiter]] = {}
        self._host_wakeups = 0
        #: Assignments a long-poll of this process is claiming right now.
        self._claiming: set[tuple[str, int]] = set()
        #: New assignments ``_hand`` found no parked long-poll for, per host: the
        #: next poll of the host claims them without a read.
        self._unhanded: dict[str, _Kept] = {}
        #: Per host: the session generation and, per device, until when (loop
        #: time) this process knows the device has no pending assignment that is
        #: not in ``_unhanded`` or in a poll's hands (an empty read, and every
        #: assignment since passed through ``_hand``).
        self._known_empty: dict[str, tuple[int, dict[str, float]]] = {}
        #: Bumped whenever something known is forgotten: a read that overlapped
        #: a forget does not mark anything known.
        self._forgets = 0

    @property
    def parked(self) -> int:
        """Claims parked now, over every host."""
        return sum(len(w) for w in self._waiters.values())

    @property
    def host_wakeups(self) -> int:
        """How many long-poll waiters were woken by a new assignment."""
        return self._host_wakeups

    def release_all(self) -> None:
        """Wake every parked long-poll (stopping: each answers None)."""
        for waiters in self._waiters.values():
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    async def claim(
        self, session: Session, wait_s: float, device_ids: Sequence[str]
    ) -> Claimed | None:
        """Long-poll: an assignment of this host (on one of ``device_ids`` if
        given) claimed at once, or after the Scheduler signals a new one, or None
        after ``wait_s``. Never polls the database in a loop: it waits on a per-host
        future that the Scheduler's signal completes. A poll woken with new
        assignments (``wake_hosts``) claims them without reading the pending ones
        first; it reads only when none of them was left to claim.

        A fresh poll first takes the new assignments no poll was parked for when
        they were made (``_unhanded``). It skips the read when an empty read of
        its devices, for its session, is less than ``_KNOWN_EMPTY_S`` old: every
        assignment made since came through ``_hand`` (assignments of another
        process and a Scheduler rebuild wake the host by id, which forgets what
        was known). A poll that skipped the read parks no longer
        than that knowledge lasts, then reads: an assignment this process never
        heard of (its Scheduler crashed between commit and hand-off) waits at
        most that long."""
        # Each look checks the session: the read in its statement, a claim in
        # its transaction (Unauthorized if superseded).
        loop = self._cp.loop
        deadline = loop.time() + float(wait_s)
        host = session.host_id
        wanted = frozenset(device_ids) if device_ids else None
        # Assignments handed to this poll and not tried yet.
        hints: list[Assignment] = []
        claimed: Claimed | None = None
        try:
            while True:
                # Register before looking, so a signal between the look and the
                # wait is not lost.
                woken: asyncio.Future[None] = loop.create_future()
                waiter = _Waiter(wanted, session)
                self._waiters.setdefault(host, {})[woken] = waiter
                try:
                    hints.extend(self._take_unhanded(host, wanted, _HINTS_PER_POLL - len(hints)))
                    claimed = await self._claim_hinted(session, hints)
                    known_until = None
                    if claimed is None:
                        known_until = self._known_empty_until(session, wanted)
                        if known_until is None:
                            claimed = await self._claim_pending(session, device_ids)
                    if claimed is not None:
                        return claimed
                    remaining = deadline - loop.time()
                    if remaining <= 0 or not self._cp.accepting:
                        return None
                    wait = remaining
                    if known_until is not None:
                        wait = min(remaining, known_until - loop.time())
                    timed_out = False
                    waiter.parked = True
                    try:
                        async with asyncio.timeout(max(wait, 0.0)):
                            await woken
                    except TimeoutError:
                        timed_out = True
                    finally:
                        waiter.parked = False
                    if waiter.reserved is not None:
                        # An assignment pass took this poll as a claimer:
                        # its answer may be a claim already committed.
                        await self._settled(waiter.reserved)
                    if waiter.claimed is not None:
                        claimed = waiter.claimed
                        return claimed
                    if timed_out:
                        if wait < remaining:
                            continue  # what was known expired: read now
                        return None
                    if not self._cp.accepting:
                        return None
                finally:
                    waiter.gone = True
                    waiters = self._waiters.get(host)
                    if waiters is not None:
                        waiters.pop(woken, None)
                        if not waiters:
                            del self._waiters[host]
                    hints.extend(waiter.hints)
        finally:
            # Those this poll did not try (it claimed another, its wait ended,
            # or a claim failed) go to another poll: no one else was woken.
            if self._cp.accepting:
                for a in hints:
                    if claimed is None or claimed.task_id != a.task_id:
                        self._hand(a)

    async def _settled(self, reserved: asyncio.Future[None]) -> None:
        try:
            async with asyncio.timeout(self._cp.db_timeout_s + 1.0):
                await asyncio.shield(reserved)
        except TimeoutError:  # the pass settles it in a finally: not seen
            log.error("control_plane.claimer_not_settled")

    async def assign_pass(self, limit: int) -> tuple[list[Assignment], frozenset[str]]:
        """One assignment pass, on the loop (``Context.assign``): the Scheduler's
        ``repo.assign``, with the long-polls parked now as claimers
        (``repo.assign_and_claim``). A new assignment that a poll parked for its
        device, with nothing in hand, may claim is claimed for that poll in the
        transaction that assigns: the poll answers with the lease at that
        commit, not after a hand-off to the poll, a hop to the Lease actor and a
        commit of its own. Its Lease actor is started and told the claim, and
        its ``assigned`` and ``dispatched`` events emitted, before the answer
        leaves; the Scheduler does the rest. Returns the assignments and the
        ids of the tasks claimed."""
        if not self._waiters or not self._cp.accepting:
            return await self._cp.repo.assign(limit=limit), frozenset()
        loop = self._cp.loop
        chosen: dict[str, tuple[asyncio.Future[None], _Waiter]] = {}

        def waiting(host_id: str, device_id: str) -> _Waiter | None:
            best = self._claimer(host_id, device_id)
            return None if best is None else best[1]

        def claimer(a: Assignment) -> Session | None:
            # Asked in the assigning transaction, once per new assignment (again
            # if the transaction runs again).
            if a.task_id in chosen:
                return chosen[a.task_id][1].session
            best = self._claimer(a.host_id, a.device_id)
            if best is None:
                return None
            best[1].reserved = loop.create_future()
            chosen[a.task_id] = best
            return best[1].session

        try:
            batch, claims = await self._cp.repo.assign_and_claim(
                limit=limit, claimer=claimer, waiting=waiting
            )
            if not claims:
                return batch, frozenset()
            by_task = {a.task_id: a for a in batch}
            sup = self._cp.supervisor
            events: list[dict[str, Any]] = []
            for c in claims:
                woken, w = chosen[c.task_id]
                a = by_task[c.task_id]
                try:
                    ref: ActorRef[LeaseActor] | None = sup.ensure_lease(a)
                except Unavailable:
                    ref = None  # shutting down: the answer still goes out
                if w.gone:
                    # Cancelled while the pass ran (its connection closed): the
                    # lease is never acknowledged and expires at its ack deadline.
                    log.warning("control_plane.claim_at_assign_undelivered", task_id=c.task_id)
                else:
                    w.claimed = c
                    self._wake(woken)
                if ref is not None:
                    with contextlib.suppress(ActorDeadError):
                        ref.tell(Committed(kind="claim", outcome=c))
                events.append(self._cp._event(a.task_id, "assigned", a.attempt, a.host_id))
                events.append(self._cp._event(a.task_id, "dispatched", c.attempt, a.host_id))
            self._cp.stats.incr("claims_at_assign", len(claims))
            # After the answers: the woken polls run first (the loop's ready
            # queue is in order), the events' listeners next.
            loop.call_soon(self._cp._dispatch, events)
            return batch, frozenset(c.task_id for c in claims)
        finally:
            for _, w in chosen.values():
                reserved, w.reserved = w.reserved, None
                if reserved is not None and not reserved.done():
                    reserved.set_result(None)

    def _claimer(self, host_id: str, device_id: str) -> tuple[asyncio.Future[None], _Waiter] | None:
        """The long-poll an assignment pass may claim an assignment on this
        device for: parked for it, nothing in hand, not taken by the pass
        already; of the newest session."""
        best: tuple[asyncio.Future[None], _Waiter] | None = None
        for woken, w in self._waiters.get(host_id, {}).items():
            if (
                w.parked
                and w.reserved is None
                and not w.hints
                and not woken.done()
                and w.wanted is not None
                and device_id in w.wanted
                and (best is None or w.generation > best[1].generation)
            ):
                best = (woken, w)
        return best

    async def _claim_hinted(self, session: Session, hints: list[Assignment]) -> Claimed | None:
        """Claim the first still claimable of ``hints``, in claim-deadline order,
        removing each from the list once tried (one whose claim raises stays)."""
        hints.sort(key=lambda a: a.claim_deadline)
        while hints:
            a = hints[0]
            key = (a.task_id, a.attempt)
            claimed = None
            # Skipped when another poll of this process is claiming it, or it has
            # no Lease actor (the attempt ended, or the actor is being replaced):
            # the read decides.
            if key not in self._claiming and self._cp.supervisor.lease_for(a.task_id) is not None:
                self._claiming.add(key)
                try:
                    claimed = await self._claim_one(session, a)
                finally:
                    self._claiming.discard(key)
            del hints[0]
            if claimed is not None:
                return claimed
        return None

    def _take_unhanded(
        self, host: str, wanted: frozenset[str] | None, limit: int
    ) -> list[Assignment]:
        """At most ``limit`` of the host's unhanded assignments this poll may
        claim, the first kept first (removed)."""
        kept = self._unhanded.get(host)
        if kept is None:
            return []
        mine = kept.take(wanted, limit)
        if not kept:
            del self._unhanded[host]
        return mine

    def _known_empty_until(self, session: Session, wanted: frozenset[str] | None) -> float | None:
        """Until when every device of ``wanted`` is known to have nothing pending
        (None: not known, read)."""
        known = self._known_empty.get(session.host_id)
        if wanted is None or known is None or known[0] != session.generation:
            return None
        now = self._cp.loop.time()
        until = min((known[1].get(d, 0.0) for d in wanted), default=0.0)
        return until if until > now else None

    def _mark_known_empty(self, session: Session, device_ids: Sequence[str], until: float) -> None:
        known = self._known_empty.get(session.host_id)
        if known is None or known[0] != session.generation:
            if len(self._known_empty) >= 100_000:
                self._known_empty.clear()
            known = self._known_empty[session.host_id] = (session.generation, {})
        for d in device_ids:
            known[1][d] = until

    def _forget_known(self, host: str, device: str | None = None) -> None:
        self._forgets += 1
        if device is None:
            self._known_empty.pop(host, None)
            return
        known = self._known_empty.get(host)
        if known is not None:
            known[1].pop(device, None)

    async def _claim_pending(self, session: Session, device_ids: Sequence[str]) -> Claimed | None:
        # The oldest few are enough: a host may have a thousand pending, and
        # reading them all for each of its polls would load the event loop. The
        # limit also covers those other polls of this process are claiming.
        read_at, forgets = self._cp.loop.time(), self._forgets
        limit = len(self._claiming) + 16
        reader = self._cp.pending_reader
        pending: list[Assignment] = await self._cp._bounded(
            reader.read(session, device_ids, limit)
            if reader is not None
            else self._cp.repo.session_pending(session, device_ids=device_ids, limit=limit)
        )
        if not pending and device_ids and forgets == self._forgets:
            self._mark_known_empty(session, device_ids, read_at + _KNOWN_EMPTY_S)
        for a in sorted(pending, key=lambda a: a.claim_deadline):
            key = (a.task_id, a.attempt)
            if key in self._claiming:
                # Another long-poll of this process is claiming it: concurrent polls
                # of one host read the same list in the same order, and would each
                # lose every race but the last.
                continue
            self._claiming.add(key)
            try:
                claimed = await self._claim_one(session, a)
            finally:
                self._claiming.discard(key)
            if claimed is not None:
                return claimed
        return None

    async def _claim_one(self, session: Session, a: Assignment) -> Claimed | None:
        for attempt in range(REDELIVERIES + 1):
            ref = self._cp.supervisor.lease_for(a.task_id) or self._cp.supervisor.ensure_lease(a)
            try:
                claimed: Claimed = await self._cp._ask(
                    ref,
                    lambda r: Claim(reply=r, session=session, task_id=a.task_id, attempt=a.attempt),
                )
            except (Conflict, Gone):
                return None  # claimed by a concurrent poller, or just expired
            except NotDelivered:
                if attempt == REDELIVERIES:
                    raise
                continue
            return claimed
        return None

    def wake_hosts(self, hosts: Iterable[str | tuple[str, str] | Assignment]) -> None:
        """Wake the parked long-polls of these hosts (on the loop). The server calls
        this when another control-plane process assigned them work.

        An :class:`Assignment` (new, from the Scheduler) is handed to one
        long-poll that may claim its device, which claims it without reading the
        pending assignments first: waking every poll of the host would make each
        of them read, for one assignment that only one of them can take. An
        item ``(host_id, device_id)`` wakes the polls that may claim that device,
        a host id every poll of the host; those read."""
        for item in hosts:
            if isinstance(item, Assignment):
                self._hand(item)
                continue
            if isinstance(item, tuple):
                host, device = item
                self._forget_known(host, device)
                targets = [f for f, w in self._waiters.get(host, {}).items() if w.may_claim(device)]
            else:
                self._forget_known(item)
                targets = list(self._waiters.get(item, {}))
            for woken in targets:
                self._wake(woken)

    def _hand(self, a: Assignment) -> None:
        """Give ``a`` to a long-poll that may claim it: one not woken yet if any
        (a woken one may already be claiming another), of the newest session,
        with the fewest others in hand, and fewer than ``_HINTS_PER_POLL``.
        With none, the host's next poll takes it (or, past ``_UNHANDED_MAX``
        kept, a later read finds it)."""
        candidates = [
            (woken, w)
            for woken, w in self._waiters.get(a.host_id, {}).items()
            if len(w.hints) < _HINTS_PER_POLL and w.may_claim(a.device_id)
        ]
        if not candidates:
            kept = self._unhanded.setdefault(a.host_id, _Kept())
            if len(kept) < _UNHANDED_MAX:
                kept.add(a)
            else:
                self._forget_known(a.host_id, a.device_id)
            return
        woken, w = min(candidates, key=lambda c: (c[0].done(), -c[1].generation, len(c[1].hints)))
        w.hints.append(a)
        self._wake(woken)

    def _wake(self, woken: asyncio.Future[None]) -> None:
        if not woken.done():
            woken.set_result(None)
            self._host_wakeups += 1
