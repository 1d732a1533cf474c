"""waiting tasks indexed by project, priority and seq

The assigner takes the first few waiting tasks of each project in rank order
(priority, then FIFO); with this index that is a short index scan per project
instead of ranking every waiting task on each assignment.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_tasks_waiting_project",
        "tasks",
        ["project", sa.text("priority DESC"), "seq"],
        unique=False,
        postgresql_where=sa.text("status IN ('queued', 'retrying')"),
    )


def downgrade() -> None:
    op.drop_index("ix_tasks_waiting_project", table_name="tasks")
