"""Named fail points for chaos tests.

Code calls ``failpoints.hit("lease.after_commit_before_reply")`` at the places
where a crash is interesting. Disarmed (the normal case) that is one truthiness
check of a module-level dict: no lock, no lookup. A test arms a point by name
with a count, a probability and a seed (reproducible), or with a ``pause`` event
that parks the calling thread until the test releases it.

When an armed point fires it raises :class:`FailPointError`. The actors let that
exception escape their handler on purpose, so it crashes the actor the way a
real bug would (``on_failure``, supervisor restart).

The registry is process-wide on purpose, like the fail points of FreeBSD or
TiKV: a point deep inside an actor cannot be reached by dependency injection
without threading a test hook through every constructor.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

#: Every point the code defines, so tests can arm them by name without typos.
LEASE_BEFORE_COMMIT = "lease.before_commit"
LEASE_AFTER_COMMIT_BEFORE_REPLY = "lease.after_commit_before_reply"
SCHEDULER_BEFORE_ASSIGN = "scheduler.before_assign"
SCHEDULER_AFTER_ASSIGN_COMMIT = "scheduler.after_assign_commit"
REAPER_BEFORE_EXPIRE = "reaper.before_expire"
REAPER_AFTER_EXPIRE_COMMIT = "reaper.after_expire_commit"

POINTS: frozenset[str] = frozenset(
    {
        LEASE_BEFORE_COMMIT,
        LEASE_AFTER_COMMIT_BEFORE_REPLY,
        SCHEDULER_BEFORE_ASSIGN,
        SCHEDULER_AFTER_ASSIGN_COMMIT,
        REAPER_BEFORE_EXPIRE,
        REAPER_AFTER_EXPIRE_COMMIT,
    }
)


class FailPointError(Exception):
    """An armed fail point fired (a deliberate crash)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"fail point {name} fired")
        self.name = name


@dataclass(kw_only=True)
class _Arm:
    probability: float
    remaining: int | None
    skip: int
    rng: random.Random
    pause: threading.Event | None
    fired: int = 0
    paused: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def decide(self) -> bool:
        with self.lock:
            if self.skip > 0:
                self.skip -= 1
                return False
            if self.remaining is not None and self.remaining <= 0:
                return False
            if self.probability < 1.0 and self.rng.random() >= self.probability:
                return False
            if self.remaining is not None:
                self.remaining -= 1
            self.fired += 1
            return True


_armed: dict[str, _Arm] = {}
_fired_total: dict[str, int] = {}
_registry_lock = threading.Lock()


def hit(name: str, *, may_pause: bool = True) -> None:
    """Raise :class:`FailPointError` if the point ``name`` is armed and fires
    (or park until its pause event is set). Free when nothing is armed.

    ``may_pause=False`` is for points on the event loop, which must never park:
    there a point armed with a pause fires as an error instead."""
    if not _armed:
        return
    arm = _armed.get(name)
    if arm is None or not arm.decide():
        return
    with _registry_lock:
        _fired_total[name] = _fired_total.get(name, 0) + 1
    if arm.pause is not None and may_pause:
        with arm.lock:
            arm.paused += 1
        arm.pause.wait()
        return
    raise FailPointError(name)


def arm(
    name: str,
    *,
    probability: float = 1.0,
    count: int | None = None,
    skip: int = 0,
    seed: int | None = 0,
    pause: threading.Event | None = None,
) -> None:
    """Arm ``name``: after ``skip`` passes, fire with ``probability`` (drawn from
    a ``random.Random(seed)`` of its own), at most ``count`` times (None: no
    limit). With ``pause`` the point blocks the caller until the event is set
    instead of raising."""
    if name not in POINTS:
        raise ValueError(f"unknown fail point name {name!r}; known: {sorted(POINTS)}")
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"probability must be within [0, 1], got {probability!r}")
    if count is not None and count < 0:
        raise ValueError(f"count must be >= 0 or None, got {count!r}")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip!r}")
    with _registry_lock:
        _armed[name] = _Arm(
            probability=probability,
            remaining=count,
            skip=skip,
            rng=random.Random(seed),
            pause=pause,
        )


_SPEC_KEYS = {"count": int, "skip": int, "seed": int, "probability": float}


def arm_from_spec(spec: str) -> str:
    """Arm a point from one line of text, as a chaos hook outside the process
    hands it over: ``NAME [count=N] [skip=N] [seed=N] [probability=P]``
    (e.g. ``lease.after_commit_before_reply count=1 seed=5``), or ``off`` to
    disarm every point. Blank lines and ``#`` comments are ignored; the first
    other line is the spec. Returns the point's name (or ``"off"``).
    ``ValueError`` naming the problem for anything else."""
    lines = [ln.strip() for ln in spec.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    if not lines:
        raise ValueError("empty fail point spec")
    name, *options = lines[0].split()
    if name == "off" and not options:
        disarm()
        return "off"
    kwargs: dict[str, int | float] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in _SPEC_KEYS:
            raise ValueError(
                f"bad fail point option {option!r}: expected one of "
                + ", ".join(f"{k}=..." for k in sorted(_SPEC_KEYS))
            )
        try:
            kwargs[key] = _SPEC_KEYS[key](value)
        except ValueError:
            raise ValueError(f"bad fail point option {option!r}: not a number") from None
    arm(name, **kwargs)  # type: ignore[arg-type]
    return name


def disarm(name: str | None = None) -> None:
    """Disarm one point, or all of them (and forget their counters). Threads
    parked on a disarmed point's pause are released: a test that fails before
    releasing them must not leave an actor parked forever."""
    with _registry_lock:
        if name is None:
            removed = list(_armed.values())
            _armed.clear()
            _fired_total.clear()
        else:
            one = _armed.pop(name, None)
            removed = [one] if one is not None else []
    for arm_ in removed:
        if arm_.pause is not None:
            arm_.pause.set()


def fired(name: str) -> int:
    """How many times ``name`` fired since it was last disarmed-all."""
    with _registry_lock:
        return _fired_total.get(name, 0)


def paused(name: str) -> int:
    """How many threads reached the pause of ``name`` (those released included)."""
    arm_ = _armed.get(name)
    if arm_ is None:
        return 0
    with arm_.lock:
        return arm_.paused


@contextmanager
def armed(
    name: str,
    *,
    probability: float = 1.0,
    count: int | None = None,
    skip: int = 0,
    seed: int | None = 0,
    pause: threading.Event | None = None,
) -> Iterator[None]:
    """``with armed("lease.before_commit", count=1): ...``"""
    arm(name, probability=probability, count=count, skip=skip, seed=seed, pause=pause)
    try:
        yield
    finally:
        disarm(name)
