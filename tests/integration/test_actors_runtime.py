"""The actor runtime through the ControlPlane facade, with simulated in-process
hosts and a real PostgreSQL. Time moves only through the ManualClock; the
Reaper is poked after each advance. No sleeps stand in for conditions."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import pykka
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.actors import failpoints
from fleetlease.actors.base import LEASE_THREADS
from fleetlease.actors.messages import Crash, Renew
from fleetlease.actors.runtime import ControlPlane
from fleetlease.persistence.clock import ManualClock
from fleetlease.persistence.errors import (
    Conflict,
    Gone,
    Invalid,
    NotFound,
    Unauthorized,
    Unavailable,
)
from fleetlease.persistence.model import (
    DeviceSnapshot,
    JournalEntry,
    LeaseTimings,
    Outcome,
    RetryPolicy,
    Session,
    TaskState,
    User,
)
from fleetlease.persistence.repository import Repository
from tests.chaos.harness import (
    SimHost,
    attempt_rows,
    retrying,
    spec,
    task_rows,
    task_state,
    wait_until,
)

TIMINGS = LeaseTimings(claim_s=30, ack_s=15, lease_s=30, liveness_s=1_000_000)
ADMIN = User(name="admin", platform_admin=True)
UNKNOWN_TASK = "0b0e5c52-9a2e-4f58-a7a3-0e0f1b8e2d6a"


@pytest.fixture(autouse=True)
def _stop_all_actors() -> Iterator[None]:
    yield
    failpoints.disarm()
    pykka.ActorRegistry.stop_all(timeout=30)


async def _repository(
    engine: AsyncEngine, clock: ManualClock, cls: type[Repository] = Repository
) -> Any:
    r = cls(engine, clock, TIMINGS)
    await r.add_user("admin", platform_admin=True)
    await r.add_project("default", owner="admin")
    return r


@pytest.fixture
async def repo(engine: AsyncEngine, clock: ManualClock) -> Repository:
    return await _repository(engine, clock)


async def _parked(cp: ControlPlane, host_id: str, n: int = 1) -> None:
    """Until ``n`` claims of the host are parked (an assignment pass may take
    them as claimers)."""
    await wait_until(
        lambda: sum(w.parked for w in cp.longpoll._waiters.get(host_id, {}).values()) >= n,
        what=f"{n} claim(s) of {host_id} to park",
    )


@pytest.fixture
async def cp(repo: Repository) -> AsyncIterator[ControlPlane]:
    plane = ControlPlane(repo, scheduler_interval_s=0.5)
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop()


@pytest.fixture
def events(cp: ControlPlane) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    cp.add_listener(seen.append)
    return seen


async def _state_is(engine: AsyncEngine, task_id: str, *states: str) -> None:
    async def check() -> bool:
        return await task_state(engine, task_id) in states

    await wait_until(check, what=f"task {task_id} in {states}")


async def _running(host: SimHost, engine: AsyncEngine, task_id: str) -> Any:
    await _state_is(engine, task_id, "assigned")
    c = await host.claim()
    assert c is not None and c.task_id == task_id
    status = await host.ack(c)
    assert status.state is TaskState.RUNNING
    return c


# --- the happy path ------------------------------------------------------------------------


async def test_a_task_goes_submit_assign_claim_ack_renew_done(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine, events: list[dict[str, Any]]
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    await _state_is(engine, task_id, "assigned")
    # The task's Lease actor is started on the loop right after the commit
    # that assigned it, so it may come an instant after the row says so.
    await wait_until(lambda: cp.lease_actor(task_id) is not None, what="the task's Lease actor")

    claimed = await host.claim()
    assert claimed is not None
    assert (claimed.task_id, claimed.attempt, claimed.device_id) == (task_id, 1, "h1-d0")
    assert (await host.ack(claimed)).state is TaskState.RUNNING
    renewed = await host.renew(claimed)
    assert renewed.state is TaskState.RUNNING and not renewed.cancel_requested
    progress = await cp.progress(host.s, task_id, 1, claimed.lease_token, 5)
    assert progress.state is TaskState.RUNNING

    record = await host.report(claimed, Outcome.DONE)
    assert record.state is TaskState.DONE and not record.replayed
    assert await task_state(engine, task_id) == "done"
    await wait_until(lambda: cp.lease_actor(task_id) is None, what="the Lease actor to stop")
    await wait_until(lambda: [e["state"] for e in events if e["task_id"] == task_id][-1] == "done")
    states = [e["state"] for e in events if e["task_id"] == task_id]
    assert states == ["queued", "assigned", "dispatched", "running", "done"]
    assert all(e["attempt"] == 1 for e in events[1:] if e["task_id"] == task_id)


async def test_a_deadline_the_reaper_wakes_for_anyway_is_not_hinted_a_nearer_one_is(
    cp: ControlPlane,
) -> None:
    """Each claim and ack hinted its deadline to the Reaper, waking its thread to
    find its timer already earlier: now a hint is sent only for a deadline
    before the Reaper's next wake-up (that run reads every deadline again)."""
    sup = cp.supervisor
    await wait_until(lambda: sup.reaper_next_at is not None, what="the Reaper's first timer")
    next_at = sup.reaper_next_at
    assert next_at is not None
    before = cp.stats.get("reaper_hints")
    sup.hint_deadline(next_at + timedelta(hours=1))
    sup.hint_deadline(next_at)
    sup.hint_deadline(next_at - timedelta(milliseconds=1))
    # Once the Reaper answered an ask sent after them, it handled every hint sent.
    reaper = sup.reaper
    assert reaper is not None
    await asyncio.to_thread(reaper.ask, "after the hints", timeout=10)
    assert cp.stats.get("reaper_hints") == before + 1


