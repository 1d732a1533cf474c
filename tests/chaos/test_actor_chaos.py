"""Chaos: kill Lease actors, the Scheduler and the Reaper at random points
(including between a commit and its reply, through fail points) while simulated
hosts run hundreds of tasks; then check the database kept every promise.

Fixed seed, part of the normal suite; the soak variant runs with ``--soak``."""

from __future__ import annotations

from collections.abc import Iterator

import pykka
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.actors import failpoints
from fleetlease.actors.runtime import ControlPlane
from fleetlease.persistence.clock import ManualClock
from fleetlease.persistence.model import LeaseTimings
from fleetlease.persistence.repository import Repository
from tests.chaos.workload import ChaosConfig, run_chaos, verify

TIMINGS = LeaseTimings(claim_s=30, ack_s=15, lease_s=30, liveness_s=1_000_000)


@pytest.fixture(autouse=True)
def _stop_all_actors() -> Iterator[None]:
    yield
    failpoints.disarm()
    pykka.ActorRegistry.stop_all(timeout=30)


async def _chaos(engine: AsyncEngine, clock: ManualClock, cfg: ChaosConfig) -> None:
    repo = Repository(engine, clock, TIMINGS)
    await repo.add_user("admin", platform_admin=True)
    await repo.add_project("default", owner="admin")
    cp = ControlPlane(repo, scheduler_interval_s=0.2, ask_timeout_s=20)
    await cp.start()
    try:
        log, ids = await run_chaos(cp, repo, clock, cfg)
    finally:
        await cp.stop()
    await verify(engine, log, ids, cfg)
    print(
        f"chaos: kills={dict(log.kills)} lost_replies={log.lost_replies} "
        f"abandoned={log.abandoned} replays={sum(r.replayed for r in log.records)} "
        f"metrics={cp.metrics}"
    )
    # The run exercised what it claims to.
    restarts = cp.metrics
    assert sum(log.kills.values()) > 0
    assert restarts.get("restarts.lease", 0) > 0
    assert restarts.get("restarts.scheduler", 0) > 0
    assert restarts.get("restarts.reaper", 0) > 0
    assert log.lost_replies > 0
    assert any(r.replayed for r in log.records)


@pytest.mark.chaos
async def test_killing_actors_at_random_points_loses_nothing(
    engine: AsyncEngine, clock: ManualClock
) -> None:
    await _chaos(engine, clock, ChaosConfig())


@pytest.mark.soak
@pytest.mark.timeout(900)
async def test_soak_killing_actors_for_thousands_of_tasks(
    engine: AsyncEngine, clock: ManualClock
) -> None:
    await _chaos(
        engine,
        clock,
        ChaosConfig(
            seed=7,
            tasks=3000,
            hosts=10,
            devices_per_host=10,
            kill_every_s=0.01,
            lease_after_commit=0.05,
            # Slower simulated time, so that 10 hosts keep up with 100 devices and
            # expiries come from the chaos rather than from the pace.
            clock_every_s=0.05,
            deadline_s=600,
        ),
    )
