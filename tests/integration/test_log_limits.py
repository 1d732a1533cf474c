"""Caps on an attempt's log: lines and bytes per attempt (truncated with one
marker line), and no lines once the attempt has been over for the grace period."""

from __future__ import annotations

import pytest

from fleetlease.persistence.errors import Forbidden, Gone
from fleetlease.persistence.model import Outcome
from fleetlease.persistence.repository.sidechannels import LogLimits
from fleetlease.transport import wire
from tests.integration.test_repository_support import World, world
from tests.integration.test_transport_e2e import ADMIN, System, system

__all__ = ["system", "world"]

pytestmark = pytest.mark.embedded


async def _counters(w: World, task_id: str) -> tuple[int, int, bool]:
    [row] = await w.rows(
        "SELECT log_lines, log_bytes, log_truncated FROM attempts WHERE task_id = :t",
        t=task_id,
    )
    return row["log_lines"], row["log_bytes"], row["log_truncated"]


async def test_lines_beyond_the_line_cap_are_dropped_after_one_marker_line(world: World) -> None:
    world.repo.log_limits = LogLimits(max_lines=5)
    session = await world.host("h1", ["d1"])
    c = await world.running(session)

    assert await world.repo.append_logs(session, c.task_id, 1, 1, ["a", "b", "c"]) == 3
    assert await world.repo.append_logs(session, c.task_id, 1, 4, ["d", "e", "f", "g"]) == 2
    assert await world.repo.append_logs(session, c.task_id, 1, 8, ["h"]) == 0
    # A retry of the truncating batch changes nothing either.
    assert await world.repo.append_logs(session, c.task_id, 1, 4, ["d", "e", "f", "g"]) == 0

    lines = await world.repo.read_logs(c.task_id, world.carol)
    assert [(x["seq"], x["line"]) for x in lines] == [
        (1, "a"),
        (2, "b"),
        (3, "c"),
        (4, "d"),
        (5, "e"),
        (6, world.repo.log_limits.marker()),
    ]
    assert await _counters(world, c.task_id) == (5, 5, True)


async def test_the_byte_cap_counts_utf8_bytes_and_duplicates_count_once(world: World) -> None:
    world.repo.log_limits = LogLimits(max_bytes=10)
    session = await world.host("h1", ["d1"])
    c = await world.running(session)

    assert await world.repo.append_logs(session, c.task_id, 1, 0, ["éé", "abc"]) == 2  # 4 + 3
    assert await world.repo.append_logs(session, c.task_id, 1, 0, ["éé", "abc"]) == 0
    assert await _counters(world, c.task_id) == (2, 7, False)
    assert await world.repo.append_logs(session, c.task_id, 1, 2, ["xyz", "1"]) == 1

    lines = await world.repo.read_logs(c.task_id, world.carol)
    assert [x["line"] for x in lines] == ["éé", "abc", "xyz", world.repo.log_limits.marker()]
    assert await _counters(world, c.task_id) == (3, 10, True)


async def test_default_caps_hold_ten_mib_of_8_kib_lines_and_no_more(world: World) -> None:
    limits = world.repo.log_limits
    assert (limits.max_lines, limits.max_bytes, limits.grace_s) == (100_000, 10 * 2**20, 60.0)
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    line = "x" * 8192
    stored = 0
    seq = 0
    for _ in range(3):  # 3 x 1,000 lines of 8 KiB: 24 MB offered
        stored += await world.repo.append_logs(session, c.task_id, 1, seq, [line] * 1000)
        seq += 1000

    assert stored == 10 * 2**20 // 8192 == 1280
    count, size, truncated = await _counters(world, c.task_id)
    assert (count, size, truncated) == (1280, 1280 * 8192, True)
    [total] = await world.rows(
        "SELECT count(*) AS n, sum(octet_length(line)) AS b FROM log_lines WHERE task_id = :t",
        t=c.task_id,
    )
    assert total["n"] == 1281 and total["b"] < 10 * 2**20 + 1024
    print(f"\n3,000 x 8 KiB offered to one attempt: {total['n']} lines, {total['b']} bytes stored")


async def test_lines_land_within_the_grace_period_after_the_result_and_are_gone_after(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    await world.repo.report_result(
        session, c.task_id, c.attempt, c.lease_token, outcome=Outcome.FAILED, fingerprint="f"
    )

    world.clock.advance(59)
    assert await world.repo.append_logs(session, c.task_id, 1, 0, ["late but in time"]) == 1
    world.clock.advance(1)
    before = await world.repo.read_logs(c.task_id, world.carol)
    with pytest.raises(Gone) as err:
        await world.repo.append_logs(session, c.task_id, 1, 1, ["too late"])
    assert err.value.fields["reason"] == "log_closed"
    with pytest.raises(Gone):
        await world.repo.append_logs(session, c.task_id, 1, 2, [])

    assert await world.repo.read_logs(c.task_id, world.carol) == before
    assert await _counters(world, c.task_id) == (1, len("late but in time"), False)


async def test_another_hosts_attempt_is_still_forbidden_before_any_cap(world: World) -> None:
    world.repo.log_limits = LogLimits(max_lines=1)
    owner = await world.host("h1", ["d1"])
    other = await world.host("h2", ["d1"])
    c = await world.running(owner)

    with pytest.raises(Forbidden):
        await world.repo.append_logs(other, c.task_id, 1, 0, ["x", "y"])
    assert await _counters(world, c.task_id) == (0, 0, False)


async def test_over_nats_a_capped_log_is_truncated_and_a_closed_one_is_gone(
    system: System,
) -> None:
    system.repo.log_limits = LogLimits(max_lines=3, grace_s=0.0)
    h = await system.host("h1")
    a = await system.running(h)
    c = h.client

    await c.append_logs(a.task_id, a.attempt, 1, ["one", "two", "three", "four", "five"])
    await c.append_logs(a.task_id, a.attempt, 6, ["six"])
    await c.result(a.task_id, a.attempt, a.lease_token, outcome="done", fingerprint="f")
    with pytest.raises(wire.RemoteError) as err:
        await c.append_logs(a.task_id, a.attempt, 7, ["after the result"])

    assert err.value.code == "gone"
    lines = await system.repo.read_logs(a.task_id, ADMIN)
    assert [(r["seq"], r["line"]) for r in lines] == [
        (1, "one"),
        (2, "two"),
        (3, "three"),
        (4, system.repo.log_limits.marker()),
    ]
