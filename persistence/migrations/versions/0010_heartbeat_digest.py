"""heartbeat digest: heartbeats that send and write only what changed

``hosts.devices_digest``: the host's tag of the device snapshot its last
complete heartbeat carried (NULL: none this session); ``hosts.devices_synced_at``:
when that snapshot was written. A heartbeat that says "unchanged since
<digest>" refreshes ``last_seen`` only, if the tag is the stored one and no
device row of the host changed since (see ``persistence/repository/hosts.py``).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("hosts", sa.Column("devices_digest", sa.Text(), nullable=True))
    op.add_column(
        "hosts", sa.Column("devices_synced_at", sa.DateTime(timezone=True), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("hosts", "devices_synced_at")
    op.drop_column("hosts", "devices_digest")
