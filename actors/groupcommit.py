"""Group commit for lease renewals.

Renewals from many Lease actors that arrive together share one
``repo.renew_many`` transaction. There is no batching delay: while up to
``max_inflight`` batches are being committed, new renewals queue up, and the
next free flusher takes everything queued (up to ``max_batch``). At low load a
renewal is a batch of one; at high load the batches grow by themselves. Each
caller still waits for the commit of its own batch, and gets its own outcome
(``renew_many`` never lets one entry's error roll back another's).

Runs on the event loop; Lease actors reach it through ``Bridge.run``.
"""

from __future__ import annotations

import asyncio

import structlog

from persistence.model import LeaseStatus
from persistence.repository import Renewal, Repository

log = structlog.get_logger("fleetlease.groupcommit")


class RenewBatcher:
    def __init__(self, repo: Repository, *, max_batch: int = 256, max_inflight: int = 4) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch!r}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight!r}")
        self.repo = repo
        self.max_batch = max_batch
        self.max_inflight = max_inflight
        self._pending: list[tuple[Renewal, asyncio.Future[LeaseStatus]]] = []
        self._flushers: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.renewals = 0
        self._supported = True

    async def renew(self, renewal: Renewal) -> LeaseStatus:
        if not self._supported:
            return await self.repo.renew(
                renewal.session, renewal.task_id, renewal.attempt, renewal.lease_token
            )
        fut: asyncio.Future[LeaseStatus] = asyncio.get_running_loop().create_future()
        self._pending.append((renewal, fut))
        if len(self._flushers) < self.max_inflight:
            task = asyncio.get_running_loop().create_task(self._flush())
            self._flushers.add(task)
            task.add_done_callback(self._flushers.discard)
        return await fut

    async def _flush(self) -> None:
        while self._pending:
            batch = self._pending[: self.max_batch]
            del self._pending[: self.max_batch]
            batch = [(r, f) for r, f in batch if not f.done()]
            if not batch:
                continue
            self.batches += 1
            self.renewals += len(batch)
            try:
                results = await self.repo.renew_many([r for r, _ in batch])
            except NotImplementedError:
                # A repository without renew_many: one transaction per renewal.
                self._supported = False
                log.warning("groupcommit.renew_many_unsupported")
                for r, f in batch:
                    try:
                        status = await self.repo.renew(
                            r.session, r.task_id, r.attempt, r.lease_token
                        )
                    except Exception as exc:
                        _fail(f, exc)
                    else:
                        _resolve(f, status)
                continue
            except Exception as exc:
                for _, f in batch:
                    _fail(f, exc)
                continue
            if len(results) != len(batch):
                err = RuntimeError("renew_many returned a wrong number of outcomes")
                for _, f in batch:
                    _fail(f, err)
                continue
            for (_, f), outcome in zip(batch, results, strict=True):
                if isinstance(outcome, Exception):
                    _fail(f, outcome)
                else:
                    _resolve(f, outcome)

    async def close(self) -> None:
        if self._flushers:
            await asyncio.gather(*self._flushers, return_exceptions=True)


def _fail(f: asyncio.Future[LeaseStatus], exc: BaseException) -> None:
    if not f.done():
        f.set_exception(exc)


def _resolve(f: asyncio.Future[LeaseStatus], status: LeaseStatus) -> None:
    if not f.done():
        f.set_result(status)
