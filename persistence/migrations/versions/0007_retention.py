"""retention: a project's own retention of finished tasks

``projects.retain_s``: how long a finished task of the project (its attempts,
log lines and artifacts) is kept, in seconds; NULL follows the control
plane's default (``serve --retain``), 0 keeps them forever. The partial index
on the finished tasks' ``(project, finished_at)`` serves the collector's scan
for each project's expired tasks.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("projects", sa.Column("retain_s", sa.BigInteger(), nullable=True))
    op.create_check_constraint(
        op.f("ck_projects_retain_s"), "projects", "retain_s IS NULL OR retain_s >= 0"
    )
    op.create_index(
        "ix_tasks_finished",
        "tasks",
        ["project", "finished_at"],
        postgresql_where=sa.text("status IN ('done', 'failed', 'cancelled')"),
    )


def downgrade() -> None:
    op.drop_index("ix_tasks_finished", table_name="tasks")
    op.drop_constraint(op.f("ck_projects_retain_s"), "projects", type_="check")
    op.drop_column("projects", "retain_s")
