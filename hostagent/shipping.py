"""Log and artifact shipping: bounded in-memory queues, each sent by its own
task on the LOGS and ARTIFACTS connections.

A full queue drops its *oldest* entries and counts them (``stats``);
enqueueing never blocks a runner or the job loop. A log batch or artifact that
fails transiently is retried a few times, then given up (and counted as
dropped)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from fleetlease.hostagent.retry import TRANSIENT_CODES, DropOldestQueue
from fleetlease.hostagent.session import Session
from fleetlease.hostagent.state import AgentState, Attempt
from fleetlease.transport import wire
from fleetlease.transport.client import HostClient
from fleetlease.transport.wire import RemoteError

__all__ = ["ArtifactItem", "LogLine", "Shipping"]

log = structlog.get_logger("fleetlease.agent")

_LOG_LINE_MAX_BYTES = wire.MAX_LOG_LINE_BYTES
_LOG_BATCH_BYTES = 256 * 1024
_SIDE_CHANNEL_ATTEMPTS = 5
#: Side-channel refusals that a later retry may get past (staging quotas).
_SIDE_RETRY_CODES = frozenset({"busy", "quota"})


@dataclass(frozen=True)
class LogLine:
    task_id: str
    attempt: int
    seq: int
    line: str

    @property
    def key(self) -> tuple[str, int]:
        return (self.task_id, self.attempt)


@dataclass(frozen=True)
class ArtifactItem:
    task_id: str
    attempt: int
    lease_token: str = field(repr=False)
    name: str
    data: bytes = field(repr=False)


def _truncate_utf8(text: str, max_bytes: int) -> str:
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text
    return data[:max_bytes].decode("utf-8", "ignore")


class Shipping:
    """The log and artifact queues of one agent and the loops that empty them.
    Enqueue on the agent's loop thread (``AgentState.in_loop``)."""

    def __init__(self, state: AgentState, session: Session) -> None:
        self._state = state
        self._config = state.config
        self._stats = state.stats
        self._session = session
        self.logs: DropOldestQueue[LogLine] = DropOldestQueue(self._config.log_queue_lines)
        self.artifacts: DropOldestQueue[ArtifactItem] = DropOldestQueue(
            self._config.artifact_queue_items,
            cost=lambda a: len(a.data),
            max_cost=self._config.artifact_queue_bytes,
        )
        self._shipping_logs = 0
        self._shipping_artifacts = 0
        self._shipping_artifact: tuple[str, int] | None = None
        #: Set each time an artifact has been shipped (or given up).
        self._artifact_shipped = asyncio.Event()

    # --- enqueueing -------------------------------------------------------------------
    def enqueue_log(self, att: Attempt, line: str) -> None:
        att.log_seq += 1
        item = LogLine(
            att.record.task_id,
            att.record.attempt,
            att.log_seq,
            _truncate_utf8(line, _LOG_LINE_MAX_BYTES),
        )
        if self.logs.put(item):
            self._stats.logs_dropped = self.logs.dropped

    def enqueue_artifact(self, item: ArtifactItem) -> None:
        if self.artifacts.put(item):
            self._stats.artifacts_dropped = self.artifacts.dropped
            log.warning(
                "artifact_dropped",
                task_id=item.task_id,
                attempt=item.attempt,
                dropped_total=self.artifacts.dropped,
            )

    # --- sending ----------------------------------------------------------------------
    async def _side_send(
        self, what: str, fn: Callable[[HostClient], Awaitable[None]], **fields: Any
    ) -> bool:
        """Send one log batch or artifact, retrying transient failures a few times."""
        backoff = self._state.backoff()
        for _ in range(_SIDE_CHANNEL_ATTEMPTS):
            try:
                await self._session.call(fn)
                return True
            except RemoteError as exc:
                if exc.code not in TRANSIENT_CODES and exc.code not in _SIDE_RETRY_CODES:
                    log.warning(f"{what}_rejected", code=exc.code, error=exc.message, **fields)
                    return False
                await asyncio.sleep(backoff.next_delay())
        log.warning(f"{what}_gave_up", **fields)
        return False

    async def ship_logs(self) -> None:
        while True:
            await self.logs.wait()
            batch = self._pop_log_batch()
            if not batch:
                continue
            self._shipping_logs = len(batch)
            try:
                await self._send_log_batch(batch)
            finally:
                self._shipping_logs = 0

    async def _send_log_batch(self, batch: list[LogLine]) -> None:
        first = batch[0]
        lines = [b.line for b in batch]
        sent = await self._side_send(
            "logs",
            lambda c: c.append_logs(first.task_id, first.attempt, first.seq, lines),
            task_id=first.task_id,
            attempt=first.attempt,
            lines=len(lines),
        )
        if sent:
            self._stats.log_lines_sent += len(lines)
        else:
            self.logs.dropped += len(lines)
            self._stats.logs_dropped = self.logs.dropped

    def _pop_log_batch(self) -> list[LogLine]:
        """Leading lines of one attempt with consecutive seqs, within the size limits."""
        batch: list[LogLine] = []
        size = 0
        while len(self.logs):
            head = self.logs.peek()
            if batch and (
                head.key != batch[0].key
                or head.seq != batch[-1].seq + 1
                or len(batch) >= wire.MAX_LOG_LINES
                or size + len(head.line) * 4 > _LOG_BATCH_BYTES
            ):
                break
            batch.append(self.logs.popleft())
            size += len(head.line.encode("utf-8", "replace")) + 8
        return batch

    async def ship_artifacts(self) -> None:
        while True:
            await self.artifacts.wait()
            item = self.artifacts.popleft()
            self._shipping_artifacts = 1
            self._shipping_artifact = (item.task_id, item.attempt)
            try:
                await self._send_artifact(item)
            finally:
                self._shipping_artifacts = 0
                self._shipping_artifact = None
                self._artifact_shipped.set()

    def _artifacts_pending(self, key: tuple[str, int]) -> bool:
        return self._shipping_artifact == key or any(
            (i.task_id, i.attempt) == key for i in self.artifacts
        )

    async def _send_artifact(self, item: ArtifactItem) -> None:
        sent = await self._side_send(
            "artifact",
            lambda c: c.upload_artifact(
                item.task_id, item.attempt, item.lease_token, item.name, item.data
            ),
            task_id=item.task_id,
            attempt=item.attempt,
            name=item.name,
        )
        if sent:
            self._stats.artifacts_sent += 1
            log.info(
                "artifact_uploaded",
                task_id=item.task_id,
                attempt=item.attempt,
                name=item.name,
                size=len(item.data),
            )
        else:
            self.artifacts.dropped += 1
            self._stats.artifacts_dropped = self.artifacts.dropped

    # --- flushing -----------------------------------------------------------------------
    async def flush_artifacts(self, att: Attempt) -> None:
        """Wait (up to ``artifact_flush_s``) until the attempt's queued artifacts
        are shipped: the control plane takes them only while the lease is held,
        and the result ends the lease. Not for a handed-back attempt: its report
        must go out within the shutdown's ``handback_timeout_s``."""
        if att.handback:
            return
        rec = att.record
        key = (rec.task_id, rec.attempt)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.artifact_flush_s
        while self._artifacts_pending(key) and not att.lost.is_set():
            left = deadline - loop.time()
            if left <= 0:
                log.warning("artifact_flush_timed_out", task_id=rec.task_id, attempt=rec.attempt)
                return
            self._artifact_shipped.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._artifact_shipped.wait(), min(left, 1.0))

    async def flush(self, timeout_s: float) -> None:
        """Shutdown: wait up to ``timeout_s`` for the queues to empty (while a
        session is up to send them on)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (
            len(self.logs) or len(self.artifacts) or self._shipping_logs or self._shipping_artifacts
        ) and loop.time() < deadline:
            if not self._session.ready.is_set():
                break
            await asyncio.sleep(0.02)
