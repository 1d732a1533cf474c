"""The control plane's group commit: concurrent transitions share one
transaction, concurrent periodic requests one statement (the mechanism,
batches and lingering, is ``persistence/groupcommit.py``'s ``GroupCommit``).

* ``TransitionBatcher``: the fenced host transitions (claim, ack, progress,
  result) into ``repo.run_many`` (two statements for claims, acks and results;
  otherwise one transaction, one commit). No lingering: at low load a
  transition is a batch of one; under load the batches grow by themselves.
* ``RenewBatcher``: lease renewals into ``repo.renew_many`` (one read and one
  multi-row conditional write, each its own transaction in autocommit).
* ``HeartbeatBatcher``: heartbeats of unchanged snapshots into
  ``repo.heartbeats_unchanged``; ``PendingReader``: the long-poll reads of a
  host's pending assignments into ``repo.sessions_pending``
  (``persistence/repository/periodic.py``, one statement each).

Each caller waits for its own batch before anyone replies and gets its own
outcome: one entry's refusal never rolls back another's.

The periodic requests linger for company: renewals and heartbeats 10 ms,
long-poll reads 5 ms. Hosts send them spread out in time, so without a delay
each was a statement of its own (10,000 leases renewed every 10 s: a thousand
transactions a second; 2,000 hosts: 400 heartbeats and 400 returning
long-polls a second); a lease is tens of seconds long and a heartbeat period
seconds, so 10 ms more costs nothing, and one statement then carries several.
A long-poll read lingers less: the assignment it finds (one made while no poll
of its host was parked) waits those milliseconds too.

Runs on the event loop: Lease actors reach the transition batcher through
``Bridge.run``; renewals, heartbeats and long-poll reads come straight from the
facade (``actors/runtime.py``, ``actors/longpoll.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from fleetlease.ops.observe import metrics
from fleetlease.persistence.groupcommit import GroupCommit
from fleetlease.persistence.model import Assignment, LeaseStatus, Session
from fleetlease.persistence.repository import Renewal, Repository, Transition
from fleetlease.persistence.repository.periodic import Pending

I = TypeVar("I")  # noqa: E741 - an item of a batch
R = TypeVar("R")  # its outcome


class _GroupCommit(GroupCommit[I, R]):
    """A batcher of the control plane, writing through ``repo``."""

    KIND = "transition"

    def __init__(
        self,
        repo: Repository,
        *,
        max_batch: int | None = None,
        max_inflight: int | None = None,
        linger_s: float | None = None,
    ) -> None:
        super().__init__(max_batch=max_batch, max_inflight=max_inflight, linger_s=linger_s)
        self.repo = repo

    def _observe(self, size: int, started: float) -> None:
        metrics.group_committed(self.KIND, size, started)


class RenewBatcher(_GroupCommit[Renewal, LeaseStatus]):
    KIND = "renew"
    MAX_BATCH = 256
    LINGER_S = 0.01

    @property
    def renewals(self) -> int:
        return self.items

    async def renew(self, renewal: Renewal) -> LeaseStatus:
        return await self.submit(renewal)

    async def _commit(self, items: Sequence[Renewal]) -> Sequence[LeaseStatus | Exception]:
        return await self.repo.renew_many(items)


class HeartbeatBatcher(_GroupCommit[tuple[Session, str], None]):
    """Heartbeats of unchanged snapshots, many to one statement
    (``repo.heartbeats_unchanged``); periodic, so they linger as renewals do."""

    KIND = "heartbeat"
    MAX_BATCH = 256
    MAX_INFLIGHT = 2
    LINGER_S = 0.01

    async def beat(self, session: Session, digest: str) -> None:
        await self.submit((session, digest))

    async def _commit(self, items: Sequence[tuple[Session, str]]) -> Sequence[Exception | None]:
        return await self.repo.heartbeats_unchanged(items)


class PendingReader(_GroupCommit[Pending, list[Assignment]]):
    """Long-poll reads of a host's pending assignments, many to one statement
    (``repo.sessions_pending``). A read lingers ``linger_s`` (5 ms) for others:
    most are claims coming back empty after their wait, and an assignment a
    read finds was made while no poll of its host was parked."""

    KIND = "pending_read"
    MAX_BATCH = 256
    MAX_INFLIGHT = 2
    LINGER_S = 0.005

    async def read(
        self, session: Session, device_ids: Sequence[str], limit: int | None
    ) -> list[Assignment]:
        return await self.submit((session, device_ids, limit))

    async def _commit(self, items: Sequence[Pending]) -> Sequence[list[Assignment] | Exception]:
        return await self.repo.sessions_pending(items)


class TransitionBatcher(_GroupCommit[Transition, Any]):
    async def run(self, transition: Transition) -> Any:
        return await self.submit(transition)

    async def _commit(self, items: Sequence[Transition]) -> Sequence[Any]:
        return await self.repo.run_many(items)
