"""``fleetlease gc`` and ``fleetlease project set-retention`` against a real
control plane (the fixtures of ``test_ops_cli``): JSON shapes, the table,
usage errors and the platform-admin rule."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from fleetlease.ops.cli import CliError
from fleetlease.ops.commands.retention import retain_from_args
from tests.integration.test_ops_cli import System, system  # noqa: F401
from tests.integration.test_retention import insert_finished

pytestmark = pytest.mark.embedded


async def test_set_retention_then_gc_dry_run_and_gc(system: System) -> None:  # noqa: F811
    admin = system.admin_token
    assert system.service.engine is not None
    engine = system.service.engine
    await system.repo.add_host("h0")
    await system.repo.add_project("short", owner="admin")
    await insert_finished(engine, "short", 3, age_s=7200, lines=2)
    await insert_finished(engine, "default", 2, age_s=7200, lines=2)

    data = (
        await system.cli("project", "set-retention", "short", "1h", "--json", token=admin)
    ).json()
    assert data == {"name": "short", "retain_s": 3600, "retain": "1h", "effective": "1h"}

    plan = (await system.cli("gc", "--dry-run", "--json", token=admin)).json()
    assert plan["dry_run"] is True
    assert plan["default_retain"] == "forever"
    assert plan["projects"]["short"]["tasks"] == 3
    assert plan["projects"]["short"]["log_lines"] == 6
    assert "default" not in plan["projects"]
    assert await system.scalar(sa.text("SELECT count(*) FROM tasks")) == 5

    table = await system.cli("gc", "--dry-run", token=admin)
    assert table.code == 0, table.err
    assert "would delete 3 finished task(s)" in table.out and "short" in table.out

    done = (await system.cli("gc", "--json", token=admin)).json()
    assert done["batches"] == [3] and done["complete"] is True
    assert done["total"]["tasks"] == 3 and done["total"]["artifacts"] == 3
    assert await system.scalar(sa.text("SELECT count(*) FROM tasks")) == 2

    data = (
        await system.cli("project", "set-retention", "short", "default", "--json", token=admin)
    ).json()
    assert data["retain_s"] is None and data["effective"] == "forever"
    row = await system.scalar(sa.text("SELECT retain_s FROM projects WHERE name = 'short'"))
    assert row is None


async def test_bad_input_and_non_admins_change_nothing(system: System) -> None:  # noqa: F811
    admin = system.admin_token
    alice = await system.user("alice")
    bad = await system.cli("project", "set-retention", "default", "3 years", token=admin)
    assert bad.code == 2 and "DURATION" in bad.err
    missing = await system.cli("project", "set-retention", "nope", "1d", token=admin)
    assert missing.code != 0 and "nope" in missing.err
    for argv in (("gc",), ("gc", "--dry-run"), ("project", "set-retention", "default", "1d")):
        run = await system.cli(*argv, token=alice)
        assert run.code == 3, (argv, run.err)
    assert (
        await system.scalar(sa.text("SELECT count(*) FROM projects WHERE retain_s IS NOT NULL"))
        == 0
    )


def test_retain_flag_and_environment() -> None:
    import argparse

    assert retain_from_args(argparse.Namespace(retain="30d"), env={}) == 30 * 86400
    assert (
        retain_from_args(argparse.Namespace(retain=None), env={"FLEETLEASE_RETAIN": "12h"}) == 43200
    )
    assert retain_from_args(argparse.Namespace(retain=None), env={}) == 0
    assert retain_from_args(argparse.Namespace(retain="none"), env={"FLEETLEASE_RETAIN": "1d"}) == 0
    with pytest.raises(CliError):
        retain_from_args(argparse.Namespace(retain="soon"), env={})
