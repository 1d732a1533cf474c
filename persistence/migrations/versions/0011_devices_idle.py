"""idle devices indexed by host

The assignment reads its sample of the free devices host by host (live hosts
by primary key, a host's idle devices by this index): a host whose devices
are all busy costs one index probe, not a read of each of its device rows, so
a mostly busy fleet's pass does not visit every device.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_devices_idle",
        "devices",
        ["host_id", "device_id"],
        unique=False,
        postgresql_where=sa.text("state = 'idle'"),
    )


def downgrade() -> None:
    op.drop_index("ix_devices_idle", table_name="devices")
