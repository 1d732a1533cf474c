"""The retention collector of a control-plane process (``fleetlease serve``):
a pass every ``interval_s`` (``persistence.retention.Retention.collect``), the
``gc`` verb's passes and dry runs, and the deletion of what a committed batch
freed outside PostgreSQL: artifact objects and staged chunks
(``transport.artifacts.Artifacts``)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

from fleetlease.persistence.retention import Batch, Report, Retention, Usage

log = structlog.get_logger("fleetlease.gc")

#: Seconds between two passes of ``serve``'s collector by default.
DEFAULT_INTERVAL_S = 300.0
#: Batches one run holds the collector for (a pass is as many runs as it takes).
PASS_BATCHES = 10


class Collector:
    """Runs ``retention``'s passes one at a time (the periodic one and the
    ``gc`` verb's never overlap) and frees each batch's objects through
    ``artifacts`` (None: no object store, rows only)."""

    def __init__(
        self, retention: Retention, artifacts: Any = None, *, interval_s: float = DEFAULT_INTERVAL_S
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.retention = retention
        self.artifacts = artifacts
        self.interval_s = interval_s
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        #: The last periodic or requested pass (None before the first).
        self.last: Report | None = None
        #: What this process's passes deleted since it started (``/metrics``).
        self.deleted = Usage()
        self.objects_deleted = 0
        self.objects_failed = 0

    async def run(self, *, dry_run: bool = False, max_batches: int | None = None) -> Report:
        """A pass (of at most ``max_batches`` batches), or with ``dry_run`` the plan."""
        if dry_run:
            return await self.retention.plan()
        async with self._lock:
            report = await self.retention.collect(self._free, max_batches=max_batches)
        self.last = report
        self.deleted.add(report.total())
        self.objects_deleted += report.objects_deleted
        self.objects_failed += report.objects_failed
        if report.batches or report.objects_failed:
            log.info(
                "gc_pass",
                batches=report.batches,
                objects_deleted=report.objects_deleted,
                objects_failed=report.objects_failed,
                **report.total().as_dict(),
            )
        return report

    def counters(self) -> dict[str, int]:
        """Cumulative counts for ``/metrics``: rows and bytes, objects deleted
        and objects whose deletion failed."""
        out = self.deleted.as_dict()
        out["objects"] = self.objects_deleted
        out["objects_failed"] = self.objects_failed
        return out

    async def _free(self, batch: Batch) -> tuple[int, int]:
        if self.artifacts is None:
            return 0, 0
        try:
            self.artifacts.purge_staged(batch.attempts)
            deleted, failed = await self.artifacts.delete_objects(batch.object_names)
        except Exception as exc:  # the rows are gone either way; the pass goes on
            log.warning("gc_objects_failed", error=repr(exc), objects=len(batch.object_names))
            return 0, len(batch.object_names)
        return int(deleted), int(failed)

    def start(self) -> None:
        """The periodic pass, on the running loop (the first one at once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                # In runs of PASS_BATCHES, so a ``gc`` request waits for one run
                # at most, never for a whole backlog.
                while not (await self.run(max_batches=PASS_BATCHES)).complete:
                    if self._stop.is_set():
                        return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database is away: next pass
                log.warning("gc_pass_failed", error=repr(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
            if self._stop.is_set():
                return

    async def stop(self, grace_s: float = 10.0) -> None:
        """The pass running ends after its current batch and the deletion of
        that batch's objects (cancelled after ``grace_s``)."""
        self.retention.stop()
        self._stop.set()
        task, self._task = self._task, None
        if task is not None:
            await asyncio.wait({task}, timeout=grace_s)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
