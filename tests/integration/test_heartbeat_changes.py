"""Heartbeats write only what changed: a complete snapshot rewrites (and
locks) only the device rows that differ, and a heartbeat "unchanged since
<digest>" writes the host's last_seen and nothing else."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa

from fleetlease.persistence.errors import Conflict, Invalid, Unauthorized
from fleetlease.persistence.model import DeviceSnapshot, Session
from fleetlease.transport import wire
from tests.chaos.harness import wait_until
from tests.integration.test_repository_support import World, world
from tests.integration.test_transport_e2e import System, system

__all__ = ["system", "world"]

pytestmark = pytest.mark.embedded


def _snap(**states: str) -> list[DeviceSnapshot]:
    return [
        DeviceSnapshot(device_id=d, state=s, capabilities={"os": "a"}) for d, s in states.items()
    ]


async def _versions(w: World) -> dict[str, tuple[Any, ...]]:
    """Each device row's physical version: a write (or a row lock) changes it."""
    rows = await w.rows(
        "SELECT device_id, xmin::text AS xmin, xmax::text AS xmax, ctid::text AS ctid,"
        " state, updated_at FROM devices ORDER BY device_id"
    )
    return {
        r["device_id"]: (r["xmin"], r["xmax"], r["ctid"], r["state"], r["updated_at"]) for r in rows
    }


async def _last_seen(w: World, host_id: str = "h1") -> Any:
    (row,) = await w.rows("SELECT last_seen FROM hosts WHERE host_id = :h", h=host_id)
    return row["last_seen"]


async def _registered(
    w: World, devices: list[DeviceSnapshot], digest: str | None = "v1"
) -> Session:
    w.credentials["h1"] = await w.repo.add_host("h1")
    session = await w.repo.register_session("h1", w.credentials["h1"])
    await w.repo.heartbeat(session, devices, digest=digest)
    return session


async def test_a_heartbeat_that_changes_nothing_writes_no_device_row(world: World) -> None:
    session = await _registered(world, _snap(d1="idle", d2="idle"))
    before = await _versions(world)
    world.clock.advance(5)

    await world.repo.heartbeat(session, _snap(d1="idle", d2="idle"))

    assert await _versions(world) == before  # not rewritten, not even locked
    assert await _last_seen(world) == world.clock.now()


async def test_a_changed_device_is_updated_and_the_others_are_not_written(world: World) -> None:
    session = await _registered(world, _snap(d1="idle", d2="idle"))
    before = await _versions(world)
    world.clock.advance(5)

    await world.repo.heartbeat(session, _snap(d1="busy", d2="idle"))

    after = await _versions(world)
    assert after["d2"] == before["d2"]
    assert after["d1"][3:] == ("busy", world.clock.now())
    assert after["d1"][0] != before["d1"][0]


async def test_a_device_gone_from_the_heartbeat_is_removed_and_a_new_one_added(
    world: World,
) -> None:
    session = await _registered(world, _snap(d1="idle", d2="idle"))
    before = await _versions(world)

    await world.repo.heartbeat(session, _snap(d2="idle", d3="offline"))

    after = await _versions(world)
    assert set(after) == {"d2", "d3"}
    assert after["d2"] == before["d2"]
    assert after["d3"][3] == "offline"


async def test_an_unchanged_heartbeat_refreshes_last_seen_and_writes_no_device_row(
    world: World,
) -> None:
    session = await _registered(world, _snap(d1="idle", d2="busy"))
    before = await _versions(world)
    world.clock.advance(5)

    await world.repo.heartbeat_unchanged(session, "v1")

    assert await _versions(world) == before
    assert await _last_seen(world) == world.clock.now()


async def test_an_unchanged_heartbeat_of_another_snapshot_conflicts_and_changes_nothing(
    world: World,
) -> None:
    session = await _registered(world, _snap(d1="idle"))
    seen = await _last_seen(world)
    world.clock.advance(5)

    with pytest.raises(Conflict) as refused:
        await world.repo.heartbeat_unchanged(session, "v2")

    assert refused.value.fields["reason"] == "snapshot_unknown"
    assert await _last_seen(world) == seen


async def test_a_snapshot_without_digest_or_of_an_older_session_is_never_unchanged(
    world: World,
) -> None:
    session = await _registered(world, _snap(d1="idle"), digest=None)
    with pytest.raises(Conflict):
        await world.repo.heartbeat_unchanged(session, "v1")

    await world.repo.heartbeat(session, _snap(d1="idle"), digest="v1")
    await world.repo.heartbeat_unchanged(session, "v1")
    renewed = await world.repo.register_session("h1", world.credentials["h1"])
    with pytest.raises(Conflict):  # a new session sends its complete snapshot first
        await world.repo.heartbeat_unchanged(renewed, "v1")
    with pytest.raises(Unauthorized):
        await world.repo.heartbeat_unchanged(session, "v1")


