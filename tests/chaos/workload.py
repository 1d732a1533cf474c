"""The chaos workload: simulated hosts running hundreds of tasks through the
ControlPlane while actors are killed at random points, and the checks made on
the database afterwards. Used by tests/chaos/test_actor_chaos.py (normal suite,
fixed seed) and its soak variant."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.actors import failpoints
from fleetlease.actors.messages import Crash
from fleetlease.actors.runtime import ControlPlane
from fleetlease.ops.testing.invariants import (
    TERMINAL,
    Acknowledged,
    Observer,
    check,
    install_reservation_audit,
)
from fleetlease.persistence import tables
from fleetlease.persistence.clock import ManualClock
from fleetlease.persistence.errors import Conflict, Forbidden, Gone, NotFound, Unavailable
from fleetlease.persistence.model import (
    Claimed,
    DeviceSnapshot,
    Outcome,
    ResultRecord,
    RetryPolicy,
    Session,
    TaskKind,
    TaskSpec,
    User,
)
from fleetlease.persistence.repository import Repository
from tests.chaos.harness import fingerprint

ADMIN = User(name="admin", platform_admin=True)
ABANDON = (Conflict, Gone, Forbidden, NotFound)


@dataclass(kw_only=True)
class ChaosConfig:
    seed: int = 20261202
    tasks: int = 300
    hosts: int = 5
    devices_per_host: int = 4
    max_attempts: int = 8
    renewals_per_task: int = 2
    cancel_fraction: float = 0.05
    # fail point probabilities
    lease_before_commit: float = 0.02
    lease_after_commit: float = 0.03
    scheduler_after_assign: float = 0.05
    reaper_after_expire: float = 0.3
    # direct kills (Crash messages), per killer step
    kill_every_s: float = 0.03
    clock_step_s: float = 1.0
    clock_every_s: float = 0.02
    deadline_s: float = 50.0


@dataclass
class ChaosLog:
    """What the hosts and users saw, to compare with the database."""

    intended: dict[str, str] = field(default_factory=dict)  # task -> want
    sent: dict[tuple[str, int], tuple[str, bool, str]] = field(default_factory=dict)
    records: list[ResultRecord] = field(default_factory=list)
    lost_replies: int = 0
    cancelled_by_user: set[str] = field(default_factory=set)
    kills: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    abandoned: int = 0
    #: What hosts and users were told succeeded, for the shared checker.
    acknowledged: Acknowledged = field(default_factory=Acknowledged)
    #: Consistent snapshots sampled all through the run (double bookings, attempt
    #: numbers going down, terminal tasks changing).
    observer: Observer = field(default_factory=Observer)


def want_for(want: str, attempt: int) -> tuple[Outcome, bool]:
    """What the host reports for ``attempt`` of a task that wants ``want``."""
    if want == "fail":
        return Outcome.FAILED, False
    if want == "flaky" and attempt == 1:
        return Outcome.FAILED, True
    return Outcome.DONE, False


class ChaosHost:
    def __init__(
        self,
        cp: ControlPlane,
        host_id: str,
        credential: str,
        devices: list[str],
        log: ChaosLog,
        cfg: ChaosConfig,
    ) -> None:
        self.cp = cp
        self.host_id = host_id
        self.credential = credential
        self.devices = devices
        self.log = log
        self.cfg = cfg
        self.session: Session | None = None
        self.jobs: set[asyncio.Task[None]] = set()

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Retry what is retryable (lost replies, restarting actors)."""
        for _ in range(500):
            try:
                return await fn()
            except Unavailable:
                self.log.lost_replies += 1
                await asyncio.sleep(0.005)
        raise AssertionError("still unavailable after 500 retries")

    async def run(self, stop: asyncio.Event) -> None:
        self.session = await self._call(lambda: self.cp.register(self.host_id, self.credential))
        s = self.session
        await self._call(
            lambda: self.cp.heartbeat(s, [DeviceSnapshot(device_id=d) for d in self.devices])
        )
        while not stop.is_set():
            c = await self._call(lambda: self.cp.claim(s, wait_s=0.1))
            if c is None:
                continue
            job = asyncio.create_task(self._job(c))
            self.jobs.add(job)
            job.add_done_callback(self.jobs.discard)
        if self.jobs:
            await asyncio.gather(*self.jobs, return_exceptions=True)

    async def _job(self, c: Claimed) -> None:
        s = self.session
        assert s is not None
        try:
            await self._call(lambda: self.cp.ack(s, c.task_id, c.attempt, c.lease_token))
            self.log.acknowledged.acked.add((c.task_id, c.attempt))
            cancel = False
            for _ in range(self.cfg.renewals_per_task):
                await asyncio.sleep(0)
                st = await self._call(lambda: self.cp.renew(s, c.task_id, c.attempt, c.lease_token))
                cancel = cancel or st.cancel_requested
            if cancel:
                outcome, retryable = Outcome.CANCELLED, False
            else:
                outcome, retryable = want_for(self.log.intended[c.task_id], c.attempt)
            result = {"task": c.task_id, "attempt": c.attempt, "outcome": str(outcome)}
            fp = fingerprint(result)
            self.log.sent[(c.task_id, c.attempt)] = (str(outcome), retryable, fp)
            rec = await self._call(
                lambda: self.cp.report_result(
                    s,
                    c.task_id,
                    c.attempt,
                    c.lease_token,
                    outcome=outcome,
                    retryable=retryable,
                    reason="chaos",
                    result=result,
                    fingerprint=fp,
                )
            )
            self.log.records.append(rec)
            self.log.acknowledged.result(c.task_id, c.attempt, fp, replayed=rec.replayed)
        except ABANDON:
            # The attempt expired or was replaced (chaos delayed us): drop it, as a
            # real host does.
            self.log.abandoned += 1


