"""a submitter's idempotency key on tasks

A client whose submit reply was lost (a timeout, a dropped connection, a
database failover after the commit) could not tell whether the task exists, and
a retry made a second one. With a request id the retry returns the first task:
the key is unique per owner.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("request_id", sa.Text(), nullable=True))
    op.create_index(
        "ux_tasks_owner_request",
        "tasks",
        ["owner", "request_id"],
        unique=True,
        postgresql_where=sa.text("request_id IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ux_tasks_owner_request", table_name="tasks")
    op.drop_column("tasks", "request_id")
