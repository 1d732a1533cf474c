"""replay_nonces: the signed host messages seen, shared by every control plane

One row per signed host message (and Register proof) accepted within the
replay window: its sender scope (the host id, or ``register:<host id>`` for a
Register proof) and nonce, and when the row may go (the message's timestamp
plus the window). Every ``serve`` process inserts before it acts on a message,
so a message replayed to any of them is refused once. Rows are deleted in
bounded batches once past ``expires_at`` (``Repository.prune_nonces``); the
index on ``expires_at`` serves that deletion.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replay_nonces",
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("nonce", sa.LargeBinary(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("scope", "nonce", name=op.f("pk_replay_nonces")),
    )
    op.create_index("ix_replay_nonces_expires_at", "replay_nonces", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_replay_nonces_expires_at", table_name="replay_nonces")
    op.drop_table("replay_nonces")