async def run_chaos(
    cp: ControlPlane, repo: Repository, clock: ManualClock, cfg: ChaosConfig
) -> tuple[ChaosLog, list[str]]:
    rng = random.Random(cfg.seed)
    log = ChaosLog()
    # Reserve and release stamped with the database's own clock: the chaos clock
    # runs fast and each transaction reads it when it starts, so attempt time
    # ranges alone cannot tell an overlap.
    await install_reservation_audit(repo.engine)
    hosts = []
    for h in range(cfg.hosts):
        host_id = f"chaos-h{h}"
        cred = await repo.add_host(host_id)
        hosts.append(
            ChaosHost(
                cp,
                host_id,
                cred,
                [f"{host_id}-d{d}" for d in range(cfg.devices_per_host)],
                log,
                cfg,
            )
        )
    stop = asyncio.Event()
    host_tasks = [asyncio.create_task(h.run(stop)) for h in hosts]

    failpoints.arm(
        failpoints.LEASE_BEFORE_COMMIT, probability=cfg.lease_before_commit, seed=cfg.seed + 1
    )
    failpoints.arm(
        failpoints.LEASE_AFTER_COMMIT_BEFORE_REPLY,
        probability=cfg.lease_after_commit,
        seed=cfg.seed + 2,
    )
    failpoints.arm(
        failpoints.SCHEDULER_AFTER_ASSIGN_COMMIT,
        probability=cfg.scheduler_after_assign,
        seed=cfg.seed + 3,
    )
    failpoints.arm(
        failpoints.REAPER_AFTER_EXPIRE_COMMIT,
        probability=cfg.reaper_after_expire,
        seed=cfg.seed + 4,
    )

    specs = []
    for i in range(cfg.tasks):
        want = rng.choices(["done", "fail", "flaky"], weights=[70, 15, 15])[0]
        specs.append(
            (
                want,
                TaskSpec(
                    kind=TaskKind.GOAL,
                    goal="chaos",
                    payload={"i": i, "want": want},
                    retry=RetryPolicy(max_attempts=cfg.max_attempts, backoff_base_s=0),
                ),
            )
        )
    ids: list[str] = []
    for start in range(0, len(specs), 50):
        chunk = specs[start : start + 50]
        got = await cp.submit_many([sp for _, sp in chunk])
        for (want, _), tid in zip(chunk, got, strict=True):
            log.intended[tid] = want
        ids += got

    async def time_driver() -> None:
        while not stop.is_set():
            await asyncio.sleep(cfg.clock_every_s)
            clock.advance(cfg.clock_step_s)
            cp.poke_reaper()

    async def killer() -> None:
        while not stop.is_set():
            await asyncio.sleep(cfg.kill_every_s)
            victim = rng.choice(["lease", "lease", "lease", "scheduler", "reaper"])
            ref: Any
            if victim == "lease":
                refs = list(cp.supervisor.lease_refs().values())
                if not refs:
                    continue
                ref = rng.choice(refs)
            elif victim == "scheduler":
                ref = cp.supervisor.scheduler
            else:
                ref = cp.supervisor.reaper
            try:
                ref.tell(Crash())
                log.kills[victim] += 1
            except Exception:  # already dead: fine
                pass

    async def canceller() -> None:
        chosen = [t for t in ids if rng.random() < cfg.cancel_fraction]
        for t in chosen:
            await asyncio.sleep(rng.random() * 0.05)
            for _ in range(500):
                try:
                    await cp.cancel(t, ADMIN)
                    log.cancelled_by_user.add(t)
                    break
                except Unavailable:
                    await asyncio.sleep(0.005)

    async def sampler() -> None:
        while not stop.is_set():
            await log.observer.sample(repo.engine)
            await asyncio.sleep(0.05)

    helpers = [
        asyncio.create_task(time_driver()),
        asyncio.create_task(killer()),
        asyncio.create_task(canceller()),
        asyncio.create_task(sampler()),
    ]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.deadline_s
    try:
        while True:
            states = await _states(repo.engine, ids)
            if all(s in TERMINAL for s in states.values()):
                break
            if loop.time() > deadline:
                pending = {t: s for t, s in states.items() if s not in TERMINAL}
                raise AssertionError(
                    f"{len(pending)} tasks not terminal after {cfg.deadline_s} s: "
                    f"{list(pending.items())[:5]}"
                )
            await asyncio.sleep(0.1)
    finally:
        failpoints.disarm()
        stop.set()
        for t in helpers:
            t.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        await asyncio.wait_for(asyncio.gather(*host_tasks, return_exceptions=True), 30)
    return log, ids


