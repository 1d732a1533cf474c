"""Group commit: concurrent transitions share one transaction.

Four batchers, one shape. ``RenewBatcher`` groups lease renewals into
``repo.renew_many`` (one read and one multi-row conditional write, each its own
transaction in autocommit); ``TransitionBatcher`` groups the other fenced host
transitions (claim, ack, progress, result) into ``repo.run_many`` (the same two
statements for claims, acks and results; otherwise one transaction, one
commit); ``HeartbeatBatcher`` and ``PendingReader`` group an idle fleet's
periodic requests, heartbeats of unchanged snapshots and long-poll reads, into
one statement each (``persistence/repository/periodic.py``).

Transitions wait for no one: while up to ``max_inflight`` batches are being
committed, new work queues up, and the next free flusher takes everything
queued (up to ``max_batch``). At low load a transition is a batch of one (its
own transaction, as without group commit); under load the batches grow by
themselves and a commit is shared by many. Each caller still waits for the
commit of its own batch before anyone replies, and gets its own outcome: one
entry's refusal never rolls back another's.

The periodic requests linger ``linger_s`` before taking a batch: renewals and
heartbeats 10 ms, long-poll reads 5 ms. Hosts send them spread out in time, so
without a delay each was a statement of its own (10,000 leases renewed every
10 s: a thousand transactions a second; 2,000 hosts: 400 heartbeats and 400
returning long-polls a second); a lease is tens of seconds long and a
heartbeat period seconds, so 10 ms more costs nothing, and one statement then
carries several. A long-poll read lingers less: the assignment it finds (one
made while no poll of its host was parked) waits those milliseconds too.
Only one flusher lingers at a time (the others may still be committing), and a
full batch ends the wait.

Runs on the event loop: Lease actors reach the transition batcher through
``Bridge.run``; renewals, heartbeats and long-poll reads come straight from the
facade (``actors/runtime.py``, ``actors/longpoll.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import structlog

from fleetlease.ops.observe import metrics
from fleetlease.persistence.model import Assignment, LeaseStatus, Session
from fleetlease.persistence.repository import Renewal, Repository, Transition
from fleetlease.persistence.repository.periodic import Pending

log = structlog.get_logger("fleetlease.groupcommit")

I = TypeVar("I")  # noqa: E741 - an item of a batch
R = TypeVar("R")  # its outcome


class _GroupCommit(Generic[I, R]):
    #: The ``kind`` label of its commit metrics.
    KIND = "transition"

    def __init__(
        self, repo: Repository, *, max_batch: int, max_inflight: int, linger_s: float = 0.0
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch!r}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight!r}")
        if not linger_s >= 0:
            raise ValueError(f"linger_s must be >= 0, got {linger_s!r}")
        self.repo = repo
        self.max_batch = max_batch
        self.max_inflight = max_inflight
        self.linger_s = linger_s
        self._lingering = False
        #: Set when a full batch is waiting: the lingering flusher takes it now.
        self._full = asyncio.Event()
        self._pending: list[tuple[I, asyncio.Future[R]]] = []
        self._flushers: set[asyncio.Task[None]] = set()
        #: Transactions committed, and the items they carried.
        self.batches = 0
        self.items = 0

    async def submit(self, item: I) -> R:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        self._pending.append((item, fut))
        if self._lingering:
            if len(self._pending) >= self.max_batch:
                self._full.set()
        elif len(self._flushers) < self.max_inflight:
            task = loop.create_task(self._flush())
            self._flushers.add(task)
            task.add_done_callback(self._flushers.discard)
        return await fut

    async def _commit(self, items: Sequence[I]) -> Sequence[R | Exception]:
        raise NotImplementedError

    async def _flush(self) -> None:
        while self._pending:
            if self.linger_s and len(self._pending) < self.max_batch:
                if self._lingering:
                    return  # another flusher is collecting these
                self._lingering = True
                self._full.clear()
                try:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.linger_s):
                            await self._full.wait()
                finally:
                    self._lingering = False
            batch = self._pending[: self.max_batch]
            del self._pending[: self.max_batch]
            batch = [(r, f) for r, f in batch if not f.done()]
            if not batch:
                continue
            self.batches += 1
            self.items += len(batch)
            started = time.perf_counter()
            try:
                results = await self._commit([r for r, _ in batch])
                metrics.group_committed(self.KIND, len(batch), started)
            except Exception as exc:
                for _, f in batch:
                    _fail(f, exc)
                continue
            if len(results) != len(batch):
                err = RuntimeError("a batch returned a wrong number of outcomes")
                for _, f in batch:
                    _fail(f, err)
                continue
            for (_, f), outcome in zip(batch, results, strict=True):
                if isinstance(outcome, Exception):
                    _fail(f, outcome)
                elif not f.done():
                    f.set_result(outcome)

    async def close(self) -> None:
        if self._flushers:
            await asyncio.gather(*self._flushers, return_exceptions=True)


class RenewBatcher(_GroupCommit[Renewal, LeaseStatus]):
    KIND = "renew"

    def __init__(
        self,
        repo: Repository,
        *,
        max_batch: int = 256,
        max_inflight: int = 4,
        linger_s: float = 0.01,
    ) -> None:
        super().__init__(repo, max_batch=max_batch, max_inflight=max_inflight, linger_s=linger_s)

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

    def __init__(
        self,
        repo: Repository,
        *,
        max_batch: int = 256,
        max_inflight: int = 2,
        linger_s: float = 0.01,
    ) -> None:
        super().__init__(repo, max_batch=max_batch, max_inflight=max_inflight, linger_s=linger_s)

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

    def __init__(
        self,
        repo: Repository,
        *,
        max_batch: int = 256,
        max_inflight: int = 2,
        linger_s: float = 0.005,
    ) -> None:
        super().__init__(repo, max_batch=max_batch, max_inflight=max_inflight, linger_s=linger_s)

    async def read(
        self, session: Session, device_ids: Sequence[str], limit: int | None
    ) -> list[Assignment]:
        return await self.submit((session, tuple(device_ids), limit))

    async def _commit(self, items: Sequence[Pending]) -> Sequence[list[Assignment] | Exception]:
        return await self.repo.sessions_pending(items)


class TransitionBatcher(_GroupCommit[Transition, Any]):
    def __init__(self, repo: Repository, *, max_batch: int = 64, max_inflight: int = 4) -> None:
        super().__init__(repo, max_batch=max_batch, max_inflight=max_inflight)

    async def run(self, transition: Transition) -> Any:
        return await self.submit(transition)

    async def _commit(self, items: Sequence[Transition]) -> Sequence[Any]:
        return await self.repo.run_many(items)


def _fail(f: asyncio.Future[Any], exc: BaseException) -> None:
    if not f.done():
        f.set_exception(exc)
