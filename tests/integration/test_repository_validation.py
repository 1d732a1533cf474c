"""Bad input: wrong types and out-of-range values are ``Invalid`` naming the field,
unknown ids are ``NotFound``, and nothing is half-written in any case."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fleetlease.persistence.errors import Conflict, Forbidden, Invalid, NotFound
from fleetlease.persistence.model import DeviceSnapshot, RetryPolicy, TaskKind, TaskSpec, User
from tests.integration.test_repository_support import World, world

__all__ = ["world"]

pytestmark = pytest.mark.embedded


def spec(**overrides: Any) -> TaskSpec:
    values: dict[str, Any] = {"kind": TaskKind.GOAL, "project": "p1", "owner": "alice"}
    values.update(overrides)
    return TaskSpec(**values)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"priority": 1001}, "priority"),
        ({"priority": -1001}, "priority"),
        ({"priority": "high"}, "priority"),
        ({"priority": True}, "priority"),
        ({"payload": ["not", "a", "dict"]}, "payload"),
        ({"payload": {"x": object()}}, "payload"),
        ({"payload": {"x": float("nan")}}, "payload"),
        ({"payload": {"x": "nul\x00"}}, "payload"),
        ({"payload": {"x": "a" * (256 * 1024)}}, "payload"),
        ({"selector": {"os": 1}}, "selector"),
        ({"selector": ["os"]}, "selector"),
        ({"selector": {"": "x"}}, "selector"),
        ({"retry": RetryPolicy(max_attempts=0)}, "max_attempts"),
        ({"retry": RetryPolicy(max_attempts=101)}, "max_attempts"),
        ({"retry": RetryPolicy(max_attempts=2.5)}, "max_attempts"),  # type: ignore[arg-type]
        ({"retry": RetryPolicy(backoff_base_s=-1)}, "backoff_base_s"),
        ({"retry": RetryPolicy(backoff_base_s=float("inf"))}, "backoff_base_s"),
        ({"retry": RetryPolicy(backoff_base_s=10, backoff_cap_s=5)}, "backoff_cap_s"),
        ({"kind": "shell"}, "kind"),
        ({"project": ""}, "project"),
        ({"owner": 7}, "owner"),
        ({"goal": 7}, "goal"),
        ({"request_id": ""}, "request_id"),
        ({"request_id": "has space"}, "request_id"),
        ({"request_id": "-leading-dash"}, "request_id"),
        ({"request_id": "r" * 129}, "request_id"),
        ({"request_id": 7}, "request_id"),
    ],
)
async def test_a_bad_task_field_is_invalid_names_the_field_and_writes_nothing(
    world: World, overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(Invalid) as err:
        await world.repo.submit(spec(**overrides))

    assert err.value.field == field
    assert err.value.to_dict()["code"] == "bad_request"
    assert await world.rows("SELECT id FROM tasks") == []


async def test_submit_many_is_all_or_nothing(world: World) -> None:
    with pytest.raises(Invalid):
        await world.repo.submit_many([spec(), spec(priority=5000)])
    with pytest.raises(NotFound):
        await world.repo.submit_many([spec(), spec(project="nope")])

    assert await world.rows("SELECT id FROM tasks") == []
    assert len(await world.repo.submit_many([spec(), spec()])) == 2


async def test_a_one_task_submit_naming_an_unknown_project_or_owner_writes_nothing(
    world: World,
) -> None:
    # One task is one INSERT in autocommit: the foreign keys refuse it whole.
    with pytest.raises(NotFound) as project:
        await world.repo.submit(spec(project="nope"))
    with pytest.raises(NotFound) as owner:
        await world.repo.submit(spec(owner="nobody"))

    assert project.value.fields["field"] == "project"
    assert owner.value.fields["field"] == "owner"
    assert await world.rows("SELECT id FROM tasks") == []


@pytest.mark.parametrize(
    ("user", "project", "error"),
    [
        (User(name="alice", platform_admin=False), "p1", None),  # owner
        (User(name="carol", platform_admin=False), "p1", None),  # project admin
        (User(name="root", platform_admin=True), "p2", None),
        (User(name="bob", platform_admin=False), "p1", Forbidden),
        (User(name="carol", platform_admin=False), "p2", Forbidden),
        (User(name="alice", platform_admin=False), "nope", NotFound),
        (User(name="root", platform_admin=True), "nope", NotFound),
        (User(name="alice", platform_admin=False), "", Invalid),
        (User(name="alice", platform_admin=False), 7, Invalid),
    ],
)
async def test_submitting_needs_a_role_on_an_existing_project(
    world: World, user: User, project: Any, error: type[Exception] | None
) -> None:
    if error is None:
        await world.repo.check_submit_role(user, project)
    else:
        with pytest.raises(error) as err:
            await world.repo.check_submit_role(user, project)
        assert err.value.fields["field"] == "project"  # type: ignore[attr-defined]
    assert await world.rows("SELECT id FROM tasks") == []


# --- the idempotency key ------------------------------------------------------------


async def test_a_repeated_request_id_returns_the_first_task_and_makes_no_other(
    world: World,
) -> None:
    # A client whose reply was lost submits again with the same key.
    first = await world.repo.submit(spec(request_id="r-1", payload={"n": 1}))
    again = await world.repo.submit(spec(request_id="r-1", payload={"n": 1}))
    ids, new = await world.repo.submit_many_new([spec(request_id="r-1", payload={"n": 1})])

    assert again == first and ids == [first] and new == set()
    assert await world.rows("SELECT id::text AS id, request_id FROM tasks") == [
        {"id": first, "request_id": "r-1"}
    ]


async def test_a_request_id_is_per_owner(world: World) -> None:
    mine = await world.repo.submit(spec(request_id="same"))
    theirs = await world.repo.submit(spec(request_id="same", owner="bob", project="p2"))

    assert mine != theirs
    assert len(await world.rows("SELECT id FROM tasks")) == 2


async def test_a_request_id_reused_for_a_different_task_is_a_conflict_and_writes_nothing(
    world: World,
) -> None:
    first = await world.repo.submit(spec(request_id="r-1", priority=1))

    with pytest.raises(Conflict) as err:
        await world.repo.submit_many([spec(request_id="r-2"), spec(request_id="r-1", priority=2)])

    assert err.value.fields["field"] == "request_id"
    assert err.value.fields["task_id"] == first
    assert await world.rows("SELECT id::text AS id FROM tasks") == [{"id": first}]


async def test_a_request_id_repeated_within_one_submit_is_invalid(world: World) -> None:
    with pytest.raises(Invalid) as err:
        await world.repo.submit_many([spec(request_id="r-1"), spec(request_id="r-1")])

    assert err.value.field == "request_id"
    assert await world.rows("SELECT id FROM tasks") == []


async def test_concurrent_submits_with_one_request_id_make_one_task(world: World) -> None:
    # The unique index makes the later inserts wait for the first commit, then
    # read its task: every caller gets the same id.
    specs = [spec(request_id="burst"), spec(request_id="other")]
    results = await asyncio.gather(*(world.repo.submit_many(specs) for _ in range(6)))

    assert len({tuple(r) for r in results}) == 1
    assert len(await world.rows("SELECT id FROM tasks")) == 2


async def test_a_batch_mixes_new_and_repeated_request_ids_and_unkeyed_specs(world: World) -> None:
    first = await world.repo.submit(spec(request_id="a"))
    ids, new = await world.repo.submit_many_new(
        [spec(), spec(request_id="a"), spec(request_id="b")]
    )

    assert ids[1] == first
    assert new == {ids[0], ids[2]} and len(set(ids)) == 3
    assert len(await world.rows("SELECT id FROM tasks")) == 3


@pytest.mark.parametrize(
    ("overrides", "field"), [({"project": "nope"}, "project"), ({"owner": "nope"}, "owner")]
)
async def test_unknown_project_or_owner_is_not_found(
    world: World, overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(NotFound) as err:
        await world.repo.submit(spec(**overrides))

    assert err.value.fields["field"] == field


async def test_a_valid_spec_round_trips_its_payload_and_selector(world: World) -> None:
    payload = {"steps": [1, 2.5, None, True, {"deep": "ok"}], "unicode": "ünï"}
    task_id = await world.repo.submit(
        spec(payload=payload, selector={"os": "android"}, priority=-1000)
    )

    row = await world.task_row(task_id)
    assert (row["payload"], row["selector"], row["priority"]) == (
        payload,
        {"os": "android"},
        -1000,
    )


async def test_bad_host_message_arguments_are_invalid_before_any_read(world: World) -> None:
    session = await world.host("h1", ["d1"])
    task_id = await world.submit()

    with pytest.raises(Invalid) as err:
        await world.repo.claim(session, task_id, 0)
    assert err.value.field == "attempt"
    with pytest.raises(Invalid) as err:
        await world.repo.renew(session, 123, 1, "x")  # type: ignore[arg-type]
    assert err.value.field == "task_id"
    with pytest.raises(Invalid) as err:
        await world.repo.progress(session, task_id, 1, "x", -1)
    assert err.value.field == "seq"
    with pytest.raises(Invalid) as err:
        await world.repo.report_result(
            session,
            task_id,
            1,
            "x",
            outcome="exploded",
            fingerprint="f",  # type: ignore[arg-type]
        )
    assert err.value.field == "outcome"
    with pytest.raises(Invalid) as err:
        await world.repo.report_result(
            session,
            task_id,
            1,
            "x",
            outcome="done",
            fingerprint="",  # type: ignore[arg-type]
        )
    assert err.value.field == "fingerprint"


@pytest.mark.parametrize(
    ("devices", "field"),
    [
        ([DeviceSnapshot(device_id="d1"), DeviceSnapshot(device_id="d1")], "devices.device_id"),
        ([DeviceSnapshot(device_id="d1", state="melting")], "devices.state"),
        ([DeviceSnapshot(device_id="")], "devices.device_id"),
        (
            [DeviceSnapshot(device_id="d1", capabilities={"os": 1})],  # type: ignore[dict-item]
            "devices.capabilities",
        ),
        (["d1"], "devices"),
    ],
)
async def test_a_bad_device_snapshot_is_invalid_and_keeps_the_old_snapshot(
    world: World, devices: list[Any], field: str
) -> None:
    session = await world.host("h1", ["d1", "d2"])

    with pytest.raises(Invalid) as err:
        await world.repo.heartbeat(session, devices)

    assert err.value.field == field
    assert len(await world.repo.list_devices()) == 2


async def test_bad_host_and_user_names_are_invalid(world: World) -> None:
    for bad in ("", "has space", "a" * 200, "sub.*.ject>"):
        with pytest.raises(Invalid) as err:
            await world.repo.add_host(bad)
        assert err.value.field == "host_id"
    with pytest.raises(Invalid):
        await world.repo.add_user("")
    with pytest.raises(NotFound):
        await world.repo.add_project("p9", owner="ghost")
    with pytest.raises(Invalid) as err:
        await world.repo.list_tasks(world.root, states=["sleeping"])
    assert err.value.field == "states"


async def test_an_unreachable_database_is_unavailable_with_the_driver_error_as_cause(
    world: World,
) -> None:
    from fleetlease.persistence.db import create_engine
    from fleetlease.persistence.errors import Unavailable
    from fleetlease.persistence.repository import Repository

    engine = create_engine("postgresql://postgres@127.0.0.1:1/nowhere", pool_size=1)
    try:
        with pytest.raises(Unavailable) as err:
            await Repository(engine, world.clock).submit(spec())
    finally:
        await engine.dispose()

    assert err.value.retryable and err.value.__cause__ is not None


async def test_a_connection_killed_mid_transaction_is_unavailable(world: World) -> None:
    from sqlalchemy import text

    from fleetlease.persistence.errors import Unavailable

    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    async with world.engine.connect() as admin:
        pids = [
            r[0]
            for r in await admin.execute(
                text(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid()"
                )
            )
        ]
        for pid in pids:
            await admin.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        await admin.commit()
    # Pooled connections are now dead; pre-ping replaces them, so this still works ...
    status = await world.repo.renew(session, c.task_id, 1, c.lease_token)
    assert status.attempt == 1
    # ... while a connection lost inside the transaction is reported as Unavailable.
    original = world.repo._load

    async def load_then_die(conn, *args):  # type: ignore[no-untyped-def]
        row = await original(conn, *args)
        pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar()
        async with world.engine.connect() as admin:
            await admin.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        return row

    world.repo._load = load_then_die  # type: ignore[method-assign]
    with pytest.raises(Unavailable) as err:
        await world.repo.ack(session, c.task_id, 1, c.lease_token)
    assert err.value.__cause__ is not None
