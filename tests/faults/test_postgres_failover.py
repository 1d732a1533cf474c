"""PostgreSQL failover under load: a primary and a synchronous standby
(streaming replication from the embedded binaries), ``serve`` on the libpq
multi-host URL with ``target_session_attrs=read-write``, agents running tasks
and a user submitting through the API, recording every submit it was
answered. The primary is SIGKILLed mid-load (its connections close), or its
address first blackholed (as a machine lost: its connections hang), and the
standby promoted.

Invariants: ``serve`` carries on against the new primary without a restart;
requests in flight or made during the outage are answered ``unavailable``
and succeed when repeated; every acknowledged transition (submits, acks,
results) is in the new primary and the invariant checker finds nothing wrong
(``fleetlease.ops.testing.invariants``); every task finishes; a live view
(``task_events``) started before the failover is told of the gap and then
sees the tasks submitted on the new primary (the feed listens there again).

And the topology it rules out: with an asynchronous standby that fell behind,
the same failover loses acknowledged submits, and the audit names each."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, field

import pytest
import sqlalchemy as sa

from fleetlease.ops.client import OpsClient, OpsError, task_events
from fleetlease.ops.testing.cluster import Cluster, Timings, wait_for
from fleetlease.ops.testing.replication import ReplicatedPostgres
from tests.faults.conftest import MakeCluster

pytestmark = pytest.mark.chaos


@dataclass
class Submitter:
    """A user submitting one task at a time through ``serve``, repeating a
    request answered ``unavailable`` with the same ``request_id`` (so a
    submit whose reply was lost is not made twice)."""

    cluster: Cluster
    client: OpsClient
    acknowledged: list[str] = field(default_factory=list)
    #: Loop time of each acknowledgement.
    acked_at: list[float] = field(default_factory=list)
    #: (loop time, code) of every refused attempt.
    refused: list[tuple[float, str]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stop.is_set():
            request_id = uuid.uuid4().hex
            while True:
                try:
                    reply = await self.client.call(
                        "submit",
                        goal="failover",
                        payload={"sim": {"duration_s": 0.3}},
                        max_attempts=5,
                        backoff_base_s=0.0,
                        request_id=request_id,
                    )
                except OpsError as exc:
                    if exc.code != "unavailable":
                        raise
                    self.refused.append((loop.time(), exc.code))
                    await asyncio.sleep(0.1)  # a client's pause before repeating
                    continue
                task_id = str(reply["id"])
                self.acknowledged.append(task_id)
                self.acked_at.append(loop.time())
                self.cluster.acknowledged.submitted.add(task_id)
                break
            await asyncio.sleep(0.05)  # the load's pace: about ten submits a second


def agent_unavailable(cluster: Cluster, marks: dict[str, int]) -> int:
    """Requests of the agents answered ``unavailable`` (and repeated) since ``marks``."""
    return sum(
        e.get("code") == "unavailable"
        for h, a in cluster.agents.items()
        for e in a.proc.events()[marks[h] :]
    )


async def server_port(cluster: Cluster) -> int:
    assert cluster.engine is not None
    engine = cluster.engine

    async def read() -> int:
        async with engine.connect() as conn:
            return int((await conn.execute(sa.text("SELECT inet_server_port()"))).scalar_one())

    async def retried() -> int:
        while True:
            try:
                return await read()
            except (sa.exc.DBAPIError, OSError):
                await asyncio.sleep(0.2)

    return await asyncio.wait_for(retried(), 60)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["killed", "unreachable"])
async def test_promoting_the_synchronous_standby_loses_no_acknowledged_transition(
    make_cluster: MakeCluster, fault: str
) -> None:
    # killed: the primary's processes die, its connections close.
    # unreachable: as a machine lost, its address stops answering (a blackhole
    # in front of it): connections hang instead of closing.
    cluster = await make_cluster(
        replicated=True, pg_proxy=fault == "unreachable", timings=Timings(lease_s=4, ack_s=3)
    )
    pg = cluster.pg
    assert isinstance(pg, ReplicatedPostgres)
    assert cluster.serve_database_url.count(",") == 1  # the libpq multi-host form
    serve = await cluster.start_serve()
    await asyncio.gather(*(cluster.start_agent(h, devices=3) for h in ("h1", "h2")))
    client = await OpsClient(
        nats_url=cluster.nats.url, token=cluster.admin_token, prefix=cluster.prefix, user="admin"
    ).connect()
    submitter = Submitter(cluster, client)
    # A live view started before the failover: the changes it sees, by task.
    watched: dict[str, list[str]] = {}
    subscribed = asyncio.Event()
    gap = asyncio.Event()

    async def watch() -> None:
        async for event in task_events(client, subscribed=subscribed, wait_s=2, on_gap=gap.set):
            watched.setdefault(str(event["task_id"]), []).append(str(event["state"]))

    watcher = asyncio.ensure_future(watch())
    await asyncio.wait_for(subscribed.wait(), 30)
    load = asyncio.ensure_future(submitter.run())
    loop = asyncio.get_running_loop()
    try:
        # Mid-load: tasks finished, others running, when the primary dies.
        await wait_for(
            lambda: cluster.states(submitter.acknowledged),
            lambda s: (
                sum(v == "done" for v in s.values()) >= 5
                and sum(v == "running" for v in s.values()) >= 2
            ),
            timeout=60,
            what="5 tasks done and 2 running",
        )
        agent_marks = {h: a.proc.mark() for h, a in cluster.agents.items()}

        killed_at = loop.time()
        if cluster.pg_proxy is not None:
            cluster.pg_proxy.blackhole()
        await cluster.kill_primary()
        # The outage lasts until a user and an agent have been told `unavailable`.
        await wait_for(
            lambda: (
                any(t >= killed_at for t, _ in submitter.refused)
                and agent_unavailable(cluster, agent_marks) > 0
            ),
            timeout=60,
            what="a submit and an agent's request answered unavailable",
        )
        promote_from = loop.time()
        await cluster.promote_standby()
        promoted_at = loop.time()
        acknowledged_before = len(submitter.acknowledged)
        await wait_for(
            lambda: len(submitter.acknowledged) >= acknowledged_before + 10,
            timeout=60,
            what="10 more submits acknowledged after the promotion",
        )
    finally:
        submitter.stop.set()
        await load

    assert await server_port(cluster) == pg.standby.port
    await cluster.wait_terminal(submitter.acknowledged, timeout=120)

    # The live view carries on on the new primary: what committed while the
    # control plane's feed was not listening there yet is a gap, which the view
    # is told of; the tasks submitted after that are seen to their end.
    await asyncio.wait_for(gap.wait(), 60)
    fresh = await cluster.submit(3)
    await cluster.wait_terminal(fresh, timeout=60)
    final = await cluster.states(fresh)
    try:
        await wait_for(
            lambda: all(final[t] in watched.get(t, []) for t in fresh),
            timeout=60,
            what="the live view saw the new tasks end",
        )
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, OpsError):
            await watcher
        await client.close()
    assert serve.alive and serve.starts == 1, serve.tail()
    # No actor crashed on the lost connections (nor wedged: the work went on).
    assert not serve.named("actor.crash"), serve.named("actor.crash")
    assert all(a.proc.alive for a in cluster.agents.values())
    report = await cluster.assert_invariants()
    refused = [t for t, _ in submitter.refused if t >= killed_at]
    first_after = min(t for t in submitter.acked_at if t >= promoted_at)
    print(
        f"failover ({fault}): primary lost -> first submit acknowledged on the new primary "
        f"{first_after - killed_at:.1f}s (pg_ctl promote {promoted_at - promote_from:.2f}s, "
        f"then {first_after - promoted_at:.2f}s to the first acknowledgement); "
        f"{len(refused)} submit attempts answered unavailable, "
        f"{agent_unavailable(cluster, agent_marks)} agent "
        f"events with unavailable; {len(submitter.acknowledged)} tasks {report.by_state}"
    )


@pytest.mark.timeout(120)
async def test_asynchronous_replication_loses_acknowledged_submits_and_the_audit_says_so(
    make_cluster: MakeCluster,
) -> None:
    # What the supported topology rules out, shown: with an asynchronous
    # standby that has fallen behind, submits are acknowledged that only the
    # primary has; promoting the standby after the primary's loss rolls them
    # back, and the acknowledged-transitions audit reports each one.
    cluster = await make_cluster(replicated=True, synchronous=False)
    pg = cluster.pg
    assert isinstance(pg, ReplicatedPostgres)
    kept = await cluster.submit(3)
    # The standby has the first three.
    await wait_for(
        lambda: asyncio.to_thread(
            pg.primary.psql,
            "SELECT bool_and(replay_lsn >= pg_current_wal_lsn()) FROM pg_stat_replication",
        ),
        lambda v: v == "t",
        timeout=30,
        what="the standby caught up",
    )
    await asyncio.to_thread(pg.detach_standby)
    lost = await cluster.submit(5)  # acknowledged: committed on the primary alone
    await cluster.kill_primary()
    await cluster.promote_standby()

    report = await cluster.check(allow_active=True)
    missing = {
        v.split()[1].rstrip(":")
        for v in report.violations
        if "submit was acknowledged but the task is not in the database" in v
    }
    assert missing == set(lost)
    assert set(kept) <= set(await cluster.states(kept))
