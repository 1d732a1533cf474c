"""The console's session limits (``ops/web/sessions.py``) and sign-in rate limits
(``ops/web/ratelimit.py``) as pure logic, on an injected clock."""

from __future__ import annotations

import pytest

from fleetlease.ops.web.ratelimit import RateLimiter, SignInLimits, SignInThrottled
from fleetlease.ops.web.sessions import Session, SessionsFull, SessionStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store(clock: Clock, dropped: list[Session], **kw: float) -> SessionStore:
    return SessionStore(clock=clock, on_drop=dropped.append, **kw)  # type: ignore[arg-type]


def sign_in(s: SessionStore, clock: Clock, user: str) -> str:
    clock.now += 1.0
    session_id, _ = s.create(token=f"t-{user}", user=user, platform_admin=False)
    return session_id


def test_a_users_sign_in_past_the_cap_ends_their_own_least_recently_used_session() -> None:
    clock, dropped = Clock(), []
    s = store(clock, dropped, max_per_user=16)
    admin = sign_in(s, clock, "admin")
    alice = [sign_in(s, clock, "alice") for _ in range(16)]
    assert s.get(alice[0]) is not None  # used now: alice[1] is the least recently used

    sign_in(s, clock, "alice")

    assert s.count("alice") == 16
    assert [d.user for d in dropped] == ["alice"]
    assert s.get(alice[1]) is None
    assert s.get(alice[0]) is not None
    assert s.get(admin) is not None


def test_a_flood_of_one_users_sign_ins_ends_nobody_elses_session() -> None:
    clock, dropped = Clock(), []
    s = store(clock, dropped, max_per_user=4, max_sessions=8)
    others = [sign_in(s, clock, "admin"), sign_in(s, clock, "bob")]
    for _ in range(1000):
        sign_in(s, clock, "alice")

    assert all(s.get(o) is not None for o in others)
    assert {d.user for d in dropped} == {"alice"}
    assert (len(s), s.count("alice")) == (6, 4)


def test_a_full_store_refuses_a_sign_in_and_ends_no_session() -> None:
    clock, dropped = Clock(), []
    s = store(clock, dropped, max_per_user=2, max_sessions=3)
    sign_in(s, clock, "a")
    sign_in(s, clock, "a")
    sign_in(s, clock, "b")

    with pytest.raises(SessionsFull):
        sign_in(s, clock, "c")
    sign_in(s, clock, "a")  # at its own cap: ends its own, fits again

    assert (len(s), s.users(), [d.user for d in dropped]) == (3, {"a", "b"}, ["a"])


def test_sessions_expire_when_idle_and_at_their_absolute_age() -> None:
    clock, dropped = Clock(), []
    s = store(clock, dropped, idle_s=10.0, max_age_s=30.0)
    idle = sign_in(s, clock, "a")
    busy = sign_in(s, clock, "b")
    for _ in range(3):
        clock.now += 8.0
        assert s.get(busy) is not None
    assert s.sweep() == 1  # a was idle for 24s
    assert [d.user for d in dropped] == ["a"]
    assert s.get(idle) is None
    clock.now += 8.0
    assert s.get(busy) is None  # used every 8s, but 32s old
    assert (len(s), s.users()) == (0, set())


def test_a_bucket_admits_its_burst_then_one_per_interval() -> None:
    clock = Clock()
    limiter = RateLimiter(burst=3, interval_s=10.0, clock=clock)
    for _ in range(3):
        assert limiter.wait_s("k") == 0
        limiter.take("k")
    assert limiter.wait_s("k") == pytest.approx(10.0)
    clock.now += 5.0
    assert limiter.wait_s("k") == pytest.approx(5.0)
    clock.now += 5.0
    assert limiter.wait_s("k") == 0
    assert limiter.wait_s("other") == 0


def test_the_limiter_tracks_at_most_max_keys() -> None:
    limiter = RateLimiter(burst=1, interval_s=60.0, max_keys=100, clock=Clock())
    for i in range(10_000):
        limiter.take(f"name-{i}")
    assert len(limiter) == 100


def test_sign_in_limits_per_name_and_per_address_count_no_refused_attempt() -> None:
    clock = Clock()
    limits = SignInLimits(
        per_user=RateLimiter(burst=2, interval_s=60.0, clock=clock),
        per_address=RateLimiter(burst=3, interval_s=60.0, clock=clock),
    )
    limits.attempt(user="alice", address="10.0.0.1")
    limits.attempt(user="ALICE", address="10.0.0.2")  # case variants share a limit
    with pytest.raises(SignInThrottled) as refused:
        limits.attempt(user="Alice", address="10.0.0.3")
    assert refused.value.retry_after_s == 60
    limits.attempt(user="bob", address="10.0.0.3")  # the refusal counted nothing there
    limits.attempt(user="carol", address="10.0.0.3")
    limits.attempt(user="dave", address="10.0.0.3")
    with pytest.raises(SignInThrottled):
        limits.attempt(user="erin", address="10.0.0.3")  # the address is over its limit
    limits.attempt(user="erin", address="10.0.0.4")
