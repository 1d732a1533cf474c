"""The throughput cell of ``fleetlease bench``: agents run zero-duration tasks at
full speed, then paced, for the latencies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleetlease.ops.bench.fleet import (
    Events,
    Fleet,
    ServeProcess,
    add_hosts,
    revoke_hosts,
    submit,
    timed_agent_class,
)
from fleetlease.ops.bench.measure import (
    latency_ms,
    libpq_url,
    machine_busy_s,
    until,
    until_all,
    xact_commit,
)
from fleetlease.ops.bench.options import ZERO, BenchOptions, say


async def throughput_cell(opts: BenchOptions, fleet: Fleet) -> dict[str, Any]:
    """Agents run N zero-duration tasks at full speed, then at half that rate."""
    from fleetlease.hostagent.agent import AgentConfig
    from fleetlease.hostagent.devices import SimulatedDeviceManager
    from fleetlease.ops.client import OpsClient

    host_ids = [f"tp-{i}" for i in range(opts.hosts)]
    creds = await add_hosts(fleet.db_url, host_ids)
    state = fleet.work / "serve-throughput"
    state.mkdir()
    serve = ServeProcess(
        database_url=fleet.db_url,
        nats_url=fleet.nats_url,
        state_dir=state,
        prefix=fleet.prefix,
        token=fleet.token,
    )
    commits_before = await xact_commit(fleet.db_url)
    serve.spawn()
    events = Events()
    agents: list[tuple[Any, asyncio.Task[None]]] = []
    journals = _tmpfs_dir("fleetlease-bench-agents-")
    held_at: dict[str, float] = {}
    try:
        await serve.ready()
        await events.start(fleet.nats_url, f"{fleet.prefix}.events.task")
        timed_agent = timed_agent_class()
        for h in host_ids:
            cfg = AgentConfig(
                host_id=h,
                credential=creds[h],
                nats_url=fleet.nats_url,
                state_dir=journals / h,
                prefix=fleet.prefix,
                resync_jitter_s=0.0,
                claim_wait_s=20.0,
            )
            agent = timed_agent(
                cfg, SimulatedDeviceManager(opts.devices_per_host, prefix=f"{h}-dev")
            )
            agent.held_at = held_at
            agents.append((agent, asyncio.ensure_future(agent.run())))
        await until(
            lambda: all(a.started.is_set() or t.done() for a, t in agents), 60, "agents to start"
        )
        for _, t in agents:
            if t.done():
                t.result()
        async with OpsClient(
            nats_url=fleet.nats_url, token=fleet.token, prefix=fleet.prefix, timeout_s=30.0
        ) as ops:
            # Warm-up: every device runs a task once.
            warm = await submit(ops, opts.hosts * opts.devices_per_host)
            await until_all(events.watch(warm, "done"), len(set(warm)), "warm-up tasks")

            say(opts, f"throughput: {opts.tasks} tasks")
            marks = _cpu_marks(serve)
            t0 = time.time()
            ids = await submit(ops, opts.tasks)
            await until_all(events.watch(ids, "done"), len(set(ids)), "tasks done")
            cpu, agents_cpu, machine_cpu = _cpu_since(serve, marks)
            last = max(events.at[t]["done"] for t in ids)
            tps = len(ids) / max(last - t0, 1e-9)
            saturated = _latencies(ids, events, held_at)

            # Latency at half the throughput just measured (or at --paced-rate):
            # one submit per task.
            rate = opts.paced_rate if opts.paced_rate is not None else max(tps / 2, 1.0)
            n_paced = max(1, min(opts.tasks, round(rate * 10)))
            say(opts, f"latency: {n_paced} tasks at {rate:.0f}/s")
            paced_ids: list[str] = []
            pending: set[asyncio.Task[Any]] = set()
            paced_marks = _cpu_marks(serve)
            t_paced = time.time()
            start = time.monotonic()
            for i in range(n_paced):
                delay = start + i / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.ensure_future(ops.call("submit", goal="bench", payload=ZERO))
                pending.add(task)
            for reply in await asyncio.gather(*pending):
                paced_ids.append(str(reply["id"]))
            await until_all(
                events.watch(paced_ids, "done"), len(set(paced_ids)), "paced tasks done"
            )
            paced = _latencies(paced_ids, events, held_at)
            paced_s = max(events.at[t]["done"] for t in paced_ids) - t_paced
            paced_cpu = _cpu_since(serve, paced_marks)
        peak = serve.peak_rss()
        for agent, _ in agents:
            agent.stop()
        await asyncio.gather(*(asyncio.wait_for(t, 60) for _, t in agents))
        handovers = sum(agent.stats.handovers_waited for agent, _ in agents)
        agents.clear()
        await serve.stop()
        total = len(warm) + len(ids) + len(paced_ids)
        commits = await xact_commit(fleet.db_url) - commits_before
        saturated["claimed_at_assignment"] = await _claimed_at_assignment(fleet.db_url, ids)
        paced["claimed_at_assignment"] = await _claimed_at_assignment(fleet.db_url, paced_ids)
        return {
            "tasks": len(ids),
            "tasks_per_s": round(tps, 1),
            "cpu_s_per_task": round(cpu / len(ids), 6),
            # CPU of the benchmark process (the in-process agents, plus the
            # submitting user client and the event subscriber) per task.
            "agents_cpu_s_per_task": round(agents_cpu / len(ids), 6),
            # Every process of the machine (PostgreSQL and NATS included): what a
            # task costs the whole system here.
            "machine_cpu_s_per_task": round(machine_cpu / len(ids), 6),
            "control_plane_cpu_cores": round(cpu / max(last - t0, 1e-9), 3),
            "commits_per_task": round(commits / total, 3),
            "commits_counted_over_tasks": total,
            "peak_rss_mib": round(peak / 2**20, 1),
            # Assignments (of the whole cell) that reached an agent while the
            # device's last attempt still waited for its result's answer: the
            # host held the lease (dispatch ends) and acked once the device
            # was handed over (in the ack phase).
            "handovers_waited": handovers,
            "saturated": saturated,
            "at_half_throughput": {
                "rate_per_s": round(rate, 1),
                "rate_from": "--paced-rate"
                if opts.paced_rate is not None
                else "half of tasks_per_s",
                **paced,
                # CPU per task (control plane, benchmark process, whole machine)
                # and the machine's busy cores, from the first paced submit to
                # the last paced task done: one task at a time costs more than
                # in the batches of the saturated run.
                "cpu_s_per_task": round(paced_cpu[0] / len(paced_ids), 6),
                "agents_cpu_s_per_task": round(paced_cpu[1] / len(paced_ids), 6),
                "machine_cpu_s_per_task": round(paced_cpu[2] / len(paced_ids), 6),
                "machine_busy_cores": round(paced_cpu[2] / max(paced_s, 1e-9), 2),
            },
        }
    finally:
        for agent, t in agents:
            agent.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 30)
        await events.close()
        await serve.stop()
        shutil.rmtree(journals, ignore_errors=True)
        await revoke_hosts(fleet.db_url, host_ids)


def _cpu_marks(serve: ServeProcess) -> tuple[float, float, float]:
    """CPU seconds so far of the control plane, of this process (the agents,
    mostly) and of the whole machine."""
    return serve.cpu_s(), time.process_time(), machine_busy_s()


def _cpu_since(
    serve: ServeProcess, marks: tuple[float, float, float]
) -> tuple[float, float, float]:
    """``_cpu_marks`` now, less ``marks``."""
    now = _cpu_marks(serve)
    return now[0] - marks[0], now[1] - marks[1], now[2] - marks[2]


def _latencies(ids: Sequence[str], events: Events, held_at: dict[str, float]) -> dict[str, Any]:
    assign: list[float] = []
    dispatch: list[float] = []
    for t in ids:
        at = events.at.get(t, {})
        if "queued" in at and "assigned" in at:
            assign.append(max(0.0, at["assigned"] - at["queued"]))
        if "assigned" in at and t in held_at:
            dispatch.append(max(0.0, held_at[t] - at["assigned"]))
    # Where a task's life goes, as the control plane stamped it: claim
    # (assignment commit to claim commit), ack (claim to ack commit), report (ack
    # to result commit: a zero-duration run, journal writes and the report).
    phases: dict[str, list[float]] = {"claim": [], "ack": [], "report": []}
    steps = (
        ("claim", "assigned", "dispatched"),
        ("ack", "dispatched", "running"),
        ("report", "running", "done"),
    )
    for t in ids:
        at = events.at.get(t, {})
        for name, a, b in steps:
            if a in at and b in at:
                phases[name].append(max(0.0, at[b] - at[a]))
    return {
        "assignment": latency_ms(assign),
        "dispatch": latency_ms(dispatch),
        "phases": {name: latency_ms(v) for name, v in phases.items()},
    }


def _tmpfs_dir(prefix: str) -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


async def _claimed_at_assignment(url: str, task_ids: Sequence[str]) -> float | None:
    """The share of these tasks' attempts claimed by the transaction that
    assigned them (a long-poll was parked for the device: ``claimed_at`` is
    the assignment's own time)."""
    import asyncpg

    if not task_ids:
        return None
    conn = await asyncpg.connect(libpq_url(url))
    try:
        row = await conn.fetchrow(
            "SELECT count(*) FILTER (WHERE claimed_at = assigned_at) AS fused, count(*) AS n"
            " FROM attempts WHERE task_id = ANY($1::uuid[])",
            list(task_ids),
        )
    finally:
        await conn.close()
    return round(row["fused"] / row["n"], 3) if row["n"] else None
