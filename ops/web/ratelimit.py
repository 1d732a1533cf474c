"""Sign-in attempts of the console, limited per user name and per client address.

Each key (a user name, a client address) has a token bucket: ``burst``
attempts at once, then one more every ``interval_s``. Every attempt counts,
accepted or not, and the check comes before the control plane is asked
anything, so a refusal says nothing about whether the user exists or the
token was right. At most ``max_keys`` keys are tracked (the least recently
seen is forgotten first), so a flood of made-up names or addresses cannot
grow the console's memory.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


class SignInThrottled(Exception):
    """Too many sign-in attempts for this user name or from this address."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("too many sign-in attempts")
        #: Whole seconds until the next attempt is admitted (at least 1).
        self.retry_after_s = max(1, math.ceil(retry_after_s))


@dataclass
class _Bucket:
    tokens: float
    stamp: float


class RateLimiter:
    """Token buckets by key (pure logic; the clock is injected)."""

    def __init__(
        self,
        *,
        burst: int,
        interval_s: float,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1 or interval_s <= 0 or max_keys < 1:
            raise ValueError("burst and max_keys must be at least 1, interval_s positive")
        self.burst = burst
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def _bucket(self, key: str) -> _Bucket:
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = _Bucket(float(self.burst), now)
            self._buckets[key] = bucket
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            refill = (now - bucket.stamp) / self.interval_s
            bucket.tokens = min(float(self.burst), bucket.tokens + refill)
            bucket.stamp = now
            self._buckets.move_to_end(key)
        return bucket

    def wait_s(self, key: str) -> float:
        """Seconds until ``key`` may make an attempt (0 now), taking none."""
        bucket = self._bucket(key)
        return 0.0 if bucket.tokens >= 1.0 else (1.0 - bucket.tokens) * self.interval_s

    def take(self, key: str) -> None:
        """Counts an attempt of ``key`` (after ``wait_s`` said 0)."""
        bucket = self._bucket(key)
        bucket.tokens = max(0.0, bucket.tokens - 1.0)


class SignInLimits:
    """The sign-in limits of one console: per user name and per client address."""

    def __init__(
        self,
        *,
        per_user: RateLimiter,
        per_address: RateLimiter,
    ) -> None:
        self.per_user = per_user
        self.per_address = per_address

    def attempt(self, *, user: str, address: str) -> None:
        """Counts one sign-in attempt, or raises ``SignInThrottled`` (counting
        nothing) if the user name or the address is over its limit. User names
        are compared case-insensitively here, so that case variants of one name
        share its limit."""
        name = user.casefold()
        wait = max(self.per_user.wait_s(name), self.per_address.wait_s(address))
        if wait > 0:
            raise SignInThrottled(wait)
        self.per_user.take(name)
        self.per_address.take(address)
