"""Drain with real agent processes: a drained host's agent finishes what it runs
and may then be stopped (SIGTERM) without losing a task; past the deadline its
attempt is handed back and completes on another host; the drain survives a
restart of the control plane.

The control plane runs in the test process (``ControlPlaneService``) and the
drain verbs go through its user API (``OpsApi.handle``), as the CLI's do."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from typing import Any

from tests.integration.test_agent import System, eventually
from tests.integration.test_agent_process import (
    Processes,
    journal_entries,
    make_system,  # noqa: F401
    procs,  # noqa: F401
)


async def ops(system: System, verb: str, **args: Any) -> Any:
    """A user API request as a platform admin."""
    token = system.credentials.get("__ops_admin__")
    if token is None:
        token = await system.repo.add_user("opsadmin", platform_admin=True)
        system.credentials["__ops_admin__"] = token
    assert system.service is not None and system.service.ops is not None
    return await system.service.ops.handle(verb, token, args)


async def busy_devices(system: System, host_id: str) -> list[dict[str, Any]]:
    rows = await ops(system, "devices", host=host_id)
    return [d for d in rows if d["task_id"] is not None]


async def test_a_drained_hosts_agent_finishes_its_task_then_stops_losing_nothing(
    procs: Callable[..., Awaitable[Processes]],  # noqa: F811
) -> None:
    p = await procs(lease_s=4.0)
    system = p.system
    await system.add_host("h-a")
    agent_a = p.spawn("h-a", grace_s=0.5)
    await agent_a.wait_event("agent_registered")
    running = await system.submit({"duration_s": 2.0})
    await eventually(
        lambda: system.view(running),
        lambda v: v["state"] == "running" and v["attempts"][0]["host_id"] == "h-a",
    )

    drained = await ops(system, "host_drain", host_id="h-a")
    assert drained["active"] == 1 and drained["deadline"] is None

    # The running task finishes where it is.
    first = await system.wait_state(running, "done", timeout=60)
    assert [a["host_id"] for a in first["attempts"]] == ["h-a"]
    # Submitted once h-a is idle but drained: it waits for, and runs on, another host.
    later = await system.submit({"duration_s": 0.05})
    await system.start_agent("h-b", devices=1)
    second = await system.wait_state(later, "done", timeout=60)
    assert [a["host_id"] for a in second["attempts"]] == ["h-b"]

    # Idle now (what `host drain --wait` waits for): stopping its agent loses nothing.
    await eventually(lambda: busy_devices(system, "h-a"), lambda busy: busy == [])
    agent_a.proc.send_signal(signal.SIGTERM)
    assert await agent_a.wait_exit() == 0
    assert not agent_a.named("attempt_handed_back")
    assert journal_entries(system, "h-a") == []
    for task_id in (running, later):
        view = await system.view(task_id)
        assert view["state"] == "done" and len(view["attempts"]) == 1


async def test_past_the_deadline_the_attempt_is_handed_back_and_completes_elsewhere(
    procs: Callable[..., Awaitable[Processes]],  # noqa: F811
) -> None:
    p = await procs(lease_s=4.0)
    system = p.system
    await system.add_host("h-a")
    agent_a = p.spawn("h-a", grace_s=0.5)
    await agent_a.wait_event("agent_registered")
    task_id = await system.submit({"duration_s": 3.0})
    await system.wait_state(task_id, "running")

    out = await ops(system, "host_drain", host_id="h-a", deadline_s=0)
    assert out["deadline"] is not None
    handed = await system.wait_state(task_id, "queued", "retrying", "assigned", timeout=30)
    assert handed["attempts"][0]["end_reason"] == "drained"
    await system.start_agent("h-b", devices=1)

    view = await system.wait_state(task_id, "done", timeout=60)
    assert [a["host_id"] for a in view["attempts"]] == ["h-a", "h-b"]
    assert [a["end_reason"] for a in view["attempts"]] == ["drained", "done"]
    # Agent A learns that its attempt is gone and keeps nothing of it.
    await eventually(lambda: _journal(system, "h-a"), lambda entries: entries == [])
    agent_a.proc.send_signal(signal.SIGTERM)
    assert await agent_a.wait_exit() == 0


async def _journal(system: System, host_id: str) -> list[Any]:
    return journal_entries(system, host_id)


async def test_the_drain_survives_a_control_plane_restart(
    procs: Callable[..., Awaitable[Processes]],  # noqa: F811
) -> None:
    p = await procs()
    system = p.system
    await system.add_host("h-a")
    agent_a = p.spawn("h-a")
    await agent_a.wait_event("agent_registered")
    await ops(system, "host_drain", host_id="h-a", deadline_s=3600)

    assert system.service is not None
    await system.service.stop()
    await system.start_service()

    (host,) = [h for h in await ops(system, "hosts") if h["host_id"] == "h-a"]
    assert host["drain"] is not None and host["drain"]["deadline"] is not None
    task_id = await system.submit({"duration_s": 0.05})
    await system.start_agent("h-b", devices=1)
    view = await system.wait_state(task_id, "done", timeout=60)
    assert [a["host_id"] for a in view["attempts"]] == ["h-b"]

    await ops(system, "host_undrain", host_id="h-a")
    (host,) = [h for h in await ops(system, "hosts") if h["host_id"] == "h-a"]
    assert host["drain"] is None