async def test_a_replayed_ack_or_result_emits_no_second_event(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine, events: list[dict[str, Any]]
) -> None:
    """The event loop emits a claim's, an ack's and a result's event after the
    commit; a replay (the host retried, its first answer lost) moved nothing and
    emits nothing."""
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    claimed = await _running(host, engine, task_id)
    again = await host.ack(claimed)
    assert again.state is TaskState.RUNNING
    record = await host.report(claimed, Outcome.DONE)
    replayed = await host.report(claimed, Outcome.DONE)
    assert not record.replayed and replayed.replayed
    await wait_until(lambda: cp.lease_actor(task_id) is None, what="the Lease actor to stop")
    # A marker through the same path: every event of the task before it is in.
    other = await cp.submit(spec())
    await wait_until(lambda: any(e["task_id"] == other for e in events), what="the marker")
    mine = [e for e in events if e["task_id"] == task_id]
    assert [e["state"] for e in mine] == ["queued", "assigned", "dispatched", "running", "done"]
    assert all(e["host_id"] == "h1" for e in mine[2:])


async def test_a_waiting_claim_is_woken_by_a_new_assignment(
    cp: ControlPlane, repo: Repository
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    waiting = asyncio.create_task(host.claim(wait_s=60))
    await wait_until(lambda: "h1" in cp.longpoll._waiters, what="the claim to wait")
    assert not waiting.done()
    task_id = await cp.submit(spec())
    claimed = await asyncio.wait_for(waiting, 30)
    assert claimed is not None and claimed.task_id == task_id
    assert cp.host_wakeups >= 1


async def _written_by_the_assigning_transaction(engine: AsyncEngine, task_id: str) -> bool:
    """Whether the task's current attempt row was last written by the
    transaction that reserved its device (the assignment's)."""
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                text(
                    "SELECT a.xmin::text = r.xmin::text AS same FROM attempts a"
                    " JOIN device_reservations r ON r.task_id = a.task_id"
                    " WHERE a.task_id = :t ORDER BY a.number DESC LIMIT 1"
                ),
                {"t": task_id},
            )
        ).first()
    assert row is not None, "no reserved attempt"
    return bool(row.same)


async def test_a_claim_parked_for_a_device_is_answered_by_the_assigning_transaction(
    cp: ControlPlane, engine: AsyncEngine, events: list[dict[str, Any]]
) -> None:
    host = await SimHost.create(cp, cp.repo, "h1")
    waiting = asyncio.create_task(host.claim(wait_s=60, device_ids=host.devices))
    await _parked(cp, "h1")
    task_id = await cp.submit(spec())
    claimed = await asyncio.wait_for(waiting, 30)
    assert claimed is not None and claimed.task_id == task_id
    # The claim (dispatched, lease token hash, ack deadline) was written by the
    # transaction that assigned, not by one of its own after the assignment.
    assert await _state_is_now(engine, task_id) == "dispatched"
    assert await _written_by_the_assigning_transaction(engine, task_id)
    assert cp.stats.get("claims_at_assign") == 1
    mine = [e["state"] for e in events if e["task_id"] == task_id and e["state"] != "queued"]
    assert mine[:2] == ["assigned", "dispatched"]
    # Its Lease actor knows: the ack, the result go through as usual.
    assert (await host.ack(claimed)).state is TaskState.RUNNING
    await host.report(claimed)
    await _state_is(engine, task_id, "done")


async def _state_is_now(engine: AsyncEngine, task_id: str) -> str:
    return str(await task_state(engine, task_id))


async def test_a_parked_claim_for_several_devices_takes_one_of_the_assignments_made_together(
    cp: ControlPlane, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, cp.repo, "h1", n_devices=3)
    waiting = asyncio.create_task(host.claim(wait_s=60, device_ids=host.devices))
    await _parked(cp, "h1")
    ids = await cp.submit_many([spec(), spec(), spec()])
    claimed = await asyncio.wait_for(waiting, 30)
    assert claimed is not None and claimed.task_id in ids
    await wait_until(lambda: cp.stats.get("assigned") == 3, what="all three assigned")
    others = [t for t in ids if t != claimed.task_id]
    for t in others:
        await _state_is(engine, t, "assigned")
    # The host's next polls claim the other two as usual.
    got = {claimed.task_id}
    for _ in others:
        c = await host.claim(wait_s=30, device_ids=host.devices)
        assert c is not None
        got.add(c.task_id)
    assert got == set(ids)


async def test_tasks_assigned_together_are_claimed_for_by_as_many_parked_polls(
    cp: ControlPlane,
) -> None:
    host = await SimHost.create(cp, cp.repo, "h1", n_devices=4)
    polls = [
        asyncio.create_task(host.claim(wait_s=60, device_ids=host.devices[:2])),
        asyncio.create_task(host.claim(wait_s=60, device_ids=host.devices[2:])),
    ]
    await _parked(cp, "h1", 2)
    ids = await cp.submit_many([spec(), spec()])
    got = await asyncio.wait_for(asyncio.gather(*polls), 30)
    # Each poll was answered by the assigning transaction: the two tasks went
    # to devices of different polls, not to the first two free devices.
    assert {c.task_id for c in got if c is not None} == set(ids)
    assert cp.stats.get("claims_at_assign") == 2


async def test_a_parked_claim_of_a_superseded_session_is_not_claimed_for_at_assignment(
    cp: ControlPlane, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, cp.repo, "h1")
    waiting = asyncio.create_task(cp.claim(host.s, wait_s=60, device_ids=host.devices))
    await _parked(cp, "h1")
    host.session = await cp.register("h1", host.credential)
    task_id = await cp.submit(spec())
    # The assigning transaction refuses the old session's claim, as a claim of
    # its own would; the old poll is then handed the assignment and refused too.
    with pytest.raises(Unauthorized):
        await asyncio.wait_for(waiting, 30)
    assert cp.stats.get("claims_at_assign") == 0
    await _state_is(engine, task_id, "assigned")
    claimed = await host.claim(wait_s=30, device_ids=host.devices)
    assert claimed is not None and claimed.task_id == task_id


class _PausingRepository(Repository):
    """The real repository; while ``gate`` is set, an assignment pass that
    claims for parked polls stops after writing its claims, before its commit,
    until the gate opens."""

    gate: asyncio.Event | None = None
    paused: asyncio.Event | None = None

    async def _claim_assigned(self, *args: Any, **kw: Any) -> Any:
        out = await super()._claim_assigned(*args, **kw)
        if out and self.gate is not None and self.paused is not None:
            self.paused.set()
            await self.gate.wait()
        return out