async def _states(engine: AsyncEngine, ids: list[str]) -> dict[str, str]:
    async with engine.connect() as conn:
        rows = (await conn.execute(sa.select(tables.tasks.c.id, tables.tasks.c.status))).all()
    by_id = {str(r[0]): str(r[1]) for r in rows}
    return {t: by_id[t] for t in ids}


async def verify(engine: AsyncEngine, log: ChaosLog, ids: list[str], cfg: ChaosConfig) -> None:
    """The database after chaos: every promise kept. The shared checker
    (``fleetlease.ops.testing.invariants``) covers attempt histories, fencing,
    reservations and what was acknowledged; this adds what only the chaos hosts
    know: the outcome each reported and what its replies said."""
    report = await check(
        engine, acknowledged=log.acknowledged, observer=log.observer, task_ids=set(ids)
    )
    problems = list(report.violations)
    if log.observer.samples == 0:
        problems.append("the double-booking sampler never ran")
    async with engine.connect() as conn:
        tasks = {
            str(r["id"]): dict(r)
            for r in (await conn.execute(sa.select(tables.tasks))).mappings().all()
        }
        attempts = [dict(r) for r in (await conn.execute(sa.select(tables.attempts))).mappings()]
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for a in attempts:
        by_task[str(a["task_id"])].append(a)

    # Every task terminal with the outcome its host reported, or the retry policy's.
    for tid in ids:
        t = tasks[tid]
        state, n = str(t["status"]), int(t["attempt"])
        if state not in TERMINAL:
            continue  # the checker reported it
        ra = t["result_attempt"]
        if state == "cancelled" and tid in log.cancelled_by_user:
            pass  # a cancel wins over whatever the host was about to report
        elif ra is not None and int(ra) == n and (tid, n) in log.sent:
            outcome, retryable, fp = log.sent[(tid, n)]
            if t["result_fingerprint"] != fp:
                problems.append(f"{tid}: recorded fingerprint is not the host's last report")
            expected = outcome
            if outcome == "failed" and retryable and n < cfg.max_attempts:
                expected = "(retrying)"
            if state != expected:
                problems.append(f"{tid}: state {state}, host reported {outcome} on attempt {n}")
        elif state == "failed":
            last = max(by_task[tid], key=lambda a: a["number"]) if by_task[tid] else None
            if (
                n != cfg.max_attempts
                or last is None
                or last["end_reason"] not in ("claim_expired", "ack_expired", "lease_expired")
            ):
                problems.append(f"{tid}: failed without a report or an exhausted retry policy")
        elif state == "cancelled":
            if tid not in log.cancelled_by_user and t["cancel_requested_at"] is None:
                problems.append(f"{tid}: cancelled but nobody asked")
        elif state == "done":
            problems.append(f"{tid}: done without the host's report on its last attempt")

    # No stale report changed a newer attempt; replies (replays included) match
    # what was recorded.
    for rec in log.records:
        t = tasks[rec.task_id]
        final = int(t["attempt"])
        if rec.attempt != final:
            if str(rec.state) in TERMINAL and not rec.replayed:
                problems.append(f"{rec.task_id}: terminal reply for old attempt {rec.attempt}")
            continue
        if str(rec.state) in TERMINAL and str(rec.state) != str(t["status"]):
            problems.append(f"{rec.task_id}: reply said {rec.state}, database {t['status']}")
        if str(rec.state) in TERMINAL and rec.fingerprint != t["result_fingerprint"]:
            problems.append(f"{rec.task_id}: reply fingerprint differs from the recorded one")

    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:30])
