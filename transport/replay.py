"""Replay protection shared by every control-plane process.

A signed host message (and a Register proof) carries a timestamp and a random
nonce; ``transport.auth.Verifier`` refuses one whose timestamp is outside the
window and remembers the nonces it accepted, in process memory. That cache is
the fast first check, but a message replayed so that another ``serve`` of the
same fleet receives it (each channel is a NATS queue group) would pass it.
``SharedReplay`` is the second check, after the signature and the session
generation have verified and before the message acts: the nonce is recorded
in PostgreSQL (``replay_nonces``, ``Repository.record_nonces``), and a nonce
any process recorded before is refused (``unauthorized``, reason ``replay``).

* Group commit (``persistence/groupcommit.py``), as the host transitions
  do: concurrent checks share one ``INSERT ... ON CONFLICT DO NOTHING
  RETURNING`` in autocommit. While ``max_inflight`` inserts are running, new
  checks queue and the next free flusher takes all of them (up to
  ``max_batch``). A check that someone waits
  on (a claim, an ack, a result: ``urgent``) never waits for a batch to fill;
  the periodic messages (heartbeats, renewals, progress, cancel polls, log
  lines: not urgent) linger up to ``linger_s`` (10 ms, as renewals do in
  their own group commit) for others to share their statement, and go at
  once with the next urgent check or a full batch.
* The database is the store because every host message already needs it:
  the check adds no dependency (a JetStream KV bucket would make JetStream,
  otherwise needed only for artifacts, a condition of every host message),
  its rows fail over with the transitions they guard (a promoted synchronous
  standby still has them), and concurrent checks share one statement where a
  KV bucket costs a broker round trip per message.
* When the database cannot record a nonce (down, or no answer within
  ``timeout_s``), the message is refused ``unavailable`` (retryable; a host
  agent re-signs and sends again) and has no effect: a message is never
  accepted unchecked.
* ``serve`` runs the inserts on a small pool of their own whose commits do
  not wait for the WAL flush (``RELAXED_COMMIT``: ``synchronous_commit=off``,
  so a check at low load costs a round trip, not a disk flush). That loses
  nothing that matters: a nonce is committed before its message's transition
  begins, so its commit record comes first in the WAL, and the transition's
  own (synchronous) commit flushes, and on a synchronous standby replicates,
  the WAL up to itself. A crash of PostgreSQL can lose only the last
  fraction of a second of nonces, of messages that had no acknowledged
  effect; such a message replayed after the crash would be accepted once.
* A row is kept until the message's timestamp plus the window plus
  ``margin_s`` by this process's clock (the margin covers clock skew between
  the ``serve`` processes), then deleted by ``prune``, every ``prune_interval_s``,
  in batches of ``prune_batch``, by every process (they skip each other's rows).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import structlog

from fleetlease.ops.observe import metrics
from fleetlease.persistence.clock import Clock
from fleetlease.persistence.errors import Unavailable
from fleetlease.persistence.groupcommit import GroupCommit
from fleetlease.transport.auth import AuthError

if TYPE_CHECKING:
    from fleetlease.persistence.repository import Repository

log = structlog.get_logger("fleetlease.replay")

__all__ = ["RELAXED_COMMIT", "SharedReplay", "register_scope"]

#: The server settings of the ledger's connections (see the module doc).
RELAXED_COMMIT = {"synchronous_commit": "off"}

_Entry = tuple[str, bytes, datetime]


def register_scope(host_id: str) -> str:
    """The scope of a host's Register proofs, apart from its messages' (a host
    id never holds a colon)."""
    return f"register:{host_id}"


class _Ledger(GroupCommit[_Entry, bool]):
    """The nonce inserts, group-committed: True for a nonce seen for the first
    time. A batch the database has not answered within ``timeout_s``,
    connecting included (after a failover the pool connects host by host),
    is ``Unavailable``."""

    KIND = "replay"
    MAX_BATCH = 512
    MAX_INFLIGHT = 4
    LINGER_S = 0.01

    def __init__(self, repo: Repository, *, timeout_s: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.repo = repo
        self.timeout_s = timeout_s

    async def _commit(self, items: Sequence[_Entry]) -> Sequence[bool]:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self.repo.record_nonces(items, timeout_s=self.timeout_s)
        except TimeoutError:
            raise Unavailable("the replay check did not answer in time") from None

    def _observe(self, size: int, started: float) -> None:
        metrics.group_committed(self.KIND, size, started)


class SharedReplay:
    """The replay check shared through the database (see the module doc).
    Runs on the event loop."""

    #: Statements in flight at once (the ledger's pool needs one more, to prune).
    MAX_INFLIGHT = _Ledger.MAX_INFLIGHT

    def __init__(
        self,
        repo: Repository,
        clock: Clock,
        *,
        window_s: float,
        margin_s: float | None = None,
        max_batch: int = _Ledger.MAX_BATCH,
        max_inflight: int = MAX_INFLIGHT,
        prune_interval_s: float | None = None,
        prune_batch: int = 5000,
        timeout_s: float = 5.0,
        linger_s: float = _Ledger.LINGER_S,
    ) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        if prune_batch < 1:
            raise ValueError("prune_batch must be at least 1")
        self.repo = repo
        self._clock = clock
        self.window = timedelta(seconds=window_s)
        #: Rows are kept this much past the window (clock skew between processes).
        self.margin = timedelta(seconds=window_s if margin_s is None else margin_s)
        if self.margin < timedelta(0):
            raise ValueError(f"margin_s must not be negative, got {margin_s!r}")
        self.prune_interval_s = window_s if prune_interval_s is None else prune_interval_s
        self.prune_batch = prune_batch
        #: A check the database has not answered within this is ``unavailable``.
        self.timeout_s = timeout_s
        self._ledger = _Ledger(
            repo,
            timeout_s=timeout_s,
            max_batch=max_batch,
            max_inflight=max_inflight,
            linger_s=linger_s,
        )
        self._pruner: asyncio.Task[None] | None = None
        #: Replays refused.
        self.refused = 0

    @property
    def batches(self) -> int:
        """Statements run."""
        return self._ledger.batches

    @property
    def items(self) -> int:
        """Checks those statements carried."""
        return self._ledger.items

    async def check(self, scope: str, nonce: bytes, ts_ms: int, *, urgent: bool = True) -> None:
        """Record ``(scope, nonce)`` of a message signed at ``ts_ms``; AuthError
        ``replay`` if any process recorded it before, ``Unavailable`` (a
        ``RepositoryError``, code ``unavailable``) if the database cannot say.
        Not ``urgent``: the check may linger (see the module doc)."""
        expires_at = datetime.fromtimestamp(ts_ms / 1000, UTC) + self.window
        if not await self._ledger.submit((scope, nonce, expires_at), urgent=urgent):
            self.refused += 1
            raise AuthError("replayed message", reason="replay")

    # --- pruning -----------------------------------------------------------------
    def start(self) -> None:
        """Start pruning expired rows every ``prune_interval_s``."""
        if self._pruner is None:
            self._pruner = asyncio.get_running_loop().create_task(self._prune_loop())

    async def stop(self) -> None:
        """Stop pruning; let the statements in flight finish."""
        if self._pruner is not None:
            self._pruner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pruner
            self._pruner = None
        await self._ledger.close()

    async def prune(self) -> int:
        """Delete every row this process's clock says no process still needs
        (past its expiry plus the margin), a batch at a time; how many."""
        before = self._clock.now() - self.margin
        total = 0
        while True:
            n = await self.repo.prune_nonces(before, batch=self.prune_batch)
            total += n
            if n < self.prune_batch:
                return total

    async def _prune_loop(self) -> None:
        while True:
            await asyncio.sleep(self.prune_interval_s)
            try:
                await self.prune()
            except Exception as exc:
                # The next pass catches up; checks never depend on pruning.
                log.warning("replay_prune_failed", error=str(exc) or type(exc).__name__)
