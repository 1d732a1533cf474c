"""what each attempt's log holds, for its caps

``Repository.append_logs`` keeps a running count of an attempt's log lines and
bytes on the attempt's row, and whether the log was truncated at its cap, so
that checking the cap costs no count over ``log_lines``. Existing attempts get
their counts from the lines already stored.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "attempts", sa.Column("log_lines", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column(
        "attempts", sa.Column("log_bytes", sa.BigInteger(), nullable=False, server_default="0")
    )
    op.add_column(
        "attempts",
        sa.Column("log_truncated", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.execute(
        """
        UPDATE attempts AS a
           SET log_lines = c.n, log_bytes = c.b
          FROM (SELECT task_id, attempt, count(*) AS n, sum(octet_length(line)) AS b
                  FROM log_lines GROUP BY task_id, attempt) AS c
         WHERE a.task_id = c.task_id AND a.number = c.attempt
        """
    )


def downgrade() -> None:
    op.drop_column("attempts", "log_truncated")
    op.drop_column("attempts", "log_bytes")
    op.drop_column("attempts", "log_lines")
