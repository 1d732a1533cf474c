"""Fault: three ``fleetlease serve`` replicas under load, each SIGKILLed in
turn and started again.

Real agents run tasks and ``fleetlease submit`` processes keep submitting
meanwhile; a ``fleetlease watch --json`` process runs from before the first
kill to the end. Invariants: every task submitted ends terminal, once (no task
lost, none duplicated by a retried submit); no device or task is ever reserved
twice (the invariant checker); every client carries on (each submit exits 0,
after its own retry if it must; the agents stay up and report results after
the last kill); and the watch saw every change of every task: for each task,
its attempts' assignments, claims and acks and its final state, in order, each
once, and never a gap."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest
import sqlalchemy as sa

from fleetlease.ops.testing.cluster import (
    REPO_ROOT,
    Cluster,
    ClusterError,
    Proc,
    child_env,
    wait_for,
)
from fleetlease.persistence import tables
from tests.faults.conftest import MakeCluster

pytestmark = pytest.mark.chaos

HOSTS = ("h1", "h2", "h3")
SIM = {"duration_s": 1.0}


def _client_args(cluster: Cluster, token: str) -> list[str]:
    return ["--nats-url", cluster.nats.url, "--prefix", cluster.prefix, "--token", token]


class Submits:
    """``fleetlease submit`` processes, one after another, until stopped."""

    def __init__(self, cluster: Cluster, token: str) -> None:
        self.cluster = cluster
        self.token = token
        self.ids: list[str] = []
        self.runs = 0
        self.failed: list[str] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        while not self._stop.is_set():
            argv = [
                "-m", "fleetlease.ops.cli", "submit",
                "--goal", "replica kills", "--payload", json.dumps({"sim": SIM}),
                "--count", "3", "--max-attempts", "5", "--json", "--timeout", "5",
                *_client_args(self.cluster, self.token),
            ]  # fmt: skip
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *argv, cwd=REPO_ROOT, env=child_env(),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, err = await asyncio.wait_for(proc.communicate(), 120)
            self.runs += 1
            if proc.returncode != 0:
                self.failed.append(err.decode(errors="replace")[-2000:])
                continue
            made = [str(i) for i in json.loads(out)["ids"]]
            self.ids += made
            self.cluster.acknowledged.submitted.update(made)

    def stop(self) -> None:
        self._stop.set()


def _watched(watch: Proc) -> list[dict[str, Any]]:
    """The state changes ``watch --json`` printed (its log lines are others)."""
    return [e for e in watch.events() if "task_id" in e and "state" in e and "event" not in e]


async def _history(cluster: Cluster, ids: set[str]) -> dict[str, dict[str, Any]]:
    """Each task's final state and attempt, and its attempts' milestones."""
    assert cluster.engine is not None
    t, a = tables.tasks, tables.attempts
    async with cluster.engine.connect() as conn:
        tasks = (await conn.execute(sa.select(t.c.id, t.c.status, t.c.attempt))).all()
        attempts = (
            await conn.execute(
                sa.select(a.c.task_id, a.c.number, a.c.claimed_at, a.c.acked_at).order_by(
                    a.c.task_id, a.c.number
                )
            )
        ).all()
    out = {
        str(r.id): {"state": r.status, "attempt": r.attempt, "attempts": []}
        for r in tasks
        if str(r.id) in ids
    }
    for r in attempts:
        if str(r.task_id) in out:
            out[str(r.task_id)]["attempts"].append(
                (r.number, r.claimed_at is not None, r.acked_at is not None)
            )
    return out


async def _count_tasks(cluster: Cluster) -> int:
    assert cluster.engine is not None
    async with cluster.engine.connect() as conn:
        return int(
            (await conn.execute(sa.select(sa.func.count()).select_from(tables.tasks))).scalar_one()
        )


def _missed(seen: list[dict[str, Any]], db: dict[str, Any]) -> list[str]:
    """What the watch's changes of one task lack, against its database record."""
    changes = [(e["state"], e["attempt"]) for e in seen]
    problems = []
    if not changes or changes[0] != ("queued", 0):
        problems.append(f"does not start queued: {changes[:2]}")
    if changes and changes[-1] != (db["state"], db["attempt"]):
        problems.append(f"ends {changes[-1]}, the database says {(db['state'], db['attempt'])}")
    if [n for _, n in changes] != sorted(n for _, n in changes):
        problems.append(f"attempts out of order: {changes}")
    if len(set(changes)) != len(changes):
        problems.append(f"a change seen twice: {changes}")
    for number, claimed, acked in db["attempts"]:
        wanted = [("assigned", number)]
        wanted += [("dispatched", number)] if claimed else []
        wanted += [("running", number)] if acked else []
        lacking = [w for w in wanted if w not in changes]
        if lacking:
            problems.append(f"attempt {number}: missing {lacking}")
    return problems


