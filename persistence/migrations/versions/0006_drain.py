"""drain: hosts and devices that take no new assignment

``hosts.drain_requested_at`` set means the host is drained: it takes no new
assignment, its active attempts run on, and past ``hosts.drain_deadline`` (if
set) they are handed back. ``device_drains`` lists drained devices; it is a
table of its own because each heartbeat replaces the host's ``devices`` rows.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("hosts", sa.Column("drain_requested_at", TS, nullable=True))
    op.add_column("hosts", sa.Column("drain_deadline", TS, nullable=True))
    op.create_table(
        "device_drains",
        sa.Column(
            "host_id",
            sa.Text(),
            sa.ForeignKey("hosts.host_id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("device_id", sa.Text(), primary_key=True),
        sa.Column("requested_at", TS, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("device_drains")
    op.drop_column("hosts", "drain_deadline")
    op.drop_column("hosts", "drain_requested_at")
