"""Bulk work from the CLI: ``submit --count`` (its maximum, its request id printed
first, ``tasks --request-id``) and the bulk ``cancel --project P`` of waiting
tasks, a batch (one transaction) per request, against the real control plane of
the CLI tests."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from fleetlease.ops.commands import tasks as task_commands
from fleetlease.persistence import tables as t
from fleetlease.persistence.model import TaskKind, TaskSpec
from tests.integration import test_ops_cli
from tests.integration.test_ops_cli import ADMIN, System

system = test_ops_cli.system


async def _count(system: System, *conds: object) -> int:
    return int(await system.scalar(sa.select(sa.func.count()).select_from(t.tasks).where(*conds)))


async def _queued(system: System, n: int, project: str, owner: str = ADMIN) -> list[str]:
    # No host: the tasks stay queued.
    spec = TaskSpec(kind=TaskKind.GOAL, goal="waiting", project=project, owner=owner)
    return list(await system.service.control_plane.submit_many([spec] * n))


async def test_submit_count_has_a_maximum_that_needs_a_flag_to_pass(
    system: System, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(task_commands, "MAX_SUBMIT_COUNT", 5)
    run = await system.cli("submit", "--goal", "g", "--count", "6", token=system.admin_token)
    assert run.code == 2 and "--allow-large" in run.err, run
    assert await _count(system) == 0
    run = await system.cli(
        "submit", "--goal", "g", "--count", "6", "--allow-large", "--json", token=system.admin_token
    )
    assert len(run.json()["ids"]) == 6


async def test_a_bulk_submit_names_its_request_id_first_and_tasks_finds_its_tasks(
    system: System,
) -> None:
    admin = system.admin_token
    await system.cli("submit", "--goal", "other", token=admin)
    run = await system.cli("submit", "--goal", "g", "--count", "150", "--json", token=admin)
    data = run.json()
    key = data["request_id"]
    assert run.err.splitlines()[0].startswith(f"request id {key}:"), run.err
    listed = (
        await system.cli("tasks", "--request-id", key, "--limit", "1000", "--json", token=admin)
    ).json()
    assert sorted(x["id"] for x in listed) == sorted(data["ids"]) and len(listed) == 150
    # Two pages with the cursor the first names on stderr; the last names none.
    first = await system.cli("tasks", "--request-id", key, "--limit", "100", "--json", token=admin)
    assert first.err.startswith("more tasks: --cursor "), first.err
    cursor = first.err.split()[-1]
    rest = await system.cli(
        "tasks", "--request-id", key, "--limit", "100", "--cursor", cursor, "--json", token=admin
    )
    assert "more tasks" not in rest.err, rest.err
    assert sorted(x["id"] for x in first.json() + rest.json()) == sorted(data["ids"])
    # Repeated with its request id (as after an interruption): the same tasks, no more.
    again = await system.cli(
        "submit", "--goal", "g", "--count", "150", "--request-id", key, "--json", token=admin
    )
    assert again.json()["ids"] == data["ids"]
    assert await _count(system) == 151


async def test_bulk_cancel_takes_the_waiting_tasks_of_one_project_and_reports_the_count(
    system: System,
) -> None:
    admin = system.admin_token
    bob = await system.user("bob")
    await system.cli("project", "add", "p", "--owner", ADMIN, token=admin)
    targets = await _queued(system, 30, "p")
    others = await _queued(system, 4, "default")

    # Not on a terminal: it needs --yes, and cancels nothing without it.
    run = await system.cli("cancel", "--project", "p", token=admin)
    assert run.code == 2 and "--yes" in run.err, run
    # A filter no task matches; a user who may read none of them.
    run = await system.cli("cancel", "--project", "p", "--older-than", "1h", "--yes", token=admin)
    assert run.code == 0 and "cancelled 0" in run.out, run
    run = await system.cli("cancel", "--project", "p", "--yes", "--json", token=bob)
    assert run.json()["cancelled"] == 0
    run = await system.cli("cancel", "--project", "p", "--host", "h9", "--yes", token=admin)
    assert "cancelled 0" in run.out, run
    assert await _count(system, t.tasks.c.status == "queued") == 34

    run = await system.cli(
        "cancel", "--project", "p", "--older-than", "0s", "--yes", "--json", token=admin
    )
    data = run.json()
    assert data["cancelled"] == 30 and sorted(data["ids"]) == sorted(targets)
    rows = await system.rows(
        sa.select(t.tasks.c.status, t.tasks.c.cancel_requested_by, t.tasks.c.finished_at).where(
            t.tasks.c.project == "p"
        )
    )
    assert {(r.status, r.cancel_requested_by) for r in rows} == {("cancelled", ADMIN)}
    assert all(r.finished_at is not None for r in rows)
    assert await _count(system, t.tasks.c.id.in_(others), t.tasks.c.status == "queued") == 4

    # Only waiting states, and a task id or filters, not both.
    assert (
        await system.cli("cancel", "--project", "p", "--state", "running", token=admin)
    ).code == 2
    assert (await system.cli("cancel", others[0], "--project", "p", token=admin)).code == 2


async def test_each_batch_is_bounded_and_later_submissions_stay_out(system: System) -> None:
    api, admin = system.service.ops, system.admin_token
    first = await _queued(system, 20, "default")
    batch = await api.handle("cancel_many", admin, {"project": "default", "limit": 7})
    assert (batch["cancelled"], batch["matched"], batch["more"]) == (7, 20, True)
    assert batch["ids"] == first[:7]  # oldest first
    later = await _queued(system, 5, "default")
    cancelled = list(batch["ids"])
    while batch["more"]:
        batch = await api.handle(
            "cancel_many", admin, {"project": "default", "limit": 7, "bound": batch["bound"]}
        )
        cancelled.extend(batch["ids"])
    assert sorted(cancelled) == sorted(first)
    assert await _count(system, t.tasks.c.id.in_(later), t.tasks.c.status == "queued") == 5
    for bad in (
        {"project": "default", "states": ["running"]},
        {"project": "default", "limit": 1001},
        {},
    ):
        try:
            await api.handle("cancel_many", admin, bad)
        except Exception as exc:
            assert getattr(exc, "code", None) == "bad_request", (bad, exc)
        else:
            raise AssertionError(f"{bad} was accepted")
    assert await _count(system, t.tasks.c.id.in_(later), t.tasks.c.status == "queued") == 5
