"""event feed: every change of a task's state is announced at its commit

A deferred constraint trigger on ``tasks`` calls ``pg_notify`` on the channel
``fleetlease_task_events`` for each inserted task and each change of a task's
``status`` or ``attempt``. It runs at commit, after every statement of the
transaction, so the attempt's host and device are already written, and
PostgreSQL delivers the notification only if the transaction commits, in
commit order, the same order to every listener. The payload is a JSON array
``[id, task_id, status, attempt, host_id, device_id, updated_at (epoch s)]``;
``id`` comes from the sequence ``task_event_ids`` and names the event the same
way on every ``serve`` process (``persistence/taskevents.py`` listens). A
notification never leaves its database, so deployments (and tests) with
databases of their own never hear each other's.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE SEQUENCE task_event_ids AS bigint")
    op.execute(
        """
        CREATE FUNCTION task_event_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            a_host text;
            a_device text;
        BEGIN
            IF NEW.attempt > 0 THEN
                SELECT host_id, device_id INTO a_host, a_device
                FROM attempts WHERE task_id = NEW.id AND number = NEW.attempt;
            END IF;
            PERFORM pg_notify(
                'fleetlease_task_events',
                json_build_array(
                    nextval('task_event_ids'), NEW.id, NEW.status, NEW.attempt,
                    a_host, a_device, extract(epoch FROM NEW.updated_at)
                )::text
            );
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        """
        CREATE CONSTRAINT TRIGGER task_event_insert AFTER INSERT ON tasks
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
        EXECUTE FUNCTION task_event_notify()
        """
    )
    op.execute(
        """
        CREATE CONSTRAINT TRIGGER task_event_update AFTER UPDATE OF status, attempt ON tasks
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
        WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.attempt IS DISTINCT FROM NEW.attempt)
        EXECUTE FUNCTION task_event_notify()
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER task_event_update ON tasks")
    op.execute("DROP TRIGGER task_event_insert ON tasks")
    op.execute("DROP FUNCTION task_event_notify()")
    op.execute("DROP SEQUENCE task_event_ids")
