"""Liveness and readiness.

``/healthz`` is the process answering at all (its listener thread runs).
``/readyz`` of ``serve`` is every check below passing, read on the event loop
within a bound (an unresponsive loop is not ready either):

* ``database``: PostgreSQL answers a query through the service's pool;
* ``migrations``: the schema's Alembic revision is the code's head;
* ``nats``: every serving connection of the NATS server is connected;
* ``actors``: the control plane is started and its Scheduler and Reaper alive.

An agent's ``/readyz`` is its session being registered and reconciled.
The answer is JSON, ``{"ready": bool, "checks": {name: {"ok": bool, "detail": str}}}``,
with status 200 when ready and 503 when not.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import sqlalchemy as sa

from fleetlease.ops.observe.collectors import on_loop


@functools.cache
def migration_heads() -> frozenset[str]:
    """The Alembic heads of the code's migrations (read once)."""
    from alembic.script import ScriptDirectory

    from fleetlease.persistence.migrate import alembic_config

    return frozenset(ScriptDirectory.from_config(alembic_config()).get_heads())


def _check(ok: bool, detail: str) -> dict[str, Any]:
    return {"ok": bool(ok), "detail": detail}


def _error(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__)[:300]


async def service_checks(service: Any, heads: frozenset[str], timeout_s: float) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    engine = service.engine
    revisions: set[str] | None = None
    if engine is None:
        checks["database"] = _check(False, "not started")
    else:
        try:
            async with asyncio.timeout(timeout_s), engine.connect() as conn:
                result = await conn.execute(sa.text("SELECT version_num FROM alembic_version"))
                revisions = {str(r[0]) for r in result}
            checks["database"] = _check(True, "reachable")
        except Exception as exc:
            checks["database"] = _check(False, _error(exc))
    if revisions is None:
        checks["migrations"] = _check(False, "unknown (database not reachable)")
    elif revisions == heads:
        checks["migrations"] = _check(True, f"at {', '.join(sorted(heads))}")
    else:
        checks["migrations"] = _check(
            False,
            f"schema at {', '.join(sorted(revisions)) or 'nothing'}, "
            f"code expects {', '.join(sorted(heads))}",
        )
    server = service.server
    down = server.disconnected_channels() if server is not None else None
    if down is None:
        checks["nats"] = _check(False, "not started")
    else:
        checks["nats"] = _check(
            not down, f"disconnected: {', '.join(down)}" if down else "connected"
        )
    cp = service.control_plane
    if cp is None or not cp.accepting:
        checks["actors"] = _check(False, "not running")
    else:
        dead = [name for name, alive in cp.actors_alive().items() if not alive]
        checks["actors"] = _check(
            cp.supervisor.running and not dead,
            f"dead: {', '.join(dead)}" if dead else "running",
        )
    return checks


def service_readiness(
    service: Any, loop: asyncio.AbstractEventLoop, timeout_s: float = 3.0
) -> dict[str, Any]:
    """The readiness of a ``ControlPlaneService`` (call from any thread but the loop's)."""
    try:
        heads = migration_heads()
        checks = on_loop(loop, lambda: service_checks(service, heads, timeout_s), timeout_s + 0.5)
    except Exception as exc:
        checks = {"event_loop": _check(False, f"no answer: {_error(exc)}")}
    return {"ready": all(c["ok"] for c in checks.values()), "checks": checks}


def agent_readiness(
    agent: Any, loop: asyncio.AbstractEventLoop, timeout_s: float = 3.0
) -> dict[str, Any]:
    async def read() -> bool:
        return bool(agent.registered)

    try:
        registered = on_loop(loop, read, timeout_s)
        checks = {"session": _check(registered, "registered" if registered else "not registered")}
    except Exception as exc:
        checks = {"event_loop": _check(False, f"no answer: {_error(exc)}")}
    return {"ready": all(c["ok"] for c in checks.values()), "checks": checks}
