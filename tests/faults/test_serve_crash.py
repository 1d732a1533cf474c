"""Fault: ``fleetlease serve`` is SIGKILLed while many leases are out, then
started again.

Invariant: the restarted control plane rebuilds its leases from the database;
every task ends terminal; no device or task is ever reserved twice; the hosts
keep working (re-registering if they must) and report results after the restart."""

from __future__ import annotations

import asyncio

import pytest

from fleetlease.ops.testing.cluster import wait_for
from tests.faults.conftest import MakeCluster

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(180)
async def test_sigkill_of_serve_with_leases_out_loses_nothing(make_cluster: MakeCluster) -> None:
    cluster = await make_cluster()
    await cluster.start_serve()
    hosts = ["h1", "h2", "h3"]
    await asyncio.gather(*(cluster.start_agent(h, devices=4) for h in hosts))
    ids = await cluster.submit(36, sim={"duration_s": 1.5}, max_attempts=5)

    def running(states: dict[str, str]) -> bool:
        return sum(s == "running" for s in states.values()) >= 8

    await wait_for(lambda: cluster.states(ids), running, timeout=60, what="8 leases out")
    marks = {h: cluster.agents[h].proc.mark() for h in hosts}
    serve = cluster.serves[0]
    since = serve.mark()
    loop = asyncio.get_running_loop()
    killed_at = loop.time()
    await cluster.kill_serve()
    assert serve.returncode == -9

    await cluster.start_serve()
    started = await serve.wait_event("control_plane.started", since=since)
    assert started["active_attempts"] > 0, "the restarted control plane found no leases to rebuild"

    await cluster.wait_terminal(ids, timeout=120)
    await cluster.assert_invariants()
    # Hosts kept going: every agent is alive and got results recorded after the restart.
    for h in hosts:
        agent = cluster.agents[h].proc
        assert agent.alive, agent.tail()
        assert agent.named("result_reported", since=marks[h]), f"{h} reported nothing after"
    first = loop.time() - killed_at
    print(
        f"serve SIGKILL: rebuilt {started['active_attempts']} leases; "
        f"all {len(ids)} tasks terminal {first:.1f}s after the kill"
    )