async def test_a_poll_cancelled_while_its_claim_commits_leaves_a_lease_that_expires_and_retries(
    engine: AsyncEngine, clock: ManualClock
) -> None:
    repo = await _repository(engine, clock, _PausingRepository)
    repo.gate, repo.paused = asyncio.Event(), asyncio.Event()
    cp = ControlPlane(repo, scheduler_interval_s=0.5)
    await cp.start()
    try:
        host = await SimHost.create(cp, repo, "h1")
        poll = asyncio.create_task(host.claim(wait_s=60, device_ids=host.devices))
        await _parked(cp, "h1")
        task_id = await cp.submit(spec(retry=RetryPolicy(max_attempts=3, backoff_base_s=0)))
        await asyncio.wait_for(repo.paused.wait(), 30)
        # The host's request goes away (its connection closed) while the claim
        # made for it commits: nobody holds that lease.
        poll.cancel()
        with pytest.raises(asyncio.CancelledError):
            await poll
        repo.gate.set()
        await _state_is(engine, task_id, "dispatched")
        # It is never acknowledged: at its ack deadline the task runs again.
        clock.advance(TIMINGS.ack_s + 1)
        cp.poke_reaper()
        await _state_is(engine, task_id, "queued", "retrying")
        # The host may still run something there: the device is out of use
        # until the host reports it idle again.
        await host.heartbeat()
        claimed = await host.claim(wait_s=30, device_ids=host.devices)
        assert claimed is not None and (claimed.task_id, claimed.attempt) == (task_id, 2)
        reasons = [a["end_reason"] for a in await attempt_rows(engine) if a["task_id"] == task_id]
        assert reasons[0] == "ack_expired"
    finally:
        repo.gate.set()
        await cp.stop()


class _CountingRepository(Repository):
    """The real repository, counting the long-polls' reads of pending assignments."""

    pending_reads = 0

    async def session_pending(self, session: Session, **kw: Any) -> list[Any]:
        try:
            return await super().session_pending(session, **kw)
        finally:
            self.pending_reads += 1

    async def sessions_pending(self, reads: Any) -> list[Any]:
        try:
            return await super().sessions_pending(reads)
        finally:
            self.pending_reads += len(reads)


@pytest.fixture
async def counting(engine: AsyncEngine, clock: ManualClock) -> AsyncIterator[ControlPlane]:
    r = await _repository(engine, clock, _CountingRepository)
    plane = ControlPlane(r, scheduler_interval_s=0.5)
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop()


def _reads(cp: ControlPlane) -> int:
    assert isinstance(cp.repo, _CountingRepository)
    return cp.repo.pending_reads


