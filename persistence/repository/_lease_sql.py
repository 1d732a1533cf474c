"""The renewal's statements: hand-written SQL for the driver's connection
(the unlocked read and the conditional write) and the locked extension."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from fleetlease.persistence.repository._sql import UUIDT, _unnest_params
from fleetlease.persistence.tables import attempts

#: ``_renew_unlocked``'s read: each renewal's task, attempt and host rows (the
#: columns of ``_LEASE_FENCE_COLUMNS``), unlocked. Hand-written SQL: it runs on
#: the driver's connection, as asyncpg's own prepared statement.
_RENEW_READ_SQL = """
SELECT t.id::text AS task_id, t.status, t.attempt, t.cancel_requested_at,
       a.number AS a_number, a.host_id AS a_host_id, a.lease_token_hash AS a_token_hash,
       a.session_generation AS a_generation, a.ack_deadline AS a_ack_deadline,
       a.lease_expires_at AS a_lease_expires_at,
       k.host_id AS k_host_id, h.session_generation AS host_generation,
       h.revoked_at AS host_revoked_at
FROM unnest($1::uuid[], $2::integer[], $3::text[]) AS k (task_id, number, host_id)
JOIN attempts a ON a.task_id = k.task_id AND a.number = k.number
JOIN tasks t ON t.id = a.task_id
LEFT JOIN hosts h ON h.host_id = k.host_id
"""


#: ``_renew_unlocked``'s write: the leases ($1 task ids, $2 attempt numbers, $3
#: session generations as read) extended to $5, each only if still as read at
#: $4: attempt open, bound to that generation, not expired; task running at
#: that attempt (task and attempt rows locked in task id order, as every batch
#: locks them); the host's session that generation and not revoked.
_RENEW_WRITE_SQL = """
WITH l AS (
    SELECT a.task_id, a.number
    FROM unnest($1::uuid[], $2::integer[], $3::integer[]) AS v (task_id, number, generation)
    JOIN attempts a ON a.task_id = v.task_id AND a.number = v.number
    JOIN tasks t ON t.id = v.task_id
    JOIN hosts h ON h.host_id = a.host_id
    WHERE a.ended_at IS NULL
      AND a.session_generation = v.generation
      AND a.lease_expires_at > $4
      AND t.status = 'running'
      AND t.attempt = v.number
      AND h.session_generation = v.generation
      AND h.revoked_at IS NULL
    ORDER BY t.id
    FOR UPDATE OF t, a
)
UPDATE attempts a SET lease_expires_at = $5
FROM l
WHERE a.task_id = l.task_id AND a.number = l.number
RETURNING a.task_id::text AS task_id, a.number
"""


def _extend_leases_stmt() -> Any:
    r = _unnest_params("r", task_id=UUIDT, number=sa.Integer)
    return (
        attempts.update()
        .where(
            attempts.c.task_id == r.c.task_id,
            attempts.c.number == r.c.number,
            attempts.c.ended_at.is_(None),
        )
        .values(lease_expires_at=sa.bindparam("p_exp", type_=attempts.c.lease_expires_at.type))
    )
