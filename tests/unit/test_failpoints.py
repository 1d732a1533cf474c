"""Fail points: free when disarmed, reproducible when armed."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from fleetlease.actors import failpoints
from fleetlease.actors.failpoints import FailPointError

P = failpoints.LEASE_AFTER_COMMIT_BEFORE_REPLY


@pytest.fixture(autouse=True)
def _disarm_all() -> Iterator[None]:
    failpoints.disarm()
    yield
    failpoints.disarm()


def test_a_disarmed_point_never_fires() -> None:
    for _ in range(1000):
        failpoints.hit(P)
    assert failpoints.fired(P) == 0


def test_an_armed_point_fires_and_names_itself() -> None:
    failpoints.arm(P)
    with pytest.raises(FailPointError) as info:
        failpoints.hit(P)
    assert info.value.name == P
    assert failpoints.fired(P) == 1


def test_other_points_are_unaffected_by_arming_one() -> None:
    failpoints.arm(P)
    failpoints.hit(failpoints.LEASE_BEFORE_COMMIT)


def test_count_limits_how_often_a_point_fires() -> None:
    failpoints.arm(P, count=2)
    outcomes = []
    for _ in range(5):
        try:
            failpoints.hit(P)
            outcomes.append("pass")
        except FailPointError:
            outcomes.append("fire")
    assert outcomes == ["fire", "fire", "pass", "pass", "pass"]


def test_skip_lets_the_first_passes_through() -> None:
    failpoints.arm(P, skip=2, count=1)
    failpoints.hit(P)
    failpoints.hit(P)
    with pytest.raises(FailPointError):
        failpoints.hit(P)
    failpoints.hit(P)


def _pattern(seed: int) -> list[bool]:
    failpoints.arm(P, probability=0.3, seed=seed)
    out = []
    for _ in range(200):
        try:
            failpoints.hit(P)
            out.append(False)
        except FailPointError:
            out.append(True)
    failpoints.disarm(P)
    return out


def test_a_seed_makes_a_probabilistic_point_reproducible() -> None:
    a, b = _pattern(7), _pattern(7)
    assert a == b
    assert 0 < sum(a) < 200
    assert _pattern(8) != a


def test_a_paused_point_blocks_until_released() -> None:
    release = threading.Event()
    failpoints.arm(P, pause=release)
    done = threading.Event()

    def worker() -> None:
        failpoints.hit(P)
        done.set()

    t = threading.Thread(target=worker)
    t.start()
    for _ in range(1000):
        if failpoints.paused(P) == 1:
            break
        threading.Event().wait(0.01)
    assert failpoints.paused(P) == 1
    assert not done.is_set()
    release.set()
    t.join(5)
    assert done.is_set()


def test_the_context_manager_disarms_on_exit() -> None:
    with failpoints.armed(P, count=1), pytest.raises(FailPointError):
        failpoints.hit(P)
    failpoints.hit(P)


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [({"probability": 1.5}, "probability"), ({"count": -1}, "count"), ({"skip": -1}, "skip")],
)
def test_bad_arguments_are_refused_by_name(kwargs: dict[str, float], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        failpoints.arm(P, **kwargs)  # type: ignore[arg-type]


def test_unknown_point_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown fail point"):
        failpoints.arm("lease.typo")


def test_a_point_on_the_event_loop_fires_instead_of_parking() -> None:
    gate = threading.Event()
    failpoints.arm(P, pause=gate, count=1)
    try:
        with pytest.raises(failpoints.FailPointError):
            failpoints.hit(P, may_pause=False)
        assert failpoints.paused(P) == 0
    finally:
        failpoints.disarm()
