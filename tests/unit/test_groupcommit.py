"""``persistence.groupcommit.GroupCommit``, the batching shared by the control
plane's batchers and the replay check, over a pure ``_commit``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from fleetlease.persistence.groupcommit import GroupCommit


class Doubler(GroupCommit[int, int]):
    """Doubles each item; a negative item fails alone; records the batches."""

    def __init__(self, **kw: float) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.seen: list[list[int]] = []
        self.started = asyncio.Event()

    async def _commit(self, items: Sequence[int]) -> Sequence[int | Exception]:
        self.seen.append(list(items))
        self.started.set()
        await asyncio.sleep(0)
        return [ValueError(i) if i < 0 else 2 * i for i in items]


async def test_each_item_gets_its_own_outcome_and_one_failure_fails_no_other() -> None:
    g = Doubler(max_inflight=1)
    results = await asyncio.gather(*(g.submit(i) for i in (1, -2, 3)), return_exceptions=True)
    assert results[0] == 2 and results[2] == 6
    assert isinstance(results[1], ValueError)
    assert g.items == 3 and g.batches == len(g.seen)


async def test_items_queued_while_a_batch_runs_share_the_next_one() -> None:
    g = Doubler(max_inflight=1)
    first = asyncio.ensure_future(g.submit(0))
    await g.started.wait()  # its batch is running
    rest = [asyncio.ensure_future(g.submit(i)) for i in range(1, 10)]
    assert await asyncio.wait_for(asyncio.gather(first, *rest), 5) == [2 * i for i in range(10)]
    # The first went alone; the rest queued behind it and went together.
    assert g.seen == [[0], list(range(1, 10))]


async def test_an_item_submitted_as_the_last_flusher_ends_is_still_committed() -> None:
    g = Doubler(max_inflight=1)
    # The answer wakes this task before the flusher's task is reaped: the
    # next submit, made at once, must see that the flusher left.
    assert await g.submit(1) == 2
    async with asyncio.timeout(5):  # not wait_for: its task would start later
        assert await g.submit(2) == 4


async def test_lingering_waits_for_company_and_an_urgent_item_ends_the_wait() -> None:
    g = Doubler(linger_s=30.0)
    waiting = [asyncio.ensure_future(g.submit(i)) for i in range(3)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert g.seen == [] and not any(w.done() for w in waiting)
    assert await asyncio.wait_for(g.submit(7, urgent=True), 5) == 14
    assert await asyncio.gather(*waiting) == [0, 2, 4]
    assert g.seen == [[0, 1, 2, 7]]


async def test_a_full_batch_ends_the_wait() -> None:
    g = Doubler(linger_s=30.0, max_batch=4)
    assert await asyncio.wait_for(asyncio.gather(*(g.submit(i) for i in range(4))), 5) == [
        0,
        2,
        4,
        6,
    ]


@pytest.mark.parametrize(
    "kw", [{"max_batch": 0}, {"max_inflight": 0}, {"linger_s": -1.0}, {"linger_s": float("nan")}]
)
def test_bad_settings_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Doubler(**kw)
