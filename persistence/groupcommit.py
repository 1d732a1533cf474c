"""Group commit: concurrent callers share one statement or transaction.

``GroupCommit`` queues what its callers submit and hands it to ``_commit`` in
batches, one outcome per item: an exception for one item never fails another.
While up to ``max_inflight`` batches run, new items queue, and the next free
flusher takes everything queued (up to ``max_batch``). With ``linger_s`` 0, at
low load an item is a batch of one; under load the batches grow by
themselves. With ``linger_s`` above 0 a flusher first waits up to that long
for company, unless a full batch or an ``urgent`` item is waiting: only one
flusher lingers at a time (the others may still be running their batch).

A flusher leaves the set of flushers as it finishes, not by a done-callback a
loop iteration later: an item submitted in between sees the room and starts
one, instead of waiting for the next submit.

Runs on one event loop. The batchers of the control plane are in
``actors/groupcommit.py``; the shared replay check's in
``transport/replay.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

I = TypeVar("I")  # noqa: E741 - an item of a batch
R = TypeVar("R")  # its outcome

__all__ = ["GroupCommit"]


class GroupCommit(Generic[I, R]):
    """Batches of submitted items (see the module doc); subclasses implement
    ``_commit``."""

    #: The ``kind`` label of its commit metrics.
    KIND = "other"
    #: The defaults of ``max_batch``, ``max_inflight`` and ``linger_s``.
    MAX_BATCH = 64
    MAX_INFLIGHT = 4
    LINGER_S = 0.0

    def __init__(
        self,
        *,
        max_batch: int | None = None,
        max_inflight: int | None = None,
        linger_s: float | None = None,
    ) -> None:
        max_batch = self.MAX_BATCH if max_batch is None else max_batch
        max_inflight = self.MAX_INFLIGHT if max_inflight is None else max_inflight
        linger_s = self.LINGER_S if linger_s is None else linger_s
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch!r}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight!r}")
        if not linger_s >= 0:
            raise ValueError(f"linger_s must be >= 0, got {linger_s!r}")
        self.max_batch = max_batch
        self.max_inflight = max_inflight
        self.linger_s = linger_s
        self._pending: list[tuple[I, asyncio.Future[R], bool]] = []
        #: Urgent items queued: a lingering flusher does not wait for them.
        self._urgent = 0
        #: Set to end a lingering flusher's wait (a full batch, an urgent item).
        self._go = asyncio.Event()
        self._lingering = False
        self._flushers: set[asyncio.Task[None]] = set()
        #: Batches run, and the items they carried.
        self.batches = 0
        self.items = 0

    async def submit(self, item: I, *, urgent: bool = False) -> R:
        """``item``'s outcome once its batch ran (its exception raised)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        self._pending.append((item, fut, urgent))
        if urgent:
            self._urgent += 1
            self._go.set()
        elif len(self._pending) >= self.max_batch:
            self._go.set()
        # A lingering flusher takes what is queued: no task for each item then.
        if not self._lingering and len(self._flushers) < self.max_inflight:
            task = loop.create_task(self._flush())
            self._flushers.add(task)
            task.add_done_callback(self._flushers.discard)  # also if never run
        return await fut

    async def _commit(self, items: Sequence[I]) -> Sequence[R | Exception]:
        raise NotImplementedError

    def _observe(self, size: int, started: float) -> None:
        """Told of every batch that ran: its items and ``time.perf_counter()``
        at its start (the metrics' hook; must not raise)."""

    async def _flush(self) -> None:
        try:
            await self._flush_pending()
        finally:
            task = asyncio.current_task()
            if task is not None:
                self._flushers.discard(task)

    async def _flush_pending(self) -> None:
        while self._pending:
            if self.linger_s and not self._urgent and len(self._pending) < self.max_batch:
                if self._lingering:
                    return  # another flusher is collecting these
                self._lingering = True
                self._go.clear()
                try:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.linger_s):
                            await self._go.wait()
                finally:
                    self._lingering = False
            taken = self._pending[: self.max_batch]
            del self._pending[: self.max_batch]
            self._urgent -= sum(1 for _, _, u in taken if u)
            batch = [(item, f) for item, f, _ in taken if not f.done()]
            if not batch:
                continue
            self.batches += 1
            self.items += len(batch)
            started = time.perf_counter()
            try:
                results = await self._commit([item for item, _ in batch])
            except Exception as exc:
                for _, f in batch:
                    _fail(f, exc)
                continue
            self._observe(len(batch), started)
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
        """Wait for the batches in flight."""
        if self._flushers:
            await asyncio.gather(*self._flushers, return_exceptions=True)


def _fail(f: asyncio.Future[Any], exc: BaseException) -> None:
    if not f.done():
        f.set_exception(exc)
