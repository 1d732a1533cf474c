"""The schema, as SQLAlchemy Core tables. Alembic migrations in
``persistence/migrations`` must produce exactly this (a test compares them)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from fleetlease.persistence.model import TaskKind, TaskState

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

TS = sa.DateTime(timezone=True)


def _in(values: object) -> str:
    return ", ".join(f"'{v}'" for v in values)  # type: ignore[attr-defined]


users = sa.Table(
    "users",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("token_hash", sa.LargeBinary, nullable=False, unique=True),
    sa.Column("platform_admin", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("created_at", TS, nullable=False),
)

projects = sa.Table(
    "projects",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("owner", sa.Text, sa.ForeignKey("users.name"), nullable=False),
    sa.Column("created_at", TS, nullable=False),
    # How long the project's finished tasks are kept, seconds (migration 0007):
    # NULL follows the control plane's default, 0 keeps them forever.
    sa.Column("retain_s", sa.BigInteger),
    sa.CheckConstraint("retain_s IS NULL OR retain_s >= 0", name="retain_s"),
)

project_admins = sa.Table(
    "project_admins",
    metadata,
    sa.Column(
        "project", sa.Text, sa.ForeignKey("projects.name", ondelete="CASCADE"), primary_key=True
    ),
    sa.Column(
        "user_name", sa.Text, sa.ForeignKey("users.name", ondelete="CASCADE"), primary_key=True
    ),
)

hosts = sa.Table(
    "hosts",
    metadata,
    sa.Column("host_id", sa.Text, primary_key=True),
    sa.Column("credential_hash", sa.LargeBinary, nullable=False),
    # Generation of the current session; every older generation is dead.
    sa.Column("session_generation", sa.Integer, nullable=False, server_default="0"),
    sa.Column("session_started_at", TS),
    sa.Column("last_seen", TS),
    sa.Column("revoked_at", TS),
    sa.Column("created_at", TS, nullable=False),
    # The workflows the host serves (its last heartbeat); NULL: any workflow.
    sa.Column("workflows", ARRAY(sa.Text)),
    sa.Column("goal_runner", sa.Text),
    # Drain (see persistence/repository/drain.py): set, the host takes no new
    # assignment; past the deadline (if any) its active attempts are handed back.
    sa.Column("drain_requested_at", TS),
    sa.Column("drain_deadline", TS),
    # The host's tag of its last complete device snapshot this session (NULL:
    # none) and when it was written: a heartbeat "unchanged since <tag>" then
    # writes last_seen only (see persistence/repository/hosts.py).
    sa.Column("devices_digest", sa.Text),
    sa.Column("devices_synced_at", TS),
)

devices = sa.Table(
    "devices",
    metadata,
    sa.Column(
        "host_id", sa.Text, sa.ForeignKey("hosts.host_id", ondelete="CASCADE"), primary_key=True
    ),
    sa.Column("device_id", sa.Text, primary_key=True),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("capabilities", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("updated_at", TS, nullable=False),
    sa.CheckConstraint("state IN ('idle', 'busy', 'offline')", name="state"),
)
# The assignment's sample of the free devices, host by host (migration 0011).
sa.Index(
    "ix_devices_idle",
    devices.c.host_id,
    devices.c.device_id,
    postgresql_where=sa.text("state = 'idle'"),
)

# Drained devices: kept apart from ``devices``, whose rows each heartbeat
# replaces, so a drain outlives the device's reports (and its detaching).
device_drains = sa.Table(
    "device_drains",
    metadata,
    sa.Column(
        "host_id", sa.Text, sa.ForeignKey("hosts.host_id", ondelete="CASCADE"), primary_key=True
    ),
    sa.Column("device_id", sa.Text, primary_key=True),
    sa.Column("requested_at", TS, nullable=False),
)

tasks = sa.Table(
    "tasks",
    metadata,
    sa.Column("id", sa.Uuid(as_uuid=False), primary_key=True),
    # Submission order, for FIFO within a priority (the injected clock may tie).
    sa.Column("seq", sa.BigInteger, sa.Identity(), nullable=False, unique=True),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("goal", sa.Text),
    sa.Column("workflow", sa.Text),
    sa.Column("payload", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("selector", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
    sa.Column("project", sa.Text, sa.ForeignKey("projects.name"), nullable=False),
    sa.Column("owner", sa.Text, sa.ForeignKey("users.name"), nullable=False),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("backoff_base_s", sa.Float, nullable=False),
    sa.Column("backoff_cap_s", sa.Float, nullable=False),
    sa.Column("eligible_at", TS, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False, server_default="0"),
    sa.Column("cancel_requested_at", TS),
    sa.Column("cancel_requested_by", sa.Text),
    sa.Column("terminal_reason", sa.Text),
    sa.Column("result", JSONB),
    sa.Column("result_fingerprint", sa.Text),
    sa.Column("result_attempt", sa.Integer),
    sa.Column("progress_seq", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("reconcile_outcome", sa.Text),
    sa.Column("reconciled_at", TS),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
    sa.Column("finished_at", TS),
    # The submitter's idempotency key (migration 0003), unique per owner.
    sa.Column("request_id", sa.Text),
    sa.CheckConstraint(f"status IN ({_in(TaskState)})", name="status"),
    sa.CheckConstraint(f"kind IN ({_in(TaskKind)})", name="kind"),
    sa.CheckConstraint("max_attempts >= 1", name="max_attempts"),
    sa.CheckConstraint("attempt >= 0 AND attempt <= max_attempts", name="attempt"),
    sa.Index(
        "ix_tasks_waiting",
        "priority",
        "seq",
        postgresql_where=sa.text("status IN ('queued', 'retrying')"),
    ),
    sa.Index("ix_tasks_status", "status"),
    sa.Index("ix_tasks_owner", "owner"),
)
# A repeated submit finds its first task by (owner, request id) (migration 0003).
sa.Index(
    "ux_tasks_owner_request",
    tasks.c.owner,
    tasks.c.request_id,
    unique=True,
    postgresql_where=tasks.c.request_id.isnot(None),
)
# The retention collector's scan for a project's expired tasks (migration 0007).
sa.Index(
    "ix_tasks_finished",
    tasks.c.project,
    tasks.c.finished_at,
    postgresql_where=sa.text("status IN ('done', 'failed', 'cancelled')"),
)
# The assigner's per-project scan in rank order (migration 0002).
sa.Index(
    "ix_tasks_waiting_project",
    tasks.c.project,
    tasks.c.priority.desc(),
    tasks.c.seq,
    postgresql_where=sa.text("status IN ('queued', 'retrying')"),
)

attempts = sa.Table(
    "attempts",
    metadata,
    sa.Column(
        "task_id",
        sa.Uuid(as_uuid=False),
        sa.ForeignKey("tasks.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    sa.Column("number", sa.Integer, primary_key=True),
    sa.Column("host_id", sa.Text, sa.ForeignKey("hosts.host_id"), nullable=False),
    sa.Column("device_id", sa.Text, nullable=False),
    sa.Column("lease_id", sa.Uuid(as_uuid=False), nullable=False, unique=True),
    # SHA-256 of the lease token; the raw token is never stored.
    sa.Column("lease_token_hash", sa.LargeBinary),
    sa.Column("session_generation", sa.Integer),
    sa.Column("assigned_at", TS, nullable=False),
    sa.Column("claim_deadline", TS, nullable=False),
    sa.Column("claimed_at", TS),
    sa.Column("ack_deadline", TS),
    sa.Column("acked_at", TS),
    sa.Column("lease_expires_at", TS),
    sa.Column("cancel_requested_at", TS),
    sa.Column("ended_at", TS),
    sa.Column("end_reason", sa.Text),
    # What the attempt's log holds so far (``Repository.append_logs`` caps it).
    sa.Column("log_lines", sa.Integer, nullable=False, server_default="0"),
    sa.Column("log_bytes", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("log_truncated", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Index("ix_attempts_host_active", "host_id", postgresql_where=sa.text("ended_at IS NULL")),
)

# One row per device that holds an active reservation. The primary key makes a
# second reservation of one device impossible; the unique task_id makes a second
# reservation for one task impossible. Every move out of assigned, dispatched or
# running deletes the row in the same transaction.
device_reservations = sa.Table(
    "device_reservations",
    metadata,
    sa.Column("host_id", sa.Text, primary_key=True),
    sa.Column("device_id", sa.Text, primary_key=True),
    sa.Column(
        "task_id", sa.Uuid(as_uuid=False), sa.ForeignKey("tasks.id"), nullable=False, unique=True
    ),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("reserved_at", TS, nullable=False),
)

log_lines = sa.Table(
    "log_lines",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column(
        "task_id",
        sa.Uuid(as_uuid=False),
        sa.ForeignKey("tasks.id", ondelete="CASCADE"),
        nullable=False,
    ),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("ts", TS, nullable=False),
    sa.Column("line", sa.Text, nullable=False),
    sa.UniqueConstraint("task_id", "attempt", "seq"),
)

artifacts = sa.Table(
    "artifacts",
    metadata,
    sa.Column(
        "task_id",
        sa.Uuid(as_uuid=False),
        sa.ForeignKey("tasks.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    sa.Column("attempt", sa.Integer, primary_key=True),
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("sha256", sa.Text, nullable=False),
    sa.Column("object_name", sa.Text, nullable=False),
    sa.Column("created_at", TS, nullable=False),
)

# The signed host messages (and Register proofs) accepted within the replay
# window, shared by every control-plane process (``persistence/repository/replay.py``):
# ``scope`` is the host id, or ``register:<host id>`` for a Register proof.
replay_nonces = sa.Table(
    "replay_nonces",
    metadata,
    sa.Column("scope", sa.Text, primary_key=True),
    sa.Column("nonce", sa.LargeBinary, primary_key=True),
    sa.Column("expires_at", TS, nullable=False, index=True),
)
