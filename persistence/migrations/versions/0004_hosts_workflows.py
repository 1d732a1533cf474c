"""the workflows a host serves, and its goal runner

A host advertises, with every heartbeat, the workflows it has definitions for;
a workflow task is assigned only to a device of a host serving it. NULL (hosts
of agents that do not say, simulated runners) means any workflow.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("hosts", sa.Column("workflows", ARRAY(sa.Text()), nullable=True))
    op.add_column("hosts", sa.Column("goal_runner", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("hosts", "goal_runner")
    op.drop_column("hosts", "workflows")