async def test_a_woken_claim_claims_its_assignment_without_reading_the_pending_ones(
    counting: ControlPlane,
) -> None:
    cp = counting
    host = await SimHost.create(cp, cp.repo, "h1", n_devices=2)
    polls = {asyncio.create_task(host.claim(wait_s=60, device_ids=[d])) for d in host.devices}
    # Each looked once (nothing pending) and is parked.
    await wait_until(lambda: _reads(cp) == 2, what="both claims to look")
    got = []
    for _ in range(2):
        got.append(await cp.submit(spec()))
        done, polls = await asyncio.wait(polls, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        claimed = done.pop().result()
        assert claimed is not None and claimed.task_id == got[-1]
    assert _reads(cp) == 2


async def test_a_woken_claim_of_a_superseded_session_is_unauthorized(
    counting: ControlPlane, engine: AsyncEngine
) -> None:
    cp = counting
    host = await SimHost.create(cp, cp.repo, "h1")
    waiting = asyncio.create_task(cp.claim(host.s, wait_s=60))
    await wait_until(lambda: _reads(cp) == 1, what="the claim to look")
    host.session = await cp.register("h1", host.credential)
    task_id = await cp.submit(spec())
    # The claim's own transaction refuses the old session, as the read would.
    with pytest.raises(Unauthorized):
        await asyncio.wait_for(waiting, 30)
    assert _reads(cp) == 1
    await _state_is(engine, task_id, "assigned")
    claimed = await host.claim()
    assert claimed is not None and claimed.task_id == task_id


async def test_an_assignment_made_while_no_poll_waits_is_claimed_by_the_next_poll_without_a_read(
    counting: ControlPlane, engine: AsyncEngine
) -> None:
    cp = counting
    host = await SimHost.create(cp, cp.repo, "h1")
    assert await host.claim(wait_s=0.01, device_ids=host.devices) is None
    assert _reads(cp) == 1
    task_id = await cp.submit(spec())
    await _state_is(engine, task_id, "assigned")
    # No poll was parked: the Scheduler's hand-off kept it for the next one.
    claimed = await host.claim(wait_s=30, device_ids=host.devices)
    assert claimed is not None and claimed.task_id == task_id
    assert _reads(cp) == 1


async def test_an_empty_read_is_trusted_briefly_and_forgotten_when_the_host_is_woken(
    counting: ControlPlane,
) -> None:
    cp = counting
    host = await SimHost.create(cp, cp.repo, "h1")
    assert await host.claim(wait_s=0.01, device_ids=host.devices) is None
    assert await host.claim(wait_s=0.01, device_ids=host.devices) is None
    assert _reads(cp) == 1  # the second poll trusted the first one's empty read
    # Without naming its devices a poll always reads.
    assert await host.claim(wait_s=0.01) is None
    assert _reads(cp) == 2
    # Another process assigned work to the host (or the Scheduler rebuilt):
    # what was known is forgotten, the next poll reads.
    cp.wake_hosts(["h1"])
    assert await host.claim(wait_s=0.01, device_ids=host.devices) is None
    assert _reads(cp) == 3
    # A new session does not inherit what was known of the old one.
    host.session = await cp.register("h1", host.credential)
    assert await host.claim(wait_s=0.01, device_ids=host.devices) is None
    assert _reads(cp) == 4


async def test_many_assignments_at_once_are_not_passed_from_poll_to_poll(
    counting: ControlPlane, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host given many assignments at once: each parked poll holds a couple,
    the rest wait for the host's next polls, and each is handed about once.
    (Spread over the parked polls, each claim would hand back all the others
    it held: quadratic in the number of assignments.)"""
    cp = counting
    n = 40
    host = await SimHost.create(cp, cp.repo, "h1", n_devices=n)
    polls = [asyncio.create_task(host.claim(wait_s=60)) for _ in range(2)]
    await wait_until(
        lambda: _reads(cp) == 2 and len(cp.longpoll._waiters.get("h1", {})) == 2,
        what="both polls to park",
    )
    hands = 0
    hand = cp.longpoll._hand

    def counting_hand(a: Any) -> None:
        nonlocal hands
        hands += 1
        hand(a)

    monkeypatch.setattr(cp.longpoll, "_hand", counting_hand)
    ids = set(await cp.submit_many([spec() for _ in range(n)]))

    async def all_assigned() -> bool:
        return all([await task_state(engine, t) in ("assigned", "dispatched") for t in ids])

    await wait_until(all_assigned, what="every task assigned")
    claimed = {c.task_id for c in await asyncio.gather(*polls) if c is not None}
    assert len(claimed) == 2
    while len(claimed) < n:
        c = await host.claim(wait_s=30)
        assert c is not None and c.task_id not in claimed
        claimed.add(c.task_id)
    assert claimed == ids
    assert _reads(cp) == 2  # every one came through the hand-off
    assert hands <= 2 * n
    assert not cp.longpoll._unhanded.get("h1")


async def test_an_assignment_this_process_never_handed_is_found_once_the_empty_read_expires(
    engine: AsyncEngine, clock: ManualClock
) -> None:
    repo = await _repository(engine, clock, _CountingRepository)
    # No Scheduler pass on its own: the assignment below is made behind its back,
    # as when a Scheduler crashed between its commit and the hand-off.
    cp = ControlPlane(repo, scheduler_interval_s=3600)
    await cp.start()
    try:
        host = await SimHost.create(cp, repo, "h1")
        assert await host.claim(wait_s=0.01, device_ids=host.devices) is None
        assert repo.pending_reads == 1
        waiting = asyncio.create_task(host.claim(wait_s=60, device_ids=host.devices))
        await wait_until(lambda: "h1" in cp.longpoll._waiters, what="the claim to park")
        assert repo.pending_reads == 1  # parked on the empty read, for a while
        task_id = await repo.submit(spec())
        assert [a.task_id for a in await repo.assign()] == [task_id]
        claimed = await asyncio.wait_for(waiting, 30)
        assert claimed is not None and claimed.task_id == task_id
        assert repo.pending_reads == 2
    finally:
        await cp.stop()


async def test_a_claim_with_nothing_to_do_returns_none_when_its_wait_ends(
    cp: ControlPlane, repo: Repository
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    assert await host.claim(wait_s=0.05) is None
    assert "h1" not in cp.longpoll._waiters


async def test_a_claim_only_takes_assignments_on_the_devices_it_names(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, repo, "h1", n_devices=2)
    a = await cp.submit(spec())
    await _state_is(engine, a, "assigned")
    device = (await repo.pending_assignments("h1"))[0].device_id
    other = next(d for d in host.devices if d != device)
    assert await host.claim(device_ids=[other]) is None
    claimed = await host.claim(device_ids=[device])
    assert claimed is not None and claimed.task_id == a


async def test_a_burst_of_submits_is_coalesced_into_a_few_assign_calls(repo: Repository) -> None:
    cp = ControlPlane(repo, scheduler_interval_s=3600)
    gate = threading.Event()
    await cp.start()
    try:
        await wait_until(lambda: cp.metrics.get("assign_calls", 0) >= 1, what="the first pass")
        # Park the Scheduler inside a pass, then submit 1000 tasks one by one.
        failpoints.arm(failpoints.SCHEDULER_BEFORE_ASSIGN, pause=gate)
        cp.wake_scheduler()
        await wait_until(lambda: failpoints.paused(failpoints.SCHEDULER_BEFORE_ASSIGN) == 1)
        before = cp.metrics["assign_calls"]
        await asyncio.gather(*(cp.submit(spec()) for _ in range(1000)))
        failpoints.disarm(failpoints.SCHEDULER_BEFORE_ASSIGN)  # releases the pass
        await wait_until(lambda: cp.metrics["assign_calls"] >= before + 1)
        await wait_until(lambda: not cp.supervisor._wake_pending, what="the wake-ups drained")
        # The parked pass, plus one for everything that arrived meanwhile.
        assert cp.metrics["assign_calls"] - before <= 3
    finally:
        gate.set()
        await cp.stop()


async def test_a_backlog_is_assigned_in_growing_passes(repo: Repository) -> None:
    # Each pass reads the free devices once; with a backlog the passes grow
    # (64, 128, 256, ...), so 500 tasks take 4 passes rather than 8.
    cp = ControlPlane(repo, scheduler_interval_s=3600, assign_batch=64)
    gate = threading.Event()
    await cp.start()
    try:
        await SimHost.create(cp, repo, "h1", n_devices=500)
        await wait_until(lambda: cp.metrics.get("assign_calls", 0) >= 1, what="the first pass")
        failpoints.arm(failpoints.SCHEDULER_BEFORE_ASSIGN, pause=gate)
        cp.wake_scheduler()
        await wait_until(lambda: failpoints.paused(failpoints.SCHEDULER_BEFORE_ASSIGN) == 1)
        before = cp.metrics["assign_calls"]
        await cp.submit_many([spec() for _ in range(500)])
        failpoints.disarm(failpoints.SCHEDULER_BEFORE_ASSIGN)  # releases the pass
        await wait_until(lambda: cp.metrics.get("assigned", 0) >= 500, what="all assigned")
        await wait_until(lambda: not cp.supervisor._wake_pending, what="the wake-ups drained")
        assert cp.metrics["assign_calls"] - before <= 5
        assert len(await repo.pending_assignments("h1")) == 500
    finally:
        gate.set()
        await cp.stop()


async def test_a_lease_actor_that_gets_no_thread_refuses_at_once_and_is_replaced(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lease actors start their threads in the background (or take an idle one):
    # one that cannot start answers a retryable error (not a timeout), and the
    # next try starts anew.
    host = await SimHost.create(cp, repo, "h1")

    def no_thread(actor_loop: Any) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(LEASE_THREADS, "run", lambda actor_loop: False)  # none idle
        patched.setattr(LEASE_THREADS, "start", no_thread)
        task_id = await cp.submit(spec())
        await _state_is(engine, task_id, "assigned")
        with pytest.raises(Unavailable):
            await host.claim()

    claimed = await host.claim()
    assert claimed is not None and claimed.task_id == task_id


# --- expiry -------------------------------------------------------------------------------


async def test_an_unclaimed_assignment_expires_retries_and_fails_at_the_attempt_limit(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine, clock: ManualClock
) -> None:
    await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec(retry=RetryPolicy(max_attempts=2, backoff_base_s=0)))
    await _state_is(engine, task_id, "assigned")

    clock.advance(31)
    cp.poke_reaper()

    async def second_attempt() -> bool:
        row = (await task_rows(engine))[task_id]
        return row["status"] == "assigned" and row["attempt"] == 2

    await wait_until(second_attempt, what="attempt 2 assigned")
    await wait_until(lambda: _lease_attempt(cp, task_id) == 2, what="the attempt-2 Lease actor")

    clock.advance(31)
    cp.poke_reaper()
    await _state_is(engine, task_id, "failed")
    await wait_until(lambda: cp.lease_actor(task_id) is None, what="the Lease actor to stop")
    reasons = [a["end_reason"] for a in await attempt_rows(engine) if a["task_id"] == task_id]
    assert reasons == ["claim_expired", "claim_expired"]


def _lease_attempt(cp: ControlPlane, task_id: str) -> int | None:
    entry = cp.supervisor._leases.get(task_id)
    return entry.assignment.attempt if entry is not None else None


async def test_an_expired_lease_goes_to_retrying_and_its_renewal_is_refused(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine, clock: ManualClock
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec(retry=RetryPolicy(max_attempts=3, backoff_base_s=10)))
    claimed = await _running(host, engine, task_id)

    clock.advance(31)
    cp.poke_reaper()
    await _state_is(engine, task_id, "retrying")
    with pytest.raises((Conflict, Gone)):
        await host.renew(claimed)
    await host.heartbeat()  # its device, busy since the expiry, is idle again

    clock.advance(11)
    cp.poke_reaper()  # the retry became eligible; the reaper wakes the Scheduler

    async def reassigned() -> bool:
        row = (await task_rows(engine))[task_id]
        return row["status"] == "assigned" and row["attempt"] == 2

    await wait_until(reassigned, what="attempt 2 assigned")
    again = await host.claim()
    assert again is not None and again.attempt == 2
    await host.ack(again)
    assert (await host.report(again)).state is TaskState.DONE


async def test_expiry_with_a_pending_cancel_ends_cancelled(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine, clock: ManualClock
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    claimed = await _running(host, engine, task_id)
    record = await cp.cancel(task_id, ADMIN)
    assert record.state is TaskState.RUNNING and not record.completed
    clock.advance(31)
    cp.poke_reaper()
    await _state_is(engine, task_id, "cancelled")
    with pytest.raises((Conflict, Gone)):
        await host.renew(claimed)


# --- cancel ------------------------------------------------------------------------------------


async def test_a_cancel_in_flight_surfaces_on_renew_and_the_host_reports_cancelled(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    claimed = await _running(host, engine, task_id)
    record = await cp.cancel(task_id, ADMIN)
    assert not record.completed
    assert (await host.renew(claimed)).cancel_requested
    assert (await cp.cancel_poll(host.s, task_id, 1, claimed.lease_token)).cancel_requested
    result = await host.report(claimed, Outcome.CANCELLED)
    assert result.state is TaskState.CANCELLED
    assert await task_state(engine, task_id) == "cancelled"


async def test_renewals_go_around_a_busy_lease_actor_and_are_still_fenced(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    """A renewal is written through by the renewal group commit, not by the
    task's Lease actor: it completes while the actor is parked mid-message."""
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    claimed = await _running(host, engine, task_id)
    gate = threading.Event()
    failpoints.arm(failpoints.LEASE_BEFORE_COMMIT, pause=gate, count=1)
    try:
        parked = asyncio.create_task(host.progress(claimed, 1))
        await wait_until(lambda: failpoints.paused(failpoints.LEASE_BEFORE_COMMIT) == 1)

        renewed = await asyncio.wait_for(host.renew(claimed), 30)
        assert renewed.state is TaskState.RUNNING and renewed.attempt == 1
        with pytest.raises(Conflict):
            await cp.renew(host.s, task_id, 1, "wrong-token")
        assert not parked.done()
    finally:
        gate.set()
    assert (await parked).state is TaskState.RUNNING


async def _write_waits_for_a_lock(engine: AsyncEngine) -> bool:
    async with engine.connect() as c:
        n = (
            await c.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            )
        ).scalar_one()
    return n > 0


async def _lock_task_row(conn: Any, task_id: str) -> None:
    """Lock the task's row in ``conn``'s transaction: its next write waits."""
    await conn.execute(
        text("SELECT 1 FROM tasks WHERE id = CAST(:id AS uuid) FOR UPDATE"), {"id": task_id}
    )


async def test_a_lease_actor_serves_its_next_message_while_its_handed_off_commit_waits(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    """A result is handed to the event loop: the Lease actor does not wait for
    its commit (here held up by a row lock) and answers another message."""
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    claimed = await _running(host, engine, task_id)
    lease = cp.lease_actor(task_id)
    assert lease is not None
    async with engine.connect() as blocker:
        await _lock_task_row(blocker, task_id)
        report = asyncio.create_task(host.report(claimed))
        await wait_until(lambda: _write_waits_for_a_lock(engine), what="the result's write waits")
        # Not a Message: answered None at once by an actor that is not busy.
        assert await asyncio.to_thread(lease.ask, "are you free?", timeout=10) is None
        assert not report.done()
        await blocker.rollback()
    assert (await report).state is TaskState.DONE
    await wait_until(lambda: cp.lease_actor(task_id) is None, what="the Lease actor to stop")


async def test_a_lease_actor_started_while_a_result_commits_learns_of_it_and_stops(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    """``Committed`` goes to the task's current Lease actor: a replacement that
    rebuilt itself (task still running) before the result committed stops."""
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    claimed = await _running(host, engine, task_id)
    old = cp.lease_actor(task_id)
    assert old is not None
    async with engine.connect() as blocker:
        await _lock_task_row(blocker, task_id)
        report = asyncio.create_task(host.report(claimed))
        await wait_until(lambda: _write_waits_for_a_lock(engine), what="the result's write waits")
        old.tell(Crash())
        await wait_until(lambda: cp.lease_actor(task_id) not in (None, old), what="a replacement")
        new = cp.lease_actor(task_id)
        assert new is not None
        # Its first message was Rebuild: this ask is answered after it.
        assert await asyncio.to_thread(new.ask, "rebuilt?", timeout=10) is None
        assert cp.lease_actor(task_id) is new
        await blocker.rollback()
    assert (await report).state is TaskState.DONE
    await wait_until(lambda: cp.lease_actor(task_id) is None, what="the replacement to stop")


async def test_a_cancel_of_a_queued_task_is_immediate(
    cp: ControlPlane, engine: AsyncEngine
) -> None:
    task_id = await cp.submit(spec())  # no host: stays queued
    record = await cp.cancel(task_id, ADMIN)
    assert record.state is TaskState.CANCELLED
    assert await task_state(engine, task_id) == "cancelled"


# --- results -----------------------------------------------------------------------------------


async def test_a_lost_result_reply_returns_the_recorded_outcome_on_retry(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    claimed = await _running(host, engine, task_id)
    failpoints.arm(failpoints.LEASE_AFTER_COMMIT_BEFORE_REPLY, count=1)
    with pytest.raises(Unavailable):
        await host.report(claimed, Outcome.FAILED, reason="boom")
    assert await task_state(engine, task_id) == "failed"
    again = await host.report(claimed, Outcome.FAILED, reason="boom")
    assert again.replayed and again.state is TaskState.FAILED
    assert cp.metrics.get("restarts.lease", 0) == 1


async def test_a_retryable_failure_goes_back_to_the_queue_and_runs_again(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec(retry=RetryPolicy(max_attempts=2, backoff_base_s=0)))
    first = await _running(host, engine, task_id)
    rec = await host.report(first, Outcome.FAILED, retryable=True, reason="flaky")
    assert rec.state in (TaskState.RETRYING, TaskState.QUEUED)

    async def second() -> bool:
        row = (await task_rows(engine))[task_id]
        return row["attempt"] == 2 and row["status"] == "assigned"

    await wait_until(second, what="attempt 2")
    again = await host.claim()
    assert again is not None and again.attempt == 2
    await host.ack(again)
    assert (await host.report(again)).state is TaskState.DONE


async def test_a_stale_attempts_report_does_not_change_the_newer_attempt(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine, clock: ManualClock
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec(retry=RetryPolicy(max_attempts=3, backoff_base_s=0)))
    old = await _running(host, engine, task_id)
    clock.advance(31)
    cp.poke_reaper()
    await _state_is(engine, task_id, "queued", "assigned")
    await host.heartbeat()  # its device, busy since the expiry, is idle again

    async def second() -> bool:
        row = (await task_rows(engine))[task_id]
        return row["attempt"] == 2 and row["status"] == "assigned"

    await wait_until(second, what="attempt 2")
    new = await host.claim()
    assert new is not None and new.attempt == 2
    with pytest.raises((Conflict, Gone)):
        await host.report(old, Outcome.DONE)
    row = (await task_rows(engine))[task_id]
    assert (row["status"], row["attempt"]) == ("dispatched", 2)
    await host.ack(new)
    assert (await host.report(new)).state is TaskState.DONE


# --- reconnect and reconcile ----------------------------------------------------------------


async def test_a_reconnected_host_that_reconciles_its_attempt_keeps_it(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    claimed = await _running(host, engine, task_id)
    host.session = await cp.register("h1", host.credential)
    report = await cp.reconcile(
        host.s,
        [JournalEntry(task_id=task_id, attempt=1, lease_token=claimed.lease_token)],
    )
    assert [v.verdict for v in report.verdicts] == ["confirmed"] and not report.lost
    assert (await host.renew(claimed)).state is TaskState.RUNNING
    assert (await host.report(claimed)).state is TaskState.DONE


async def test_an_attempt_a_reconnected_host_no_longer_holds_is_ended_and_retried(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine, events: list[dict[str, Any]]
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec(retry=RetryPolicy(max_attempts=3, backoff_base_s=0)))
    await _running(host, engine, task_id)
    host.session = await cp.register("h1", host.credential)
    report = await cp.reconcile(host.s, [])
    assert [(e.task_id, e.attempt) for e in report.lost] == [(task_id, 1)]
    assert [e["state"] for e in events if e["task_id"] == task_id][-1] in (
        "queued",
        "retrying",
    )

    async def second() -> bool:
        row = (await task_rows(engine))[task_id]
        return row["attempt"] == 2 and row["status"] == "assigned"

    await wait_until(second, what="attempt 2 assigned")
    await wait_until(lambda: _lease_attempt(cp, task_id) == 2, what="the attempt-2 Lease actor")
    again = await host.claim()
    assert again is not None and again.attempt == 2


# --- bad input -----------------------------------------------------------------------------------


async def test_bad_input_gets_typed_errors_and_never_crashes_an_actor(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    claimed = await _running(host, engine, task_id)
    lease = cp.lease_actor(task_id)
    scheduler, reaper = cp.supervisor.scheduler, cp.supervisor.reaper
    with pytest.raises(NotFound):
        await cp.renew(host.s, UNKNOWN_TASK, 1, "token")
    with pytest.raises(Invalid):
        await cp.renew(host.s, "not-a-uuid", 1, "token")
    with pytest.raises(Invalid):
        await cp.renew(host.s, task_id, "1", "token")  # type: ignore[arg-type]
    with pytest.raises(Invalid):
        await cp.progress(host.s, task_id, 1, claimed.lease_token, -1)
    with pytest.raises(Invalid):
        await cp.report_result(
            host.s, task_id, 1, claimed.lease_token, outcome="exploded", fingerprint="f"
        )
    with pytest.raises(Invalid):
        await cp.claim(host.s, wait_s=-1)
    with pytest.raises((Conflict, Unauthorized, Gone)):
        await cp.renew(host.s, task_id, 1, "wrong-token")
    with pytest.raises((Conflict, Gone)):
        await cp.renew(host.s, task_id, 7, claimed.lease_token)
    with pytest.raises(Unauthorized):
        await cp.renew(Session(host_id="h1", generation=99), task_id, 1, claimed.lease_token)
    # Raw garbage straight into the actors' inboxes.
    for ref in (lease, scheduler, reaper):
        assert ref is not None
        ref.tell("garbage")
        ref.tell({"t": "renew"})
    assert cp.lease_actor(task_id) is lease
    assert lease is not None and lease.is_alive()
    assert cp.supervisor.scheduler is scheduler and cp.supervisor.reaper is reaper
    assert (await host.renew(claimed)).state is TaskState.RUNNING
    assert cp.metrics.get("restarts.lease", 0) == 0


# --- supervision ----------------------------------------------------------------------------------


async def test_a_crashed_scheduler_is_replaced_and_assignment_continues(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    old = cp.supervisor.scheduler
    assert old is not None
    old.tell(Crash())
    await wait_until(lambda: cp.supervisor.scheduler is not old, what="a new Scheduler")
    assert not old.is_alive()
    task_id = await cp.submit(spec())
    await _running(host, engine, task_id)
    assert cp.metrics["restarts.scheduler"] == 1


async def test_a_scheduler_crash_between_assign_commit_and_lease_start_loses_nothing(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, repo, "h1", n_devices=3)
    failpoints.arm(failpoints.SCHEDULER_AFTER_ASSIGN_COMMIT, count=1)
    ids = await cp.submit_many([spec() for _ in range(3)])
    await wait_until(lambda: cp.metrics.get("restarts.scheduler", 0) == 1, what="the crash")
    for t in ids:
        await _state_is(engine, t, "assigned")
    # The replacement rebuilt a Lease actor for every committed assignment.
    await wait_until(lambda: all(cp.lease_actor(t) is not None for t in ids))
    got = []
    for _ in ids:
        c = await host.claim(wait_s=10)
        assert c is not None
        got.append(c.task_id)
        await host.ack(c)
        await host.report(c)
    assert sorted(got) == sorted(ids)


async def test_a_crashed_reaper_is_replaced_and_expiry_continues(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine, clock: ManualClock
) -> None:
    await SimHost.create(cp, repo, "h1")
    old = cp.supervisor.reaper
    assert old is not None
    old.tell(Crash())
    await wait_until(lambda: cp.supervisor.reaper is not old, what="a new Reaper")
    task_id = await cp.submit(spec(retry=RetryPolicy(max_attempts=1)))
    await _state_is(engine, task_id, "assigned")
    clock.advance(31)
    assert cp.poke_reaper()
    await _state_is(engine, task_id, "failed")


async def test_a_reaper_crash_after_its_commit_still_ends_the_lease_actors(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine, clock: ManualClock
) -> None:
    await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec(retry=RetryPolicy(max_attempts=1)))
    await _state_is(engine, task_id, "assigned")
    await wait_until(lambda: cp.lease_actor(task_id) is not None)
    failpoints.arm(failpoints.REAPER_AFTER_EXPIRE_COMMIT, count=1)
    clock.advance(31)
    cp.poke_reaper()
    await wait_until(lambda: cp.metrics.get("restarts.reaper", 0) == 1, what="the crash")
    await _state_is(engine, task_id, "failed")
    await wait_until(lambda: cp.lease_actor(task_id) is None, what="the stale Lease actor ended")


async def test_a_crashed_lease_actor_is_rebuilt_from_the_database(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    claimed = await _running(host, engine, task_id)
    old = cp.lease_actor(task_id)
    assert old is not None
    old.tell(Crash())
    await wait_until(lambda: cp.lease_actor(task_id) not in (None, old), what="a new Lease actor")
    assert (await retrying(lambda: host.renew(claimed))).state is TaskState.RUNNING
    assert (await host.report(claimed)).state is TaskState.DONE
    assert cp.metrics["restarts.lease"] == 1


async def test_a_lease_actor_crash_before_commit_changes_nothing_and_the_retry_succeeds(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    claimed = await _running(host, engine, task_id)
    failpoints.arm(failpoints.LEASE_BEFORE_COMMIT, count=1)
    with pytest.raises(Unavailable):
        await host.report(claimed)
    assert await task_state(engine, task_id) == "running"
    record = await retrying(lambda: host.report(claimed))
    assert record.state is TaskState.DONE and not record.replayed


async def test_an_actor_stopped_from_outside_is_restarted(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    claimed = await _running(host, engine, task_id)
    old = cp.lease_actor(task_id)
    assert old is not None
    await asyncio.get_running_loop().run_in_executor(None, old.stop)
    await wait_until(lambda: cp.lease_actor(task_id) not in (None, old))
    assert (await host.renew(claimed)).state is TaskState.RUNNING


async def test_messages_queued_for_a_crashed_lease_actor_go_to_its_replacement(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    claimed = await _running(host, engine, task_id)
    gate = threading.Event()
    failpoints.arm(failpoints.LEASE_BEFORE_COMMIT, pause=gate, count=1)
    first = asyncio.create_task(host.progress(claimed, 1))
    await wait_until(lambda: failpoints.paused(failpoints.LEASE_BEFORE_COMMIT) == 1)
    lease = cp.lease_actor(task_id)
    assert lease is not None
    lease.tell(Crash())
    queued = asyncio.create_task(host.progress(claimed, 2))  # behind the crash in the inbox
    await wait_until(lambda: cp.metrics["inflight"] == 2, what="both reports sent")
    gate.set()
    assert (await first).state is TaskState.RUNNING
    # Never handled by the dead actor, so re-sent as is to the new one: no hang,
    # no error for the host.
    assert (await asyncio.wait_for(queued, 30)).state is TaskState.RUNNING
    assert cp.lease_actor(task_id) not in (None, lease)


async def test_a_message_to_a_dead_actor_is_a_retryable_error_not_a_hang(
    cp: ControlPlane, repo: Repository, engine: AsyncEngine
) -> None:
    host = await SimHost.create(cp, repo, "h1")
    task_id = await cp.submit(spec())
    claimed = await _running(host, engine, task_id)
    lease = cp.lease_actor(task_id)
    assert lease is not None
    await asyncio.get_running_loop().run_in_executor(None, lease.stop)
    reply_error: list[BaseException] = []
    try:
        await cp._ask(
            lease,
            lambda r: Renew(
                reply=r,
                session=host.s,
                task_id=task_id,
                attempt=1,
                lease_token=claimed.lease_token,
            ),
        )
    except Unavailable as exc:
        reply_error.append(exc)
    assert len(reply_error) == 1 and isinstance(reply_error[0], Unavailable)
    assert reply_error[0].retryable
    # Through the facade the message simply reaches the replacement.
    assert (await host.renew(claimed)).state is TaskState.RUNNING


async def test_a_restarted_control_plane_rebuilds_lease_actors_from_the_database(
    repo: Repository, engine: AsyncEngine
) -> None:
    first = ControlPlane(repo, scheduler_interval_s=0.5)
    await first.start()
    host = await SimHost.create(first, repo, "h1")
    task_id = await first.submit(spec())
    claimed = await _running(host, engine, task_id)
    await first.stop()
    pykka.ActorRegistry.stop_all()

    second = ControlPlane(repo, scheduler_interval_s=0.5)
    await second.start()
    try:
        assert second.lease_actor(task_id) is not None
        host.cp = second
        assert (await host.renew(claimed)).state is TaskState.RUNNING
        assert (await host.report(claimed)).state is TaskState.DONE
    finally:
        await second.stop()


async def test_stop_is_graceful_and_refuses_new_work(cp: ControlPlane, repo: Repository) -> None:
    host = await SimHost.create(cp, repo, "h1")
    waiting = asyncio.create_task(host.claim(wait_s=60))
    await wait_until(lambda: "h1" in cp.longpoll._waiters)
    await cp.stop()
    assert await asyncio.wait_for(waiting, 10) is None
    with pytest.raises(Unavailable):
        await cp.submit(spec())
    assert not [r for r in pykka.ActorRegistry.get_all() if r.is_alive()]


# --- the event loop under load -----------------------------------------------------------------


async def test_the_loop_stays_responsive_while_a_thousand_lease_asks_are_in_flight(
    repo: Repository, engine: AsyncEngine
) -> None:
    cp = ControlPlane(repo, scheduler_interval_s=0.5, assign_batch=256)
    await cp.start()
    try:
        hosts = [await SimHost.create(cp, repo, f"h{i}", n_devices=10) for i in range(10)]
        await cp.submit_many([spec() for _ in range(100)])
        await wait_until(lambda: cp.metrics["lease_actors"] == 100, timeout=60)

        async def take_all(host: SimHost) -> list[Any]:
            got = []
            while (c := await host.claim()) is not None:
                await host.ack(c)
                got.append((host, c))
            return got

        leases = [x for xs in await asyncio.gather(*(take_all(h) for h in hosts)) for x in xs]
        assert len(leases) == 100

        # 1000 asks: ten progress reports for each of the 100 Lease actors. The
        # first one of each is parked inside its actor (before its commit), the
        # other nine wait in that actor's inbox.
        gate = threading.Event()
        failpoints.arm(failpoints.LEASE_BEFORE_COMMIT, pause=gate)
        renewals = [
            asyncio.create_task(h.progress(c, i // len(leases) + 1))
            for i, (h, c) in enumerate(leases * 10)
        ]
        await wait_until(
            lambda: (
                failpoints.paused(failpoints.LEASE_BEFORE_COMMIT) == 100
                and cp.metrics["inflight"] == 1000
            ),
            timeout=60,
            what="1000 reports in flight",
        )
        # Heartbeats (real transactions) and small coroutines on the same loop
        # still complete while all of them are in flight.
        ticks = 0

        async def small() -> None:
            nonlocal ticks
            for _ in range(100):
                await asyncio.sleep(0)
                ticks += 1

        await asyncio.wait_for(
            asyncio.gather(*(h.heartbeat() for h in hosts), *(small() for _ in range(10))), 30
        )
        assert ticks == 1000
        assert not any(r.done() for r in renewals)
        assert cp.metrics["inflight"] == 1000
        gate.set()
        failpoints.disarm(failpoints.LEASE_BEFORE_COMMIT)
        done = await asyncio.wait_for(asyncio.gather(*renewals), 60)
        assert all(s.state is TaskState.RUNNING for s in done)
    finally:
        failpoints.disarm()  # releases anything still parked
        await cp.stop()


async def test_concurrent_heartbeats_and_long_poll_reads_share_statements(
    cp: ControlPlane,
) -> None:
    hosts = [await SimHost.create(cp, cp.repo, f"h{i}", n_devices=2) for i in range(8)]
    for h in hosts:
        await cp.heartbeat(h.s, [DeviceSnapshot(device_id=d) for d in h.devices], digest="v1")
    hb, reader = cp._hbatcher, cp.pending_reader
    assert hb is not None and reader is not None
    beats, reads = hb.batches, reader.batches
    await asyncio.gather(*(cp.heartbeat_unchanged(h.s, "v1") for h in hosts))
    assert await asyncio.gather(*(h.claim(device_ids=h.devices) for h in hosts)) == [None] * 8
    # Each got its answer; together they took fewer statements than requests.
    assert hb.items >= 8 and 1 <= hb.batches - beats < 8
    assert reader.items >= 8 and 1 <= reader.batches - reads < 8
    with pytest.raises(Conflict):
        await cp.heartbeat_unchanged(hosts[0].s, "v2")
