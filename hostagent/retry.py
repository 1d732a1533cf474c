"""Retry building blocks: capped exponential backoff with jitter, an
interruptible sleep, the error codes worth retrying, and the cost-bounded queue
that drops its oldest items instead of blocking."""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from fleetlease.hostagent.config import check_positive

__all__ = ["TRANSIENT_CODES", "Backoff", "DropOldestQueue", "sleep_or_event"]

Q = TypeVar("Q")

#: Error codes after which a request is worth repeating unchanged.
TRANSIENT_CODES = frozenset({"unavailable", "busy", "internal"})


class Backoff:
    """Capped exponential backoff with jitter: the n-th consecutive failure waits
    a random time in ``[c/2, c]`` with ``c = min(cap, base * 2**n)``. Never zero,
    so a failing loop cannot spin; the jitter spreads many agents apart."""

    def __init__(self, base_s: float, cap_s: float, *, rng: random.Random | None = None) -> None:
        check_positive("base_s", base_s)
        check_positive("cap_s", cap_s)
        if cap_s < base_s:
            raise ValueError(f"cap_s must be >= base_s, got {cap_s} < {base_s}")
        self.base_s = base_s
        self.cap_s = cap_s
        self._rng = rng or random.Random()
        self.failures = 0

    def next_delay(self) -> float:
        ceiling = min(self.cap_s, self.base_s * 2 ** min(self.failures, 62))
        self.failures += 1
        return float(ceiling / 2 + self._rng.random() * ceiling / 2)

    def reset(self) -> None:
        self.failures = 0


class DropOldestQueue(Generic[Q]):
    """A bounded FIFO that never blocks its producer: putting into a full queue
    drops the *oldest* items (counted in ``dropped``). Bounded by item count and,
    with ``cost``, by the total cost of its items (e.g. bytes). An item costing
    more than ``max_cost`` on its own is dropped at once.

    Loop-affine: use it from one event loop thread (the agent forwards calls
    made on other threads with ``call_soon_threadsafe``)."""

    def __init__(
        self,
        max_items: int,
        *,
        cost: Callable[[Q], int] | None = None,
        max_cost: int | None = None,
    ) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        if (cost is None) != (max_cost is None):
            raise ValueError("cost and max_cost go together")
        self.max_items = max_items
        self._cost = cost
        self.max_cost = max_cost
        self._items: deque[Q] = deque()
        self._total = 0
        self._nonempty = asyncio.Event()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def total_cost(self) -> int:
        return self._total

    def put(self, item: Q) -> int:
        """Append ``item``; returns how many items were dropped to make room."""
        cost = self._cost(item) if self._cost is not None else 0
        if self.max_cost is not None and cost > self.max_cost:
            self.dropped += 1
            return 1
        self._items.append(item)
        self._total += cost
        dropped = 0
        while len(self._items) > self.max_items or (
            self.max_cost is not None and self._total > self.max_cost
        ):
            self._drop_left()
            dropped += 1
        self.dropped += dropped
        self._nonempty.set()
        return dropped

    def _drop_left(self) -> Q:
        item = self._items.popleft()
        if self._cost is not None:
            self._total -= self._cost(item)
        if not self._items:
            self._nonempty.clear()
        return item

    def popleft(self) -> Q:
        """Remove and return the oldest item (IndexError when empty)."""
        return self._drop_left()

    def peek(self) -> Q:
        return self._items[0]

    def __iter__(self) -> Iterator[Q]:
        return iter(self._items)

    async def wait(self) -> None:
        """Return once the queue is not empty."""
        while not self._items:
            self._nonempty.clear()
            await self._nonempty.wait()

    def pop_batch(self, key: Callable[[Q], Hashable], *, max_items: int) -> list[Q]:
        """Pop the longest run (at most ``max_items``) of leading items sharing
        the first item's ``key``."""
        if not self._items:
            return []
        first = key(self._items[0])
        batch: list[Q] = []
        while self._items and len(batch) < max_items and key(self._items[0]) == first:
            batch.append(self._drop_left())
        return batch


async def sleep_or_event(delay: float, *events: asyncio.Event) -> bool:
    """Sleep ``delay`` seconds; returns True early if any event is set."""
    for e in events:
        if e.is_set():
            return True
    if not events:
        await asyncio.sleep(delay)
        return False
    if len(events) == 1:
        # The common case (a renewal loop, a backoff): wait in this task,
        # no waiter task to create and cancel.
        try:
            async with asyncio.timeout(max(delay, 0.0)):
                await events[0].wait()
        except TimeoutError:
            return events[0].is_set()
        return True
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        done, _ = await asyncio.wait(
            waiters, timeout=max(delay, 0.0), return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        for w in waiters:
            w.cancel()
    return bool(done)
