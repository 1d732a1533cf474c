"""Fault: an actor crashes inside a running ``fleetlease serve`` process (the
actor kills that ``fleetlease soak`` injects). The serve runs with the chaos
hook (``FLEETLEASE_CHAOS_DIR``): on SIGUSR1 it arms the fail point named in
its arm file, and the next actor passing it crashes; the supervisor restarts
it from the database.

Invariant: the process survives (one serve start), the crashed actor is
restarted, every task still completes, and the shared database invariants
hold. Without the variable there is no hook (the default for SIGUSR1 applies),
which the production path relies on: nothing is installed."""

from __future__ import annotations

import pytest

from fleetlease.actors import failpoints
from fleetlease.ops.testing.cluster import Timings, wait_for
from tests.faults.conftest import MakeCluster

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "point", [failpoints.LEASE_AFTER_COMMIT_BEFORE_REPLY, failpoints.SCHEDULER_BEFORE_ASSIGN]
)
async def test_an_actor_crashed_through_the_chaos_hook_is_restarted_and_work_completes(
    make_cluster: MakeCluster, point: str
) -> None:
    cluster = await make_cluster(chaos=True, timings=Timings(lease_s=5, claim_s=10, ack_s=5))
    serve = await cluster.start_serve()
    await cluster.start_agent("h1", devices=2)
    ids = await cluster.submit(6, sim={"duration_s": 0.5}, max_attempts=3)
    await wait_for(
        lambda: cluster.states(ids),
        lambda s: any(v in ("dispatched", "running") for v in s.values()),
        timeout=60,
        what="a lease out",
    )
    mark = serve.mark()

    restarted = await cluster.crash_actor(0, point, seed=5)
    # Work arriving after the crash flows too.
    ids += await cluster.submit(4, sim={"duration_s": 0.2}, max_attempts=3)
    await cluster.wait_terminal(ids, timeout=120)

    [crash] = serve.named("actor.crash", since=mark)
    assert crash["reason"] == f"fail point {point} fired"
    assert serve.alive and serve.starts == 1, serve.tail()
    assert not serve.named("control_plane.started")[1:], "the control plane restarted"
    states = await cluster.states(ids)
    assert set(states.values()) == {"done"}, states
    await cluster.assert_invariants()
    print(f"actor kill at {point}: {restarted['actor']} restarted; {len(ids)} tasks done")


def test_no_chaos_hook_without_the_variable() -> None:
    import asyncio

    from fleetlease.ops.service import install_chaos_hook

    loop = asyncio.new_event_loop()
    try:
        assert install_chaos_hook(loop, env={}) is None
    finally:
        loop.close()


def test_arm_from_spec_parses_and_rejects_with_a_clear_error() -> None:
    try:
        assert failpoints.arm_from_spec("# soak\n\nreaper.before_expire count=2 seed=3\n") == (
            "reaper.before_expire"
        )
        assert failpoints._armed["reaper.before_expire"].remaining == 2
        assert failpoints.arm_from_spec("off") == "off"
        assert not failpoints._armed
        for bad, needle in [
            ("", "empty"),
            ("nope.point", "unknown fail point"),
            ("lease.before_commit count=x", "not a number"),
            ("lease.before_commit when=now", "bad fail point option"),
        ]:
            with pytest.raises(ValueError, match=needle):
                failpoints.arm_from_spec(bad)
    finally:
        failpoints.disarm()