async def test_an_unchanged_heartbeat_after_a_device_row_changed_asks_for_the_snapshot(
    world: World,
) -> None:
    session = await _registered(world, _snap(d1="idle"))
    world.clock.advance(5)
    # The control plane changes a device row itself (an expiry holds it busy).
    async with world.engine.begin() as conn:
        await conn.execute(
            sa.text("UPDATE devices SET state = 'busy', updated_at = :now"),
            {"now": world.clock.now()},
        )

    with pytest.raises(Conflict):
        await world.repo.heartbeat_unchanged(session, "v1")
    await world.repo.heartbeat(session, _snap(d1="idle"), digest="v1")

    assert (await _versions(world))["d1"][3] == "idle"
    await world.repo.heartbeat_unchanged(session, "v1")


@pytest.mark.parametrize("digest", ["", "x" * 129, 7])
async def test_a_bad_digest_is_invalid_and_changes_nothing(world: World, digest: Any) -> None:
    session = await _registered(world, _snap(d1="idle"))
    seen = await _last_seen(world)
    world.clock.advance(5)

    with pytest.raises(Invalid):
        await world.repo.heartbeat_unchanged(session, digest)
    with pytest.raises(Invalid):
        await world.repo.heartbeat(session, _snap(d1="busy"), digest=digest)

    assert await _last_seen(world) == seen
    assert (await _versions(world))["d1"][3] == "idle"


async def test_over_the_wire_an_unchanged_heartbeat_is_ok_until_the_snapshot_differs(
    system: System,
) -> None:
    h = await system.host("h1", devices=2)
    devices = [wire.Device(device_id=f"h1-d{i}") for i in range(2)]
    await h.client.heartbeat(devices, digest="tag-1")

    await h.client.heartbeat_unchanged("tag-1")
    with pytest.raises(wire.RemoteError) as refused:
        await h.client.heartbeat_unchanged("tag-2")

    assert refused.value.code == "conflict"
    listed = sorted(d["device_id"] for d in await system.repo.list_devices())
    assert listed == ["h1-d0", "h1-d1"]


async def test_an_unchanged_heartbeat_carrying_devices_is_a_bad_request(system: System) -> None:
    import msgpack

    h = await system.host("h1", devices=1)
    body = msgpack.packb(
        {"devices": [{"device_id": "h1-d5"}], "digest": "t", "unchanged": True}, use_bin_type=True
    )
    subject = system.subjects.heartbeat("h1")
    assert h.client._signer is not None
    data = wire.encode_envelope(
        "heartbeat", body, h.client._signer.auth(subject, "heartbeat", body)
    )
    before = await system.repo.list_devices()

    assert await system.code(subject, data) == "bad_request"
    assert await system.repo.list_devices() == before


async def test_a_device_held_by_an_expiry_racing_a_heartbeat_is_not_left_held(
    world: World,
) -> None:
    # An expiry holds an idle device (it turns busy: the silent host may still
    # run on it) in a transaction that began before a complete heartbeat and
    # commits while that heartbeat runs. Whatever the interleaving, the host's
    # later unchanged heartbeats must not leave the device held: either they
    # are refused (the host then sends its complete snapshot) or the complete
    # one already said idle after the hold.
    from fleetlease.persistence.repository._sql import _hold_devices_stmt

    session = await _registered(world, _snap(d1="idle", d2="idle"), digest="v1")
    held_at = world.clock.now()
    world.clock.advance(5)
    async with world.engine.connect() as expiry:
        await expiry.execute(
            _hold_devices_stmt(), {"r_host_id": ["h1"], "r_device_id": ["d1"], "now": held_at}
        )
        beat = asyncio.ensure_future(
            world.repo.heartbeat(session, _snap(d1="idle", d2="idle"), digest="v2")
        )

        # The complete heartbeat either finishes before the expiry commits (it
        # reads the idle row the expiry has not committed) or waits for a lock
        # the expiry holds.
        async def settled() -> bool:
            waiting = await world.rows(
                "SELECT count(*) AS n FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            return beat.done() or waiting[0]["n"] > 0

        await wait_until(settled, what="the heartbeat done or waiting for the expiry")
        await expiry.commit()
    await beat
    world.clock.advance(5)
    try:
        await world.repo.heartbeat_unchanged(session, "v2")
    except Conflict as exc:
        assert exc.reason == "snapshot_unknown"
        await world.repo.heartbeat(session, _snap(d1="idle", d2="idle"), digest="v2")
    (row,) = await world.rows("SELECT state FROM devices WHERE device_id = 'd1'")
    assert row["state"] == "idle"
