"""``fleetlease host drain|undrain`` and ``device drain|undrain`` end to end: the
CLI over a real NATS to a control plane on a real PostgreSQL, a host simulated
with the signed ``HostClient`` (see test_ops_cli.py)."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa

from fleetlease.persistence import tables as t
from tests.integration.test_ops_cli import (
    SimHost,
    System,
    eventually,
    host,  # noqa: F401
    system,  # noqa: F401
)


async def test_a_non_admin_gets_forbidden_and_nothing_changes(
    system: System,  # noqa: F811
    host: SimHost,  # noqa: F811
) -> None:
    alice = await system.user("alice")
    for argv in (
        ("host", "drain", "h1"),
        ("host", "drain", "h1", "--deadline", "0"),
        ("host", "undrain", "h1"),
        ("device", "drain", "h1/d0"),
        ("device", "undrain", "h1/d0"),
    ):
        run = await system.cli(*argv, token=alice)
        assert run.code == 3, (argv, run.out, run.err)
        assert "forbidden" in run.err or "platform admin" in run.err
    assert await system.scalar(sa.select(t.hosts.c.drain_requested_at)) is None
    assert await system.rows(sa.select(t.device_drains)) == []


async def test_drain_shows_in_hosts_and_devices_and_undrain_clears_it(
    system: System,  # noqa: F811
    host: SimHost,  # noqa: F811
) -> None:
    admin = system.admin_token
    out = (
        await system.cli("host", "drain", "h1", "--deadline", "1h", "--json", token=admin)
    ).json()
    assert set(out) == {"host_id", "requested_at", "deadline", "active"}
    (h,) = (await system.cli("hosts", "--json", token=admin)).json()
    assert h["drain"] == {"requested_at": out["requested_at"], "deadline": out["deadline"]}
    devices = (await system.cli("devices", "--json", token=admin)).json()
    assert [d["drained"] for d in devices] == [True, True]
    table = await system.cli("hosts", token=admin)
    assert "drained" in table.out

    undrain = (await system.cli("host", "undrain", "h1", "--json", token=admin)).json()
    assert undrain == {"host_id": "h1", "was_drained": True}
    dev = (await system.cli("device", "drain", "h1/d1", "--json", token=admin)).json()
    assert (dev["host_id"], dev["device_id"], dev["active"]) == ("h1", "d1", 0)
    (h,) = (await system.cli("hosts", "--json", token=admin)).json()
    assert h["drain"] is None
    devices = (await system.cli("devices", "--json", token=admin)).json()
    assert [(d["device_id"], d["drained"]) for d in devices] == [("d0", False), ("d1", True)]
    assert "drained" in (await system.cli("devices", token=admin)).out

    # A drained device takes no task; its sibling does.
    task_id = await system.submit(admin, "--goal", "g")
    a = await host.take()
    assert (a.task_id, a.device_id) == (task_id, "d0")
    await host.finish(a)

    bad = await system.cli("device", "drain", "h1/nope", token=admin)
    assert bad.code == 4, bad.err
    usage = await system.cli("device", "drain", "h1", token=admin)
    assert usage.code == 2, usage.err
    unknown = await system.cli("host", "drain", "ghost", token=admin)
    assert unknown.code == 4, unknown.err


async def test_host_drain_wait_returns_once_the_host_is_idle(
    system: System,  # noqa: F811
    host: SimHost,  # noqa: F811
) -> None:
    admin = system.admin_token
    task_id = await system.submit(admin, "--goal", "g")
    a = await host.take()
    assert a.task_id == task_id

    waiting = asyncio.ensure_future(system.cli("host", "drain", "h1", "--wait", token=admin))
    await eventually(
        lambda: system.scalar(sa.select(t.hosts.c.drain_requested_at)),
        lambda at: at is not None,
    )
    # The host still runs its attempt, so the command still waits.
    assert not waiting.done()
    # Anything submitted now waits: the only host is drained.
    other = await system.submit(admin, "--goal", "other")
    await host.finish(a)

    run = await asyncio.wait_for(waiting, 60)
    assert run.code == 0, run.err
    assert "idle" in run.out
    assert (await system.show(task_id))["state"] == "done"
    assert (await system.show(other))["state"] == "queued"

    timed = await system.cli(
        "host", "drain", "h1", "--wait", "--wait-timeout", "0", "--json", token=admin
    )
    assert timed.json()["idle"] is True
    # Undrained, the host takes the waiting task.
    await system.cli("host", "undrain", "h1", token=admin)
    b = await host.take()
    assert b.task_id == other
    still = await system.cli("host", "drain", "h1", "--wait", "--wait-timeout", "0", token=admin)
    assert still.code == 1 and "active attempt" in still.err
