"""The fleet's periodic requests answered many to one statement
(``persistence/repository/periodic.py``): each entry of a batch gets exactly
the outcome the single-entry method gives it, and nothing else changes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa

from fleetlease.persistence.errors import Conflict, Invalid, RepositoryError, Unauthorized
from fleetlease.persistence.model import Assignment, DeviceSnapshot, Session
from tests.chaos.harness import wait_until
from tests.integration.test_repository_support import World, world

__all__ = ["world"]

pytestmark = pytest.mark.embedded


async def _digested(w: World, host_id: str, *devices: str, digest: str = "v1") -> Session:
    """A registered host whose last complete heartbeat was tagged ``digest``."""
    if host_id not in w.credentials:
        w.credentials[host_id] = await w.repo.add_host(host_id)
    session = await w.repo.register_session(host_id, w.credentials[host_id])
    snaps = [DeviceSnapshot(device_id=d, capabilities={"host": host_id}) for d in devices]
    await w.repo.heartbeat(session, snaps, digest=digest)
    return session


async def _hosts(w: World) -> dict[str, Any]:
    rows = await w.rows("SELECT host_id, last_seen, devices_digest FROM hosts ORDER BY host_id")
    return {r["host_id"]: (r["last_seen"], r["devices_digest"]) for r in rows}


def _kind(outcome: object) -> object:
    if isinstance(outcome, RepositoryError):
        return (type(outcome), outcome.code, outcome.fields.get("reason"))
    return outcome


async def test_a_batch_of_heartbeats_gives_each_the_single_heartbeats_outcome(
    world: World,
) -> None:
    ok = await _digested(world, "h1", "d1")
    ok2 = await _digested(world, "h2", "d1")
    stale = await _digested(world, "h3", "d1")
    old = await _digested(world, "h4", "d1")
    new = await world.repo.register_session("h4", world.credentials["h4"])
    world.clock.advance(5)
    beats: list[tuple[Session, Any]] = [
        (ok, "v1"),
        (stale, "v0"),  # not the stored digest
        (old, "v1"),  # a superseded session
        (Session(host_id="nobody", generation=1), "v1"),
        (ok2, "v1"),
        (ok, "v1"),  # the same host twice in one batch
        (new, ""),  # not a digest
    ]
    before = await _hosts(world)

    out = await world.repo.heartbeats_unchanged(beats)

    assert out[0] is None and out[4] is None and out[5] is None
    assert isinstance(out[1], Conflict) and out[1].fields["reason"] == "snapshot_unknown"
    assert isinstance(out[2], Unauthorized)
    assert isinstance(out[3], Unauthorized)
    assert isinstance(out[6], Invalid)
    after = await _hosts(world)
    now = world.clock.now()
    assert after["h1"] == (now, "v1") and after["h2"] == (now, "v1")
    # The refused changed nothing.
    assert after["h3"] == before["h3"] and after["h4"] == before["h4"]
    # The same outcomes, one by one.
    for (session, digest), batched in zip(beats, out, strict=True):
        try:
            single: object = await world.repo.heartbeat_unchanged(session, digest)
        except RepositoryError as exc:
            single = exc
        assert _kind(single) == _kind(batched), (session, digest)


async def test_a_batched_heartbeat_is_refused_once_a_device_row_changed_since_its_digest(
    world: World,
) -> None:
    changed = await _digested(world, "h1", "d1", "d2")
    other = await _digested(world, "h2", "d1")
    world.clock.advance(5)
    # The control plane changes a device row itself (an expiry holds it busy).
    async with world.engine.begin() as conn:
        await conn.execute(
            sa.text("UPDATE devices SET state = 'busy', updated_at = :now WHERE host_id = 'h1'"),
            {"now": world.clock.now()},
        )
    out = await world.repo.heartbeats_unchanged([(changed, "v1"), (other, "v1")])
    assert isinstance(out[0], Conflict) and out[0].fields["reason"] == "snapshot_unknown"
    assert out[1] is None


async def test_concurrent_heartbeat_batches_over_the_same_hosts_all_refresh(
    world: World,
) -> None:
    sessions = [await _digested(world, f"h{i}", "d1") for i in range(12)]
    beats = [(s, "v1") for s in sessions]
    world.clock.advance(5)
    # Opposite orders, at once, many times: rows are locked in one order.
    results = await asyncio.gather(
        *(world.repo.heartbeats_unchanged(beats if i % 2 else beats[::-1]) for i in range(16))
    )
    assert all(o is None for out in results for o in out)


async def test_a_batch_of_pending_reads_gives_each_the_single_reads_answer(world: World) -> None:
    h1 = await _digested(world, "h1", "d1", "d2", "d3")
    h2 = await _digested(world, "h2", "d1")
    old = await _digested(world, "h3", "d1")
    await world.repo.register_session("h3", world.credentials["h3"])
    on_h1 = [await world.assigned(h1) for _ in range(3)]
    on_h2 = await world.assigned(h2)
    devices = sorted(a.device_id for a in on_h1)
    reads: list[tuple[Session, Any, int | None]] = [
        (h1, (), None),
        (h1, (devices[0], devices[2]), None),
        (h1, (), 2),
        (h2, ("nope",), None),
        (h2, (), 16),
        (old, (), None),  # superseded
        (Session(host_id="nobody", generation=1), (), None),
        (h1, "d1", None),  # a string, not a list of devices
    ]

    out = await world.repo.sessions_pending(reads)

    def ids(x: object) -> object:
        if isinstance(x, list):
            assert all(isinstance(a, Assignment) for a in x)
            return sorted(a.task_id for a in x)
        return _kind(x)

    assert ids(out[0]) == sorted(a.task_id for a in on_h1)
    assert ids(out[1]) == sorted(a.task_id for a in on_h1 if a.device_id != devices[1])
    assert isinstance(out[2], list) and len(out[2]) == 2
    assert out[3] == [] and ids(out[4]) == [on_h2.task_id]
    assert isinstance(out[5], Unauthorized) and isinstance(out[6], Unauthorized)
    assert isinstance(out[7], Invalid)
    for (session, device_ids, limit), batched in zip(reads, out, strict=True):
        try:
            single: object = await world.repo.session_pending(
                session, device_ids=device_ids, limit=limit
            )
        except RepositoryError as exc:
            single = exc
        if isinstance(single, list):
            # Every field as the single read gives it, in claim-deadline order.
            assert isinstance(batched, list)
            key = lambda a: (a.claim_deadline, a.task_id)  # noqa: E731
            if limit is None:
                assert sorted(batched, key=key) == sorted(single, key=key)
            else:
                assert set(batched) == set(single)
        else:
            assert _kind(single) == _kind(batched)


async def _hold(w: World, lock: str, *host_ids: str) -> tuple[Any, Any]:
    """An open transaction holding these host rows ``FOR <lock>``."""
    conn = await w.engine.connect()
    tx = await conn.begin()
    await conn.execute(
        sa.text(f"SELECT 1 FROM hosts WHERE host_id = ANY(:ids) FOR {lock}"),
        {"ids": list(host_ids)},
    )
    return conn, tx


async def test_a_batch_of_heartbeats_does_not_wait_for_hosts_that_new_rows_reference(
    world: World,
) -> None:
    a = await _digested(world, "ha", "d1")
    b = await _digested(world, "hb", "d1")
    world.clock.advance(5)
    # What an assignment inserting attempts of both hosts holds (the foreign
    # key): the batch's lock must not conflict with it, or the two could wait
    # for each other.
    conn, tx = await _hold(world, "KEY SHARE", "hb", "ha")
    try:
        async with asyncio.timeout(20):  # a hang guard, not a measurement
            out = await world.repo.heartbeats_unchanged([(a, "v1"), (b, "v1")])
        assert out == [None, None]
    finally:
        await tx.rollback()
        await conn.close()


async def test_a_host_row_held_elsewhere_is_skipped_by_the_batch_and_answered_alone(
    world: World,
) -> None:
    a = await _digested(world, "ha", "d1")
    b = await _digested(world, "hb", "d1")
    world.clock.advance(5)
    before = await _hosts(world)
    conn, tx = await _hold(world, "NO KEY UPDATE", "hb")  # a heartbeat of hb in flight
    batch = asyncio.ensure_future(world.repo.heartbeats_unchanged([(a, "v1"), (b, "v1")]))
    try:
        # ha is refreshed by the batch at once; hb waits for its row alone.
        async def ha_refreshed() -> bool:
            return bool((await _hosts(world))["ha"][0] == world.clock.now())

        await wait_until(ha_refreshed, what="ha refreshed")
        assert not batch.done()
        assert (await _hosts(world))["hb"] == before["hb"]
    finally:
        await tx.commit()
        await conn.close()
    assert await batch == [None, None]
    assert (await _hosts(world))["hb"][0] == world.clock.now()
