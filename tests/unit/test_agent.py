"""The agent's pure parts: backoff, the drop-oldest queues, configuration,
credential loading, failpoint parsing, and log enqueueing that never blocks."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from fleetlease.hostagent.agent import (
    FAILPOINTS,
    Agent,
    AgentConfig,
    Backoff,
    DropOldestQueue,
    RegistrationRefused,
    load_credential,
    parse_failpoints,
)
from fleetlease.hostagent.devices import SimulatedDeviceManager

CREDENTIAL = "ab" * 32


def config(tmp_path: Path, **overrides: Any) -> AgentConfig:
    fields: dict[str, Any] = {
        "host_id": "h1",
        "credential": CREDENTIAL,
        "nats_url": "nats://127.0.0.1:1",
        "state_dir": tmp_path,
    }
    fields.update(overrides)
    return AgentConfig(**fields)


# --- backoff ------------------------------------------------------------------------------


def test_backoff_doubles_up_to_the_cap_with_jitter_in_the_upper_half() -> None:
    backoff = Backoff(0.1, 1.0, rng=random.Random(7))

    delays = [backoff.next_delay() for _ in range(8)]

    ceilings = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0]
    for delay, ceiling in zip(delays, ceilings, strict=True):
        assert ceiling / 2 <= delay <= ceiling


def test_backoff_is_never_zero_so_a_failing_loop_cannot_spin() -> None:
    backoff = Backoff(0.05, 0.05, rng=random.Random(0))
    assert min(backoff.next_delay() for _ in range(1000)) >= 0.025


def test_backoff_reset_starts_again_from_the_base() -> None:
    backoff = Backoff(0.1, 10.0, rng=random.Random(1))
    for _ in range(5):
        backoff.next_delay()

    backoff.reset()

    assert backoff.next_delay() <= 0.1


def test_backoff_jitter_spreads_agents_apart() -> None:
    delays = {
        round(Backoff(1.0, 1.0, rng=random.Random(seed)).next_delay(), 6) for seed in range(50)
    }
    assert len(delays) == 50


@pytest.mark.parametrize(("base", "cap"), [(0, 1), (-1, 1), (1, 0), (2, 1), (float("nan"), 1)])
def test_backoff_rejects_bad_bounds(base: float, cap: float) -> None:
    with pytest.raises(ValueError):
        Backoff(base, cap)


# --- the drop-oldest queue -------------------------------------------------------------------


def test_full_queue_drops_the_oldest_and_counts_them() -> None:
    q: DropOldestQueue[int] = DropOldestQueue(3)

    dropped = [q.put(i) for i in range(5)]

    assert dropped == [0, 0, 0, 1, 1]
    assert q.dropped == 2
    assert [q.popleft() for _ in range(len(q))] == [2, 3, 4]


def test_cost_bound_drops_oldest_until_the_total_fits() -> None:
    q: DropOldestQueue[bytes] = DropOldestQueue(10, cost=len, max_cost=10)
    q.put(b"aaaa")
    q.put(b"bbbb")

    q.put(b"cccccc")

    assert q.dropped == 1
    assert q.total_cost == 10
    assert [q.popleft(), q.popleft()] == [b"bbbb", b"cccccc"]
    assert q.total_cost == 0


def test_an_item_larger_than_the_whole_bound_is_dropped_alone() -> None:
    q: DropOldestQueue[bytes] = DropOldestQueue(10, cost=len, max_cost=4)
    q.put(b"ok")

    assert q.put(b"too large") == 1

    assert [q.popleft()] == [b"ok"]
    assert q.dropped == 1


def test_pop_batch_takes_the_leading_run_of_one_key() -> None:
    q: DropOldestQueue[tuple[str, int]] = DropOldestQueue(10)
    for item in [("a", 1), ("a", 2), ("b", 1), ("a", 3)]:
        q.put(item)

    assert q.pop_batch(lambda i: i[0], max_items=10) == [("a", 1), ("a", 2)]
    assert q.pop_batch(lambda i: i[0], max_items=10) == [("b", 1)]
    assert q.pop_batch(lambda i: i[0], max_items=10) == [("a", 3)]
    assert q.pop_batch(lambda i: i[0], max_items=10) == []


async def test_wait_returns_once_something_is_put() -> None:
    q: DropOldestQueue[int] = DropOldestQueue(2)
    waiter = asyncio.create_task(q.wait())
    await asyncio.sleep(0)
    assert not waiter.done()

    q.put(1)

    await asyncio.wait_for(waiter, 5)
    q.popleft()
    assert len(q) == 0


# --- configuration --------------------------------------------------------------------------


def test_config_hides_the_credential_and_never_echoes_a_bad_one(tmp_path: Path) -> None:
    assert CREDENTIAL not in repr(config(tmp_path))
    secret = "not-hex-but-secret-" + "x" * 40
    with pytest.raises(ValueError) as info:
        config(tmp_path, credential=secret)
    assert secret not in str(info.value)
    assert "credential" in str(info.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("host_id", "bad.id"),
        ("claim_wait_s", 0),
        ("claim_wait_s", 61),
        ("grace_s", -1),
        ("request_timeout_s", float("inf")),
        ("log_queue_lines", 0),
        ("heartbeat_s", 0),
        ("failpoints", frozenset({"nope"})),
        ("max_resumes", -1),
        ("max_resumes", 1.5),
        ("claim_polls", 0),
        ("claim_polls", 1.5),
        ("claim_polls", True),
    ],
)
def test_config_rejects_bad_values_naming_the_field(tmp_path: Path, name: str, value: Any) -> None:
    with pytest.raises(ValueError) as info:
        config(tmp_path, **{name: value})
    assert name.split("_s")[0].split("_")[0] in str(info.value)


def test_unknown_runner_names_are_refused_with_the_available_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        Agent(config(tmp_path, goal_runner="no-such-runner"), SimulatedDeviceManager(1))
    assert "no-such-runner" in str(info.value) and "sim-goal" in str(info.value)


def test_registration_refused_names_the_host_and_maps_to_a_denied_code() -> None:
    exc = RegistrationRefused("host-b", "unauthorized", "invalid credentials")
    assert "host-b" in exc.message and "--token-file" in exc.message
    assert exc.code == "unauthorized"
    assert RegistrationRefused("h", "forbidden", "x").code == "forbidden"


def test_parse_failpoints() -> None:
    assert parse_failpoints(None) == frozenset()
    assert parse_failpoints(" after_ack , after_result_recorded") == {
        "after_ack",
        "after_result_recorded",
    }
    assert parse_failpoints(",".join(FAILPOINTS)) == FAILPOINTS
    with pytest.raises(ValueError, match="unknown"):
        parse_failpoints("after_ack,typo")


def test_load_credential_strips_whitespace_and_never_echoes_bad_content(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.write_text(f"  {CREDENTIAL.upper()}\n")
    assert load_credential(good) == CREDENTIAL
    bad = tmp_path / "bad"
    bad.write_text("secret-but-wrong\n")
    with pytest.raises(ValueError) as info:
        load_credential(bad)
    assert "secret-but-wrong" not in str(info.value)


# --- logs never block ---------------------------------------------------------------------------


async def test_runner_logs_beyond_the_queue_drop_the_oldest_and_never_block(tmp_path: Path) -> None:
    from fleetlease.hostagent.journal import JournalRecord
    from fleetlease.hostagent.state import Attempt
    from fleetlease.persistence.model import TaskKind

    agent = Agent(config(tmp_path, log_queue_lines=5), SimulatedDeviceManager(1))
    record = JournalRecord(
        task_id="t1",
        attempt=1,
        lease_id="l1",
        lease_token="secret",
        device_id="sim-0",
        kind=TaskKind.GOAL,
        lease_s=30.0,
    )
    ctx = agent.attempts.context(Attempt(record=record))

    for i in range(100):
        ctx.log(f"line {i}")

    assert agent.stats.logs_dropped == 95
    logs = agent.shipping.logs
    lines = [logs.popleft() for _ in range(len(logs))]
    assert [item.line for item in lines] == [f"line {i}" for i in range(95, 100)]
    assert [item.seq for item in lines] == list(range(96, 101))
