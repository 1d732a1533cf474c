"""A finished actor is freed by reference counting, not left to the cyclic
garbage collector (whose full collection, with 10,000 Lease actors finished
together, stopped ``serve`` for about half a second)."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from fleetlease.actors.lease import LeaseActor
from fleetlease.persistence.model import Assignment


class _Ctx:
    supervisor = None


class _SeenLease(LeaseActor):
    """The real Lease actor; a weak reference to each one made goes to ``seen``."""

    seen: list[weakref.ref[LeaseActor]] = []

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        _SeenLease.seen.append(weakref.ref(self))


def _assignment() -> Assignment:
    return Assignment(
        task_id="00000000-0000-0000-0000-000000000001",
        attempt=1,
        host_id="h1",
        device_id="d1",
        lease_id="l1",
        claim_deadline=datetime.now(UTC),
    )


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the actor was not freed"
        time.sleep(0.01)


@pytest.mark.usefixtures("no_cyclic_gc")
def test_a_stopped_lease_actor_is_freed_without_the_cyclic_collector() -> None:
    _SeenLease.seen.clear()
    ref = _SeenLease.start(_Ctx(), _assignment())
    _until(lambda: bool(_SeenLease.seen))
    ref.stop()  # returns once the actor has stopped
    del ref
    _until(lambda: _SeenLease.seen[0]() is None)
