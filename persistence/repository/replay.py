"""The replay ledger: the signed host messages every control-plane process has
accepted within the replay window (``replay_nonces``), so that a message
replayed to another ``serve`` is refused as it is by the first.

``record_nonces`` inserts a batch in one statement (autocommit: the rows are
visible to every process once it returns) and says, for each entry, whether it
was new. A replay racing its original on another process waits on the
original's uncommitted row and then finds it: exactly one of them is new.
``prune_nonces`` deletes rows past their expiry in bounded batches."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from fleetlease.persistence.errors import Invalid
from fleetlease.persistence.repository._tx import Transactions

#: One row per (scope, nonce); a row already there (a replay, or the same
#: message twice in one batch) is left alone and not returned.
_RECORD_SQL = """
INSERT INTO replay_nonces (scope, nonce, expires_at)
SELECT * FROM unnest($1::text[], $2::bytea[], $3::timestamptz[])
ON CONFLICT DO NOTHING
RETURNING scope, nonce
"""

#: At most $2 rows expired before $1, oldest first; rows another pruner holds
#: are skipped, so concurrent pruners never wait for each other.
_PRUNE_SQL = """
DELETE FROM replay_nonces
WHERE (scope, nonce) IN (
    SELECT scope, nonce FROM replay_nonces
    WHERE expires_at < $1
    ORDER BY expires_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
"""


class ReplayMixin(Transactions):
    """The shared replay ledger (see the module doc)."""

    async def record_nonces(
        self, entries: Sequence[tuple[str, bytes, datetime]], *, timeout_s: float | None = None
    ) -> list[bool]:
        """Record each ``(scope, nonce, expires_at)``; True for an entry seen
        for the first time, False for one already recorded (by any process,
        or earlier in ``entries``). ``Unavailable`` when the database is, or
        when the statement takes longer than ``timeout_s``."""
        scopes: list[str] = []
        nonces: list[bytes] = []
        expiries: list[datetime] = []
        for scope, nonce, expires_at in entries:
            if not isinstance(scope, str) or not scope or "\x00" in scope:
                raise Invalid("scope must be a non-empty string", field="scope")
            if not isinstance(nonce, bytes) or not nonce:
                raise Invalid("nonce must be non-empty bytes", field="nonce")
            if not isinstance(expires_at, datetime) or expires_at.tzinfo is None:
                raise Invalid("expires_at must be an aware datetime", field="expires_at")
            scopes.append(scope)
            nonces.append(nonce)
            expiries.append(expires_at)
        if not scopes:
            return []

        async def run(conn: Any, now: datetime) -> set[tuple[str, bytes]]:
            rows = await conn.fetch(_RECORD_SQL, scopes, nonces, expiries, timeout=timeout_s)
            return {(r["scope"], bytes(r["nonce"])) for r in rows}

        inserted = await self._raw("record_nonces", run)
        out: list[bool] = []
        for key in zip(scopes, nonces, strict=True):
            # Only the first of two equal entries in one batch is new.
            out.append(key in inserted)
            inserted.discard(key)
        return out

    async def prune_nonces(self, before: datetime, *, batch: int = 5000) -> int:
        """Delete up to ``batch`` rows that expired before ``before``; how many."""
        if before.tzinfo is None:
            raise Invalid("before must be an aware datetime", field="before")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise Invalid("batch must be a positive int", field="batch")

        async def run(conn: Any, now: datetime) -> int:
            status = await conn.execute(_PRUNE_SQL, before.astimezone(UTC), batch)
            return int(status.rsplit(" ", 1)[-1])

        return await self._raw("prune_nonces", run)
