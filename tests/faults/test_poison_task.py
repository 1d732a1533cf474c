"""Fault: a task that kills its agent on every attempt (sim outcome
``kill_agent``: the agent process SIGKILLs itself while running it); a
supervisor restarts the agent each time, as ``fleetlease up`` does.

Invariant: the task ends ``failed`` after its max attempts and stays failed;
the control plane never crashes or restarts meanwhile (one serve process
throughout) and other work keeps flowing afterwards; the shared database
invariants hold."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from ops.cluster import Cluster
from tests.faults.conftest import MakeCluster

pytestmark = pytest.mark.chaos


async def supervise(cluster: Cluster, host_id: str, deaths: list[int]) -> None:
    """Restart the agent whenever it dies, as ``fleetlease up`` does: after 1 s,
    doubling each time (up to 30 s). Counts the deaths.

    A supervisor restarting at once never lets the poison attempt end: the
    restarted agent resumes it from its journal, the reconciliation confirms it
    and renews its lease, and the runner kills the agent again (reported as a
    bug: 213 restarts in 150 s with lease_s=2, attempt 1 never expired)."""
    delay = 1.0
    while True:
        proc = cluster.agents[host_id].proc
        code = await proc.wait_exit(3600)
        deaths.append(code)
        await asyncio.sleep(delay)  # the supervisor's restart policy
        delay = min(delay * 2, 30.0)
        await cluster.start_agent(host_id, devices=1, wait=False)


@pytest.mark.timeout(180)
async def test_a_task_that_kills_its_agent_every_time_ends_failed_after_max_attempts(
    make_cluster: MakeCluster,
) -> None:
    cluster = await make_cluster()
    serve = await cluster.start_serve()
    await cluster.start_agent("h1", devices=1)
    deaths: list[int] = []
    supervisor = asyncio.ensure_future(supervise(cluster, "h1", deaths))
    try:
        [poison] = await cluster.submit(
            1, sim={"duration_s": 0.1, "outcome": "kill_agent"}, max_attempts=2
        )
        view = await cluster.wait_view(
            poison, lambda v: v["state"] == "failed", timeout=150, what="poison task failed"
        )
        assert view["attempt"] == view["max_attempts"] == 2
        # Other work still flows through the same (restarted) agent.
        [healthy] = await cluster.submit(1)
        await cluster.wait_terminal([healthy], timeout=60)
        assert (await cluster.view(healthy))["state"] == "done"
    finally:
        supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await supervisor
    assert serve.alive and serve.starts == 1, serve.tail()
    assert not serve.named("control_plane.started")[1:], "the control plane restarted"
    assert (await cluster.view(poison))["state"] == "failed"
    await cluster.assert_invariants()
    print(
        f"poison task: failed after {view['attempt']} attempts "
        f"({[a['end_reason'] for a in view['attempts']]}), agent died {len(deaths)} times"
    )
