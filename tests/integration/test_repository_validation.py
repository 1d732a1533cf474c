"""Bad input: wrong types and out-of-range values are ``Invalid`` naming the field,
unknown ids are ``NotFound``, and nothing is half-written in any case."""

from __future__ import annotations

from typing import Any

import pytest

from persistence.errors import Invalid, NotFound
from persistence.model import DeviceSnapshot, RetryPolicy, TaskKind, TaskSpec
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
