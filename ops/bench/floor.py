"""The benchmark's *floor* cell (``fleetlease bench --floor``): the control
plane's core alone, what the fixed shape costs before any host is involved.

The Scheduler, Lease and Reaper actors and the repository run in the benchmark
process on a scratch database of the same PostgreSQL, exactly as ``serve`` runs
them (``ControlPlane``, the same group commit and write-through), but there is
no NATS, no transport server, no signature and no agent: ``hosts`` x
``devices_per_host`` loops call the ``ControlPlane`` facade directly, as the
transport server would, each one device's long-poll claim -> ack -> result,
round and round, at no cost of their own. ``tasks`` zero-duration tasks are
submitted through the facade in batches of 100 and timed from the first
submit to the last result.

Every transition is still written through before its caller is answered.
What this cell measures is an upper bound for the whole system on this machine:
the end-to-end throughput adds the transport, the agents (journal, signatures,
NATS) and the broker on the same cores. Its CPU figures are this process's
(the control plane and the loops) and the whole machine's (PostgreSQL
included), per task.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fleetlease.persistence.clock import SystemClock
from fleetlease.persistence.model import DeviceSnapshot, LeaseTimings, Outcome, TaskKind, TaskSpec

SUBMIT_BATCH = 100
_CLAIM_WAIT_S = 5.0
_HEARTBEAT_S = 10.0
_PROJECT = "default"
_OWNER = "admin"


async def floor_cell(
    url: str,
    *,
    hosts: int,
    devices_per_host: int,
    tasks: int,
    machine_busy_s: Any,
    xact_commit: Any,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Run the floor on the (empty, scratch) database at ``url``; returns its
    figures. ``machine_busy_s`` and ``xact_commit`` are the benchmark's own
    probes (whole-machine busy CPU seconds; the database's commit count)."""
    from fleetlease.actors.runtime import ControlPlane
    from fleetlease.persistence.db import create_engine
    from fleetlease.persistence.migrate import upgrade_engine
    from fleetlease.persistence.repository import Repository

    timings = LeaseTimings(claim_s=60, ack_s=60, lease_s=60, liveness_s=120)
    clock = SystemClock()
    # As serve's: every connection kept, none overflowing.
    engine = create_engine(url, pool_size=40, max_overflow=0)
    cp: Any = None
    loops: list[asyncio.Task[Any]] = []
    try:
        await upgrade_engine(engine)
        repo = Repository(engine, clock, timings)
        await repo.add_user(_OWNER, platform_admin=True)
        await repo.add_project(_PROJECT, owner=_OWNER)
        cp = ControlPlane(
            repo,
            loop=asyncio.get_running_loop(),
            clock=clock,
            timings=timings,
            scheduler_interval_s=1.0,
        )
        await cp.start()
        sessions = []
        for h in range(hosts):
            host_id = f"floor-h{h}"
            credential = await repo.add_host(host_id)
            session = await cp.register(host_id, credential)
            devices = [f"{host_id}-d{d}" for d in range(devices_per_host)]
            await cp.heartbeat(session, [DeviceSnapshot(device_id=d) for d in devices])
            sessions.append((session, devices))

        done = 0
        all_done = asyncio.Event()
        result = {"ok": True}

        async def device_loop(session: Any, device_id: str) -> None:
            nonlocal done
            while True:
                c = await cp.claim(session, wait_s=_CLAIM_WAIT_S, device_ids=[device_id])
                if c is None:
                    continue
                await cp.ack(session, c.task_id, c.attempt, c.lease_token)
                rec = await cp.report_result(
                    session,
                    c.task_id,
                    c.attempt,
                    c.lease_token,
                    outcome=Outcome.DONE,
                    result=result,
                    fingerprint="floor",
                )
                if str(rec.state) == "done" and not rec.replayed:
                    done += 1
                    if done >= tasks:
                        all_done.set()

        async def heartbeat_loop(session: Any, devices: list[str]) -> None:
            # As an agent does: a long run must not outlive the hosts' liveness.
            snapshot = [DeviceSnapshot(device_id=d) for d in devices]
            while True:
                await asyncio.sleep(_HEARTBEAT_S)
                await cp.heartbeat(session, snapshot)

        loops = [
            asyncio.ensure_future(device_loop(session, d))
            for session, devices in sessions
            for d in devices
        ]
        loops += [asyncio.ensure_future(heartbeat_loop(s, devices)) for s, devices in sessions]
        spec = TaskSpec(
            kind=TaskKind.GOAL, goal="floor", payload={}, project=_PROJECT, owner=_OWNER
        )
        commits0 = await xact_commit(url)
        cpu0, busy0, t0 = time.process_time(), machine_busy_s(), time.perf_counter()
        left = tasks
        while left > 0:
            n = min(SUBMIT_BATCH, left)
            await cp.submit_many([spec] * n)
            left -= n
        waiter = asyncio.ensure_future(all_done.wait())
        loops.append(waiter)  # cancelled with the loops, however this ends
        pending = set(loops)
        deadline = time.perf_counter() + timeout_s
        while not all_done.is_set():
            finished, pending = await asyncio.wait(
                pending,
                timeout=max(deadline - time.perf_counter(), 0.0),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not finished:
                raise TimeoutError(f"floor: {done} of {tasks} tasks done in {timeout_s:.0f} s")
            failed = next((t for t in finished if t is not waiter), None)
            if failed is not None:
                failed.result()  # a loop that ended raised: surface it
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        busy = machine_busy_s() - busy0
        commits = await xact_commit(url) - commits0
        return {
            "what": "actors and write-through alone, in the benchmark process: "
            "no NATS, no transport, no agents (loops call the ControlPlane facade)",
            "tasks": tasks,
            "concurrency": hosts * devices_per_host,
            "tasks_per_s": round(tasks / elapsed, 1),
            "transitions_per_s": round(5 * tasks / elapsed, 1),
            "process_cpu_s_per_task": round(cpu / tasks, 6),
            "machine_cpu_s_per_task": round(busy / tasks, 6),
            "commits_per_task": round(commits / tasks, 3),
        }
    finally:
        for t in loops:
            t.cancel()
        if loops:
            await asyncio.gather(*loops, return_exceptions=True)
        if cp is not None:
            await cp.stop(5.0)
        await engine.dispose()
