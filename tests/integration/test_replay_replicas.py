"""Replay protection shared by the control-plane replicas, against a real
PostgreSQL and nats-server: two ``ControlPlaneService``s on one database, one
NATS prefix and one state dir (one server secret), as two ``serve`` processes
of one fleet are.

A host message (heartbeat, renewal) and a Register proof accepted by replica 1
are captured off the wire and their exact bytes replayed once replica 1 has
stopped, so that replica 2 is the one that receives them: refused
(``unauthorized``, a replay) and nothing changes; replayed while both serve,
every copy is refused whichever replica takes it. The shared store failing
for real (its table locked past the check's timeout) refuses messages
``unavailable``, changes nothing, and the next message is served. The
ledger underneath: each nonce is new exactly once whichever process records
it, concurrent checks share one statement, and pruning is bounded.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats
import pytest
import sqlalchemy as sa
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.ops.service import ControlPlaneService
from fleetlease.persistence.clock import SystemClock
from fleetlease.persistence.db import create_engine
from fleetlease.persistence.repository import Repository
from fleetlease.transport import wire
from fleetlease.transport.auth import AuthError
from fleetlease.transport.client import HostClient
from fleetlease.transport.replay import SharedReplay
from fleetlease.transport.subjects import Subjects
from tests.inbox import reply_subject
from tests.integration.test_transport_e2e import System, start_service

pytestmark = pytest.mark.embedded

WAIT_S = 15.0


class Tap:
    """A plain (non-queue) subscription that sees every request on a subject,
    as an eavesdropper on the broker would: the exact bytes and reply subject."""

    def __init__(self) -> None:
        self.msgs: asyncio.Queue[Msg] = asyncio.Queue()

    async def on(self, nc: NatsClient, subject: str) -> None:
        async def capture(msg: Msg) -> None:
            self.msgs.put_nowait(msg)

        await nc.subscribe(subject, cb=capture)
        await nc.flush()

    async def next(self) -> Msg:
        return await asyncio.wait_for(self.msgs.get(), WAIT_S)


async def replay(nc: NatsClient, subjects: Subjects, captured: Msg) -> wire.Message:
    """``captured`` sent again byte for byte on its subject; the reply subject
    is a fresh one in the same inbox (the one rule the server holds replies to),
    as the captured one was."""
    inbox = subjects.reply_inbox(captured.subject)
    assert inbox is not None and captured.reply.startswith(inbox.prefix + ".")
    reply = reply_subject(subjects, captured.subject)
    answer: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()

    async def on_reply(msg: Msg) -> None:
        if not answer.done():
            answer.set_result(msg)

    await nc.subscribe(reply, cb=on_reply, max_msgs=1)
    await nc.publish(captured.subject, captured.data, reply=reply)
    return wire.decode((await asyncio.wait_for(answer, WAIT_S)).data).msg


def refused_as_replay(msg: wire.Message) -> None:
    assert isinstance(msg, wire.Error), msg
    assert msg.code == "unauthorized", msg
    assert "replay" in msg.message, msg


@pytest.fixture
async def fleet(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> AsyncIterator[tuple[System, Path]]:
    """Replica 1 (``System``), an eavesdropping connection, and the state dir
    replica 2 shares with it. Replica 2 is started by the test."""
    svc = await start_service(db_url, nats_url, subject_prefix, state_dir)
    nc = await nats.connect(nats_url)
    sys_ = System(svc, nats_url, nc)
    try:
        await svc.repo.add_user("admin", platform_admin=True)  # type: ignore[union-attr]
        await svc.repo.add_project("default", owner="admin")  # type: ignore[union-attr]
        yield sys_, state_dir
    finally:
        for h in sys_.hosts:
            await h.client.close()
        await nc.close()
        await svc.stop()


async def devices_of(svc: ControlPlaneService, host_id: str) -> list[str]:
    assert svc.engine is not None
    async with svc.engine.connect() as conn:
        rows = await conn.execute(
            sa.text("SELECT device_id FROM devices WHERE host_id = :h ORDER BY device_id"),
            {"h": host_id},
        )
        return [r[0] for r in rows]


async def lease_of(svc: ControlPlaneService, task_id: str, attempt: int) -> datetime:
    assert svc.engine is not None
    async with svc.engine.connect() as conn:
        value = (
            await conn.execute(
                sa.text("SELECT lease_expires_at FROM attempts WHERE task_id = :t AND number = :n"),
                {"t": task_id, "n": attempt},
            )
        ).scalar_one()
    assert isinstance(value, datetime)
    return value


async def test_a_host_message_accepted_by_one_replica_is_refused_by_another(
    fleet: tuple[System, Path], db_url: str, nats_url: str, subject_prefix: str
) -> None:
    one, state_dir = fleet
    subjects = one.subjects
    h = await one.host("h1", devices=1)
    tap = Tap()
    await tap.on(one.nc, subjects.heartbeat("h1"))
    await tap.on(one.nc, subjects.renew("h1"))

    # Replica 1 accepts a heartbeat reporting one device, then another
    # reporting two: replaying the first would drop the second device.
    await h.client.heartbeat([wire.Device(device_id="h1-d0")])
    first_beat = await tap.next()
    await h.client.heartbeat([wire.Device(device_id="h1-d0"), wire.Device(device_id="h1-d1")])
    await tap.next()
    # ... and a renewal of a running lease.
    a = await one.running(h)
    await h.client.renew(a.task_id, a.attempt, a.lease_token)
    renewal = await tap.next()
    lease = await lease_of(one.svc, a.task_id, a.attempt)
    assert await devices_of(one.svc, "h1") == ["h1-d0", "h1-d1"]

    # Replica 1 goes; replica 2 (same database, prefix and secret) serves.
    await one.svc.stop()
    two = await start_service(db_url, nats_url, subject_prefix, state_dir)
    try:
        refused_as_replay(await replay(one.nc, subjects, first_beat))
        refused_as_replay(await replay(one.nc, subjects, renewal))
        assert await devices_of(two, "h1") == ["h1-d0", "h1-d1"]
        assert await lease_of(two, a.task_id, a.attempt) == lease
        assert two.server.replay.refused == 2

        # The host's own fresh messages are served by replica 2.
        await h.client.heartbeat([wire.Device(device_id="h1-d0")])
        reply = await h.client.renew(a.task_id, a.attempt, a.lease_token)
        assert reply.state == "running"
        assert await lease_of(two, a.task_id, a.attempt) > lease
    finally:
        await two.stop()


async def test_replays_spread_over_two_running_replicas_are_all_refused(
    fleet: tuple[System, Path], db_url: str, nats_url: str, subject_prefix: str
) -> None:
    one, state_dir = fleet
    subjects = one.subjects
    h = await one.host("h1", devices=1)
    tap = Tap()
    await tap.on(one.nc, subjects.heartbeat("h1"))
    await h.client.heartbeat([wire.Device(device_id="h1-d0")])
    beat = await tap.next()
    await h.client.heartbeat([wire.Device(device_id="h1-d0"), wire.Device(device_id="h1-d1")])
    await tap.next()
    # Both replicas serve the queue group now; each replay goes to either.
    two = await start_service(db_url, nats_url, subject_prefix, state_dir)
    try:
        for _ in range(12):
            refused_as_replay(await replay(one.nc, subjects, beat))
        assert await devices_of(two, "h1") == ["h1-d0", "h1-d1"]
    finally:
        await two.stop()


async def test_a_register_proof_accepted_by_one_replica_is_refused_by_another(
    fleet: tuple[System, Path], db_url: str, nats_url: str, subject_prefix: str
) -> None:
    one, state_dir = fleet
    subjects = one.subjects
    assert one.repo is not None
    credential = await one.repo.add_host("h1")
    tap = Tap()
    await tap.on(one.nc, subjects.register("h1"))
    client = HostClient(
        nats_url=nats_url, host_id="h1", credential=credential, prefix=subject_prefix
    )
    try:
        await client.connect()
        ok = await client.register()
        captured = await tap.next()
        env = wire.decode(captured.data)
        assert isinstance(env.msg, wire.Register) and env.msg.proof is not None

        await one.svc.stop()
        two = await start_service(db_url, nats_url, subject_prefix, state_dir)
        try:
            refused_as_replay(await replay(one.nc, subjects, captured))
            # No new session was opened: the host's current one still works.
            assert two.repo is not None
            assert await two.repo.current_generation("h1") == ok.generation
            await client.heartbeat([wire.Device(device_id="h1-d0")])
        finally:
            await two.stop()
    finally:
        await client.close()


async def test_a_shared_store_that_cannot_answer_refuses_unavailable_and_changes_nothing(
    fleet: tuple[System, Path], db_url: str
) -> None:
    one, _ = fleet
    h = await one.host("h1", devices=1)
    one.server.replay.timeout_s = 0.5
    before = await one.snapshot()
    engine = create_engine(db_url)
    try:
        async with engine.connect() as locker:
            # Another session holds the replay table: no nonce can be recorded.
            await locker.execute(sa.text("BEGIN"))
            await locker.execute(sa.text("LOCK TABLE replay_nonces IN ACCESS EXCLUSIVE MODE"))
            with pytest.raises(wire.RemoteError) as err:
                await h.client.heartbeat(
                    [wire.Device(device_id="h1-d0"), wire.Device(device_id="h1-d1")]
                )
            assert err.value.code == "unavailable" and err.value.retryable
            assert await one.snapshot() == before
            await locker.execute(sa.text("ROLLBACK"))
        # The store answers again: the host's next message (signed afresh, as
        # an agent retries) is served.
        await h.client.heartbeat([wire.Device(device_id="h1-d0"), wire.Device(device_id="h1-d1")])
        assert await devices_of(one.svc, "h1") == ["h1-d0", "h1-d1"]
    finally:
        await engine.dispose()


# --- the ledger itself ------------------------------------------------------------


@pytest.fixture
async def repos(engine: AsyncEngine, db_url: str) -> AsyncIterator[tuple[Repository, Repository]]:
    """Two repositories on two engines (two processes' pools) of one database."""
    other = create_engine(db_url)
    try:
        yield Repository(engine), Repository(other)
    finally:
        await other.dispose()


async def test_each_nonce_is_new_exactly_once_across_processes(
    repos: tuple[Repository, Repository],
) -> None:
    a, b = repos
    expires = datetime.now(UTC) + timedelta(seconds=30)
    nonces = [secrets.token_bytes(16) for _ in range(200)]
    entries = [("h1", n, expires) for n in nonces]
    # The same 200 nonces recorded by two processes at once: each is new once.
    first, second = await asyncio.gather(a.record_nonces(entries), b.record_nonces(entries))
    assert [x + y for x, y in zip(first, second, strict=True)] == [1] * 200
    # Scopes are apart; a repeat within one batch is not new.
    n = secrets.token_bytes(16)
    assert await a.record_nonces([("h2", nonces[0], expires), ("h2", n, expires)]) == [True, True]
    assert await b.record_nonces([("h3", n, expires), ("h3", n, expires)]) == [True, False]
    assert await a.record_nonces([("register:h1", nonces[0], expires)]) == [True]


async def test_pruning_deletes_only_expired_rows_in_bounded_batches(
    repos: tuple[Repository, Repository], engine: AsyncEngine
) -> None:
    a, b = repos
    now = datetime.now(UTC)
    old = [("h1", secrets.token_bytes(16), now - timedelta(seconds=120)) for _ in range(25)]
    live = [("h1", secrets.token_bytes(16), now + timedelta(seconds=30)) for _ in range(5)]
    assert all(await a.record_nonces(old + live))
    assert await a.prune_nonces(now, batch=10) == 10
    assert await b.prune_nonces(now, batch=10) == 10
    assert await a.prune_nonces(now, batch=10) == 5
    assert await a.prune_nonces(now, batch=10) == 0
    async with engine.connect() as conn:
        left = (await conn.execute(sa.text("SELECT count(*) FROM replay_nonces"))).scalar_one()
    assert left == 5
    # A pruned nonce's message is stale by then; its live neighbours still refuse.
    assert await a.record_nonces(live) == [False] * 5


async def test_concurrent_checks_share_one_statement_and_a_twin_is_refused(
    repos: tuple[Repository, Repository],
) -> None:
    a, b = repos
    mine = SharedReplay(a, SystemClock(), window_s=30)
    theirs = SharedReplay(b, SystemClock(), window_s=30)
    ts_ms = int(time.time() * 1000)
    nonces = [secrets.token_bytes(16) for _ in range(50)]
    # Queued together: one statement carries them all.
    await asyncio.gather(*(mine.check("h1", n, ts_ms) for n in nonces))
    assert (mine.batches, mine.items) == (1, 50)
    # The same message twice in one batch: exactly one passes.
    twin = secrets.token_bytes(16)
    outcomes = await asyncio.gather(
        mine.check("h1", twin, ts_ms), mine.check("h1", twin, ts_ms), return_exceptions=True
    )
    assert sorted(type(o).__name__ for o in outcomes) == ["AuthError", "NoneType"]
    # Another process refuses every one of them.
    for n in [*nonces[:3], twin]:
        with pytest.raises(AuthError) as err:
            await theirs.check("h1", n, ts_ms)
        assert err.value.reason == "replay" and err.value.code == "unauthorized"
    assert theirs.refused == 4


async def test_periodic_checks_wait_for_company_and_go_with_the_next_urgent_one(
    repos: tuple[Repository, Repository],
) -> None:
    a, _ = repos
    # A linger longer than the test: only an urgent check (or a full batch)
    # can send the periodic ones.
    replay = SharedReplay(a, SystemClock(), window_s=30, linger_s=3600, max_batch=8)
    ts_ms = int(time.time() * 1000)
    periodic = [
        asyncio.ensure_future(replay.check("h1", secrets.token_bytes(16), ts_ms, urgent=False))
        for _ in range(3)
    ]
    await asyncio.sleep(0)
    assert replay.batches == 0 and not any(p.done() for p in periodic)
    await replay.check("h1", secrets.token_bytes(16), ts_ms)
    await asyncio.gather(*periodic)
    assert (replay.batches, replay.items) == (1, 4)
    # A full batch goes without an urgent check.
    await asyncio.gather(
        *(replay.check("h1", secrets.token_bytes(16), ts_ms, urgent=False) for _ in range(8))
    )
    assert (replay.batches, replay.items) == (2, 12)
    await replay.stop()


async def test_a_check_made_as_the_last_flusher_ends_is_still_sent(
    repos: tuple[Repository, Repository],
) -> None:
    a, _ = repos
    replay = SharedReplay(a, SystemClock(), window_s=30, linger_s=0, max_inflight=1)
    ts_ms = int(time.time() * 1000)
    for _ in range(20):
        # The check returns as its flusher ends; the next one, made at once in
        # the same task (no new task in between), must find the room that
        # flusher left and start another.
        await replay.check("h1", secrets.token_bytes(16), ts_ms)
        async with asyncio.timeout(10):
            await replay.check("h1", secrets.token_bytes(16), ts_ms)
    assert replay.items == 40
    await replay.stop()
