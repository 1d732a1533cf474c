"""Workflow matching: a workflow task goes only to a device of a host that
serves the workflow.

A host advertises the workflows it serves with every heartbeat
(``HostAdvert``); ``hosts.workflows`` keeps the last list, NULL meaning "any
workflow" (agents that do not say, simulated runners). Goal tasks (no
workflow) match every host. The same rule is applied in SQL (ranking the
candidates of an assignment) and in Python (pairing them with free devices).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.model import HostAdvert
from fleetlease.persistence.tables import hosts

__all__ = [
    "MAX_ADVERTISED_WORKFLOWS",
    "advert_params",
    "advert_stmt",
    "host_serves",
    "serves_workflow",
    "waiting_reason",
]

MAX_ADVERTISED_WORKFLOWS = 1000
#: The longest workflow or goal-runner name a host may advertise (the wire's name limit).
MAX_ADVERTISED_NAME = 128


def serves_workflow(workflow: Any, host_workflows: Any) -> sa.ColumnElement[bool]:
    """SQL: a task of ``workflow`` may run on a host advertising ``host_workflows``."""
    return sa.or_(workflow.is_(None), host_workflows.is_(None), workflow == sa.any_(host_workflows))


def host_serves(host_workflows: Sequence[str] | None, workflow: str | None) -> bool:
    """Python twin of ``serves_workflow``."""
    return workflow is None or host_workflows is None or workflow in host_workflows


def advert_stmt() -> Any:
    """Store a host's advert; a heartbeat repeating the stored one writes nothing."""
    w = sa.bindparam("p_workflows", type_=hosts.c.workflows.type)
    g = sa.bindparam("p_goal_runner", type_=sa.Text)
    return (
        hosts.update()
        .where(
            hosts.c.host_id == sa.bindparam("p_host_id", type_=sa.Text),
            sa.or_(hosts.c.workflows.is_distinct_from(w), hosts.c.goal_runner.is_distinct_from(g)),
        )
        .values(workflows=w, goal_runner=g)
    )


def advert_params(host_id: str, advert: HostAdvert) -> dict[str, Any]:
    """The parameters of ``advert_stmt``; ``ValueError`` for a malformed advert."""
    workflows = advert.workflows
    if workflows is not None:
        if len(workflows) > MAX_ADVERTISED_WORKFLOWS or not all(
            isinstance(w, str) and 0 < len(w) <= MAX_ADVERTISED_NAME for w in workflows
        ):
            raise ValueError(
                f"workflows must be at most {MAX_ADVERTISED_WORKFLOWS} names of "
                f"1..{MAX_ADVERTISED_NAME} characters"
            )
        workflows = tuple(sorted(set(workflows)))
    goal_runner = advert.goal_runner
    if not isinstance(goal_runner, str) or len(goal_runner) > MAX_ADVERTISED_NAME:
        raise ValueError(
            f"goal_runner must be a string of at most {MAX_ADVERTISED_NAME} characters"
        )
    return {
        "p_host_id": host_id,
        "p_workflows": None if workflows is None else list(workflows),
        "p_goal_runner": goal_runner or None,
    }


async def waiting_reason(
    conn: AsyncConnection, now: datetime, liveness_s: float, workflow: str | None
) -> str | None:
    """Why a waiting task of ``workflow`` cannot be assigned, when the reason is
    that no live host serves it (None otherwise)."""
    if workflow is None:
        return None
    live = sa.and_(
        hosts.c.revoked_at.is_(None),
        hosts.c.session_generation > 0,
        hosts.c.last_seen > now - timedelta(seconds=liveness_s),
    )
    serving = await conn.scalar(
        sa.select(sa.func.count()).where(
            live, serves_workflow(sa.literal(workflow), hosts.c.workflows)
        )
    )
    if serving:
        return None
    return f"no live host serves workflow {workflow!r}"
