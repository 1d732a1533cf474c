"""The cancel-reach cell of ``fleetlease bench``: how long a user's cancel of a
running attempt takes to reach the host that runs it, with and without a
backlog.

Set-up (a control plane of its own, ``--cancel-lease-s`` leases, so hosts renew
every third of that): ``--hosts`` agents with ``--devices-per-host`` devices
each (capability ``pool=hang``) run tasks that never end by themselves
(``{"sim": {"outcome": "hang"}}``), and ``--cancel-backlog`` more of them wait
queued behind those devices. One more agent (``pool=churn``) runs zero-duration
tasks, fed by the load below.

Each cancel is issued through the ops API (``cancel``, as the CLI and the web
console do) for a running ``hang`` task, a few per second; its device then
takes the next queued task (the scheduler's and the group commit's work right
behind the cancel). Per cancel, from the moment the request is sent:

* ``reply``: the ops reply (the intent is committed);
* ``host``: the host learning it (the agent sets the runner's ``ctx.cancelled``:
  its renewal reply said ``cancel_requested``); ``reply_to_host`` is the part
  after the reply, the wait for the host's next renewal;
* ``ended``: the attempt ended ``cancelled`` (the control plane's event for the
  committed result).

Two runs: ``quiet`` (only the hang tasks and their backlog) and ``loaded``
(meanwhile, ops clients submit zero-duration tasks for the churn host in
batches and list tasks without pause, so the ops channel, the scheduler and
the group-commit batchers are busy). A cancel waits for the host's next
renewal, so ``host`` is spread over about one renewal interval (reported
beside it) however fast the rest is. ``renewals_missing_it`` counts renewals
sent after a cancel's reply that still answered "no cancel" (none expected:
the intent is committed before the reply, and every renewal reads it).
``bench_loop_lag`` is the lateness of this process's event loop meanwhile
(agents and ops clients run on it, so their figures include it).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from typing import Any

from fleetlease.ops.bench.fleet import (
    Events,
    Fleet,
    ServeProcess,
    add_hosts,
    revoke_hosts,
    submit,
)
from fleetlease.ops.bench.measure import latency_ms, until, until_all
from fleetlease.ops.bench.options import ZERO, BenchOptions, say

HANG = {"sim": {"outcome": "hang"}}
_HANG_POOL = {"pool": "hang"}
_CHURN_POOL = {"pool": "churn"}
#: Cancels issued per second in each run.
_CANCELS_PER_S = 5.0
#: Load of the loaded run: concurrent submitters and listers on the ops API,
#: and the churn tasks queued at most (submitters pause above it).
_SUBMITTERS = 8
_LISTERS = 4
_CHURN_QUEUED_MAX = 5000


def _time_cancels(
    agent: Any, learned_at: dict[str, float], renewed_without: dict[str, list[float]]
) -> None:
    """Make the real ``agent`` note when it learns that an attempt is cancelled
    (the moment the runner's ``ctx.cancelled`` is set) and, per task, when each
    renewal that said "no cancel" was sent."""
    attempts = agent.attempts
    request_cancel = attempts.request_cancel
    renew_once = attempts._renew_once

    def timed_request_cancel(att: Any) -> None:
        learned_at.setdefault(att.record.task_id, time.time())
        request_cancel(att)

    async def timed_renew_once(att: Any, *, timeout_s: float) -> Any:
        sent = time.time()
        reply = await renew_once(att, timeout_s=timeout_s)
        if not reply.cancel_requested:
            renewed_without.setdefault(att.record.task_id, []).append(sent)
        return reply

    attempts.request_cancel = timed_request_cancel
    attempts._renew_once = timed_renew_once


async def _loop_lag(samples: list[float], period_s: float = 0.01) -> None:
    """Until cancelled: how much later than asked each ``period_s`` sleep ends."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(period_s)
        samples.append(max(0.0, loop.time() - t - period_s))


async def cancel_cell(opts: BenchOptions, fleet: Fleet) -> dict[str, Any]:
    """Cancels of running tasks, quiet then under load (see the module doc)."""
    from fleetlease.hostagent.agent import AgentConfig
    from fleetlease.hostagent.devices import DEFAULT_SIM_CAPABILITIES, SimulatedDeviceManager
    from fleetlease.ops.bench.throughput import _tmpfs_dir
    from fleetlease.ops.client import OpsClient

    hang_hosts = [f"cx-{i}" for i in range(opts.hosts)]
    churn_host = "cx-churn"
    creds = await add_hosts(fleet.db_url, [*hang_hosts, churn_host])
    state = fleet.work / "serve-cancel"
    state.mkdir()
    serve = ServeProcess(
        database_url=fleet.db_url,
        nats_url=fleet.nats_url,
        state_dir=state,
        prefix=fleet.prefix,
        token=fleet.token,
        lease_s=opts.cancel_lease_s,
    )
    serve.spawn()
    events = Events()
    agents: list[tuple[Any, asyncio.Task[None]]] = []
    journals = _tmpfs_dir("fleetlease-bench-cancel-")
    learned_at: dict[str, float] = {}
    renewed_without: dict[str, list[float]] = {}
    running = opts.hosts * opts.devices_per_host
    try:
        await serve.ready()
        await events.start(fleet.nats_url, f"{fleet.prefix}.events.task")
        from fleetlease.hostagent.agent import Agent

        for h, pool in [(h, _HANG_POOL) for h in hang_hosts] + [(churn_host, _CHURN_POOL)]:
            cfg = AgentConfig(
                host_id=h,
                credential=creds[h],
                nats_url=fleet.nats_url,
                state_dir=journals / h,
                prefix=fleet.prefix,
                resync_jitter_s=0.0,
                claim_wait_s=20.0,
            )
            caps = {**DEFAULT_SIM_CAPABILITIES, **pool}
            devices = SimulatedDeviceManager(opts.devices_per_host, caps, prefix=f"{h}-dev")
            agent = Agent(cfg, devices)
            _time_cancels(agent, learned_at, renewed_without)
            agents.append((agent, asyncio.ensure_future(agent.run())))
        await until(
            lambda: all(a.started.is_set() or t.done() for a, t in agents), 60, "agents to start"
        )
        for _, t in agents:
            if t.done():
                t.result()
        async with OpsClient(
            nats_url=fleet.nats_url, token=fleet.token, prefix=fleet.prefix, timeout_s=60.0
        ) as ops:
            say(opts, f"cancel reach: {running} hang tasks running, {opts.cancel_backlog} queued")
            hang = set(
                await submit(ops, running + opts.cancel_backlog, payload=HANG, selector=_HANG_POOL)
            )
            await until_all(events.watch(list(hang), "running"), running, "hang tasks running")
            cancelled: set[str] = set()

            async def cancels(n: int) -> dict[str, Any]:
                issued: dict[str, float] = {}
                replied: dict[str, float] = {}
                start = time.monotonic()
                pending: set[asyncio.Task[None]] = set()
                lags: list[float] = []
                sampler = asyncio.ensure_future(_loop_lag(lags))

                async def one(tid: str) -> None:
                    issued[tid] = time.time()
                    await ops.call("cancel", id=tid)
                    replied[tid] = time.time()

                for i in range(n):
                    delay = start + i / _CANCELS_PER_S - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    # A running hang task not cancelled yet (its device took the
                    # next queued one when the last cancel ended).
                    await until(
                        lambda: bool(events.tasks_in.get("running", set()) & hang - cancelled),
                        60,
                        "a running hang task to cancel",
                    )
                    # The one running longest: its renewals are spread evenly.
                    tid = min(
                        events.tasks_in["running"] & hang - cancelled,
                        key=lambda t: events.at[t]["running"],
                    )
                    cancelled.add(tid)
                    pending.add(asyncio.ensure_future(one(tid)))
                await asyncio.gather(*pending)
                sampler.cancel()
                ids = list(issued)
                await until_all(
                    lambda: sum(1 for t in ids if t in learned_at), len(ids), "hosts to learn"
                )
                await until_all(events.watch(ids, "cancelled"), len(ids), "cancelled attempts")
                return {
                    "cancels": len(ids),
                    "reply": latency_ms([replied[t] - issued[t] for t in ids]),
                    "host": latency_ms([max(0.0, learned_at[t] - issued[t]) for t in ids]),
                    # From the reply (the intent committed) to the host learning
                    # it: the wait for the host's next renewal.
                    "reply_to_host": latency_ms(
                        [max(0.0, learned_at[t] - replied[t]) for t in ids]
                    ),
                    "ended": latency_ms(
                        [max(0.0, events.at[t]["cancelled"] - issued[t]) for t in ids]
                    ),
                    # Renewals sent after the cancel's reply (its commit) that
                    # still answered "no cancel": a cancel waiting behind
                    # something after its reply (0 when none does).
                    "renewals_missing_it": sum(
                        1 for t in ids for at in renewed_without.get(t, ()) if at > replied[t]
                    ),
                    # How late this process's event loop ran a 10 ms timer while
                    # the cancels were issued: the agents and the ops clients
                    # share it, and every figure above includes its delays.
                    "bench_loop_lag": latency_ms(lags),
                }

            say(opts, f"cancel reach: {opts.cancel_count} cancels, quiet")
            quiet = await cancels(opts.cancel_count)

            # The load: churn submits (the ops channel, the scheduler, the
            # group commit of claims, acks and results) and task listings.
            stop = asyncio.Event()
            churn: list[str] = []

            # Only churn tasks end ``done`` here (hang tasks end cancelled).
            def churn_done() -> int:
                return events.count.get("done", 0)

            submitted = {"batches": 0, "lists": 0}

            async def submitter() -> None:
                while not stop.is_set():
                    if len(churn) - churn_done() > _CHURN_QUEUED_MAX:
                        await asyncio.sleep(0.05)
                        continue
                    churn.extend(await submit(ops, 100, payload=ZERO, selector=_CHURN_POOL))
                    submitted["batches"] += 1

            async def lister() -> None:
                while not stop.is_set():
                    await ops.call("tasks", limit=100)
                    submitted["lists"] += 1

            load = [asyncio.ensure_future(submitter()) for _ in range(_SUBMITTERS)]
            load += [asyncio.ensure_future(lister()) for _ in range(_LISTERS)]
            try:
                say(opts, f"cancel reach: {opts.cancel_count} cancels, loaded")
                t_load = time.monotonic()
                loaded = await cancels(opts.cancel_count)
                load_s = time.monotonic() - t_load
            finally:
                stop.set()
                for task in load:
                    with contextlib.suppress(Exception):
                        await task
            loaded["load"] = {
                "churn_tasks_submitted": len(churn),
                "churn_tasks_done": churn_done(),
                "ops_submits_per_s": round(submitted["batches"] / load_s, 1),
                "ops_lists_per_s": round(submitted["lists"] / load_s, 1),
            }
        for agent, _ in agents:
            agent.stop()
        await asyncio.gather(*(asyncio.wait_for(t, 60) for _, t in agents))
        agents.clear()
        return {
            "running": running,
            "backlog": opts.cancel_backlog,
            "lease_s": opts.cancel_lease_s,
            "renewal_interval_s": round(opts.cancel_lease_s / 3.0, 3),
            "quiet": quiet,
            "loaded": loaded,
        }
    finally:
        for agent, t in agents:
            agent.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 30)
        await events.close()
        await serve.stop()
        shutil.rmtree(journals, ignore_errors=True)
        await revoke_hosts(fleet.db_url, [*hang_hosts, churn_host])
