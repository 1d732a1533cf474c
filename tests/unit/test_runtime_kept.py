"""The per-host store of assignments no long-poll was parked to take."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from fleetlease.actors.longpoll import _Kept
from fleetlease.persistence.model import Assignment

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _a(i: int, device: str, attempt: int = 1) -> Assignment:
    return Assignment(
        task_id=f"t{i}",
        attempt=attempt,
        host_id="h1",
        device_id=device,
        lease_id=f"l{i}",
        claim_deadline=T0 + timedelta(seconds=i),
    )


def test_any_device_takes_the_first_kept_up_to_the_limit() -> None:
    k = _Kept()
    for i in range(5):
        k.add(_a(i, f"d{i}"))
    assert [a.task_id for a in k.take(None, 2)] == ["t0", "t1"]
    assert [a.task_id for a in k.take(None, 10)] == ["t2", "t3", "t4"]
    assert not k and k.take(None, 1) == []


def test_named_devices_take_only_theirs_earliest_deadline_first() -> None:
    k = _Kept()
    for i in range(6):
        k.add(_a(i, f"d{i % 3}"))  # d0: t0, t3; d1: t1, t4; d2: t2, t5
    assert [a.task_id for a in k.take(frozenset({"d1"}), 5)] == ["t1", "t4"]
    assert [a.task_id for a in k.take(frozenset({"d2", "d0"}), 3)] == ["t0", "t2", "t3"]
    assert [a.task_id for a in k.take(frozenset({"d9"}), 3)] == []
    assert [a.task_id for a in k.take(None, 3)] == ["t5"]
    assert len(k) == 0 and k.by_device == {}


def test_a_limit_of_zero_takes_nothing() -> None:
    k = _Kept()
    k.add(_a(1, "d1"))
    assert k.take(None, 0) == [] and len(k) == 1


@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 2)), max_size=30),
    st.lists(
        st.tuples(st.none() | st.frozensets(st.integers(0, 6), max_size=4), st.integers(0, 4)),
        max_size=20,
    ),
)
def test_every_kept_assignment_is_taken_once_and_only_by_a_poll_that_may_claim_it(
    adds: list[tuple[int, int]], takes: list[tuple[frozenset[int] | None, int]]
) -> None:
    k = _Kept()
    added = {}
    for i, (dev, attempt) in enumerate(adds):
        a = _a(i, f"d{dev}", attempt)
        k.add(a)
        added[(a.task_id, a.attempt)] = a
    taken: list[Assignment] = []
    for wanted, limit in takes:
        names = None if wanted is None else frozenset(f"d{d}" for d in wanted)
        got = k.take(names, limit)
        assert len(got) <= limit
        assert all(names is None or a.device_id in names for a in got)
        taken.extend(got)
    taken.extend(k.take(None, len(adds) + 1))
    assert len(k) == 0 and k.by_device == {}
    assert sorted((a.task_id, a.attempt) for a in taken) == sorted(added)