@pytest.mark.timeout(600)
async def test_each_replica_killed_in_turn_loses_nothing(make_cluster: MakeCluster) -> None:
    cluster = await make_cluster()
    for i in range(3):
        await cluster.start_serve(i)
    await asyncio.gather(*(cluster.start_agent(h, devices=3) for h in HOSTS))
    token = await cluster.repo.add_user("watcher", platform_admin=True)

    watch_argv = [
        sys.executable, "-m", "fleetlease.ops.cli", "watch", "--json", "--timeout", "8",
        *_client_args(cluster, token),
    ]  # fmt: skip
    watch = Proc("watch", watch_argv, cluster.log_dir / "watch.log", child_env()).start()

    # The watch is subscribed once it shows a task submitted after it started.
    async def subscribed() -> bool:
        probe = (await cluster.submit(1, sim=SIM))[0]
        try:
            await wait_for(
                lambda: {e["task_id"] for e in _watched(watch)},
                lambda seen: probe in seen,
                timeout=5,
                what="the watch to show a probe",
            )
        except ClusterError:
            return False
        return True

    await wait_for(subscribed, timeout=90, what="the watch to be subscribed", interval=0)

    submits = Submits(cluster, token)
    loading = asyncio.create_task(submits.run())
    try:
        for i in range(3):
            await wait_for(
                lambda: len(submits.ids), lambda n, i=i: n >= 12 * (i + 1), timeout=120,
                what="submits going on",
            )  # fmt: skip
            # Killed with leases out.
            await wait_for(
                lambda: cluster.states(submits.ids),
                lambda states: sum(v == "running" for v in states.values()) >= 3,
                timeout=120,
                what="leases out",
            )
            # The watch has moved past the previous restart: its cursor is one
            # the replicas left running hold. (A watcher whose every replica
            # restarted since its cursor, all within its retries, gets a gap.)
            await wait_for(
                subscribed, timeout=90, what="the watch to show a new change", interval=0
            )
            await cluster.kill_serve(i)
            assert cluster.serves[i].returncode == -9
            done_before = len(submits.ids)
            # The two others carry the load meanwhile.
            await wait_for(
                lambda: len(submits.ids), lambda n, d=done_before: n >= d + 6, timeout=120,
                what=f"submits with serve-{i} dead",
            )  # fmt: skip
            await cluster.start_serve(i)
    finally:
        submits.stop()
        await loading

    assert not submits.failed, "a submit failed:\n" + "\n---\n".join(submits.failed[:3])
    # Every agent carries on through the restarted replicas: more tasks than
    # devices, so each host runs some.
    marks = {h: cluster.agents[h].proc.mark() for h in HOSTS}
    submits.ids += await cluster.submit(6 * len(HOSTS), sim=SIM, max_attempts=5)
    ids = sorted(submits.ids)
    assert len(ids) == len(set(ids))
    await cluster.wait_terminal(sorted(cluster.acknowledged.submitted), timeout=240)
    report = await cluster.assert_invariants()
    for h in HOSTS:
        agent = cluster.agents[h].proc
        assert agent.alive, agent.tail()
        assert agent.named("result_reported", since=marks[h]), f"{h} reported nothing after"

    # Every task in the database was submitted once by a client that was told so.
    history = await _history(cluster, set(ids))
    assert set(history) == set(ids)
    assert await _count_tasks(cluster) == len(cluster.acknowledged.submitted)

    def finished(seen: list[dict[str, Any]]) -> bool:
        last = {e["task_id"]: (e["state"], e["attempt"]) for e in seen}
        return all(last.get(t) == (h["state"], h["attempt"]) for t, h in history.items())

    seen = await wait_for(lambda: _watched(watch), finished, timeout=60, what="the watch")
    assert watch.alive, watch.tail()
    assert "missed" not in watch.tail(10**6), "the watch reported a gap"
    by_task: dict[str, list[dict[str, Any]]] = {}
    for e in seen:
        by_task.setdefault(e["task_id"], []).append(e)
    problems = {t: p for t in ids if (p := _missed(by_task.get(t, []), history[t]))}
    assert not problems, f"{len(problems)} tasks with changes missed: {list(problems.items())[:5]}"
    changes = sum(len(by_task[t]) for t in ids)
    print(
        f"3 replicas, each SIGKILLed once: {len(ids)} tasks by {submits.runs} submits, "
        f"{changes} changes watched, none missed; {len(report.violations)} violations"
    )
    await watch.kill()
