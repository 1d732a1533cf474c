"""Admission bookkeeping (``transport/admission.py``) and the pacing of event
long-polls (``ops.client.PollPacer``): pure logic, no I/O."""

from __future__ import annotations

import pytest

from fleetlease.ops.client import PollPacer
from fleetlease.transport.admission import (
    UNKNOWN_OPS_PRINCIPAL,
    Admission,
    Budget,
    host_principal,
    ops_principal,
)
from fleetlease.transport.subjects import Subjects


def budget(**kw: int) -> Budget:
    values = {
        "principal_requests": 2,
        "principal_bytes": 100,
        "principal_polls": 2,
        "backlog_requests": 5,
        "backlog_bytes": 1000,
    }
    values.update(kw)
    return Budget(**values)


def test_a_principal_over_its_request_budget_is_refused_and_others_are_not() -> None:
    a = Admission(budget())
    assert a.admit("host:a", 10) is None
    assert a.admit("host:a", 10) is None
    assert a.admit("host:a", 10) is not None
    assert a.admit("host:b", 10) is None
    assert a.shed_principal == 1
    a.release("host:a", 10)
    assert a.admit("host:a", 10) is None
    assert a.in_flight("host:a") == 2


def test_a_principal_over_its_byte_budget_is_refused() -> None:
    a = Admission(budget())
    assert a.admit("u", 60) is None
    assert a.admit("u", 60) is not None
    assert a.admit("v", 60) is None
    a.release("u", 60)
    assert a.admit("u", 100) is None


def test_the_backlog_bounds_all_principals_together() -> None:
    a = Admission(budget(backlog_requests=3))
    for name in ("a", "b", "c"):
        assert a.admit(name, 1) is None
    assert a.admit("d", 1) is not None
    assert a.shed_backlog == 1
    a.release("b", 1)
    assert a.admit("d", 1) is None
    big = Admission(budget(backlog_bytes=150, principal_bytes=1000))
    assert big.admit("a", 100) is None
    assert big.admit("b", 100) is not None


def test_release_returns_every_counter_to_zero() -> None:
    a = Admission(budget())
    a.admit("a", 7)
    a.park("a")
    a.release("a", 7)
    a.unpark("a")
    assert (a.backlog_requests, a.backlog_bytes, a.in_flight("a"), a.parked("a")) == (0, 0, 0, 0)


def test_long_polls_are_capped_per_principal() -> None:
    a = Admission(budget(principal_polls=2))
    assert a.park("user:u") and a.park("user:u")
    assert not a.park("user:u")
    assert a.park("user:v")
    a.unpark("user:u")
    assert a.park("user:u")
    assert a.shed_polls == 1


@pytest.mark.parametrize("name", ["principal_requests", "backlog_bytes", "principal_polls"])
def test_a_budget_bound_below_one_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        budget(**{name: 0})


def test_principals_are_read_from_the_subject_or_else_the_connection() -> None:
    s = Subjects("fl")
    assert host_principal(s, "fl.host.h1.control.heartbeat") == "host:h1"
    assert host_principal(s, "other.host.h1.control.heartbeat") == "host:?"
    # The subject names the user; a borrowed inbox changes nothing.
    bob = s.ops_inbox_prefix("bob")
    assert ops_principal(s, "fl.ops.alice.events", f"{bob}.NUID.1") == "user:alice"
    # A request naming no user (an open broker's identify) is the connection's.
    assert ops_principal(s, "fl.ops.events", "_INBOX.abcdef.7") == "conn:_INBOX.abcdef"
    assert ops_principal(s, "fl.ops.events", "") == UNKNOWN_OPS_PRINCIPAL
    assert ops_principal(s, "fl.ops.events", "noinbox") == UNKNOWN_OPS_PRINCIPAL


def test_an_early_empty_answer_backs_off_exponentially_to_the_cap() -> None:
    p = PollPacer(base_s=0.5, cap_s=4.0, rng=lambda: 1.0)
    delays = [p.answered(waited_s=0.001, asked_s=25.0, events=0) for _ in range(6)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    # A busy loop of 10 minutes of early answers makes only a few hundred polls.
    p = PollPacer(rng=lambda: 0.0)
    elapsed, polls = 0.0, 0
    while elapsed < 600:
        elapsed += p.answered(waited_s=0.0, asked_s=25.0, events=0) + 0.001
        polls += 1
    assert polls < 200


def test_events_or_a_full_wait_reset_the_backoff_and_busy_backs_off() -> None:
    p = PollPacer(base_s=0.5, cap_s=15.0, rng=lambda: 1.0)
    p.answered(waited_s=0.0, asked_s=25.0, events=0)
    p.answered(waited_s=0.0, asked_s=25.0, events=0)
    assert p.answered(waited_s=0.0, asked_s=25.0, events=3) == 0.0
    assert p.answered(waited_s=0.0, asked_s=25.0, events=0) == 0.5
    assert p.answered(waited_s=25.0, asked_s=25.0, events=0) == 0.0
    assert p.refused() == 0.5
    assert p.refused() == 1.0
    jittered = PollPacer(base_s=1.0, rng=lambda: 0.0)
    assert jittered.refused() == 0.5
