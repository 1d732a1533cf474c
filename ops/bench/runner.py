"""End-to-end benchmark of the whole system (``fleetlease bench``): figures, never
assertions.

Everything is measured in one run, on this machine, beside its calibration:

* **calibration**: pgbench simple-update TPS at 1 and 8 clients on the same
  PostgreSQL (a scratch database), and the nats-py request/reply round trip.
  The *transition ceiling* is pgbench TPS at 8 clients / 5: what PostgreSQL alone
  could do with one commit per transition of a task's life (submit, assign,
  claim, ack, result) and no software around it.
* **throughput**: the control plane is ``fleetlease serve`` in a subprocess (so its
  CPU and memory are its own); ``--hosts`` simulated agents (the real
  ``hostagent.agent.Agent``, in the benchmark process, journals on tmpfs when
  there is one) with ``--devices-per-host`` devices each. ``--tasks`` zero-duration
  tasks are submitted through the user API (batches of 100) and run to ``done``:
  tasks/s from the first submit to the last ``done``; commits per task
  (``pg_stat_database.xact_commit`` of the scratch database over the whole cell,
  start-up and heartbeats included); CPU seconds of the control plane per task;
  its peak RSS. Then the same tasks one by one at half that rate (or at
  ``--paced-rate``, a fixed rate that makes two runs' latencies comparable), for the
  latencies: assignment (the ``queued`` event, emitted after the submit commit,
  to the ``assigned`` event, emitted after the assignment commit) and dispatch
  (the ``assigned`` event to the agent holding the lease), p50/p99/max. Event
  times are the control plane's wall clock, the agent's is the benchmark's: one
  machine, one clock. An agent claims for a device while its last attempt
  reports the result, so a lease may reach it before that device is free: it
  holds the lease then (dispatch ends) and acks once the device is handed over
  (the wait is in the ack phase); ``handovers_waited`` counts those. A lease
  claimed by the transaction that assigned it (an agent's claim was parked for
  the device) is held at the assignment's commit: ``claimed_at_assignment`` is
  the share of attempts claimed so, saturated and paced.
* **renewals**: ``--renew-leases`` leases held by bare ``HostClient`` hosts and
  renewed as fast as they go (renewals/s, CPU per renewal, commits per renewal),
  then each once per ``--renew-period-s`` (CPU of the control plane in cores,
  and, for comparison, its cores while it holds the leases with no traffic);
  the RSS of the control plane per active lease.
* **recovery**: with ``--recovery-leases`` of those leases still active, SIGKILL
  the control plane, start it again, and time until every lease has been renewed
  again; then finish them all and count tasks lost or run twice (must be 0).
* **floor** (``--floor``, before the throughput cell): the actors and the
  write-through alone, in this process, with loops calling the ``ControlPlane``
  facade for hosts that cost nothing (``ops/bench/floor.py``): tasks/s,
  transitions/s, commits and CPU per task; the ratios floor / ceiling and
  whole system / floor. An upper bound for the whole system here.
* **cancel reach** (``--cancel-backlog``, 0 skips it): running tasks that never
  end by themselves, more of them queued behind, cancelled through the ops API
  a few a second, quiet and then under load (submits and listings on the ops
  API, zero-duration tasks run meanwhile): the time from the cancel request to
  its ops reply, to the host learning it (its runner's ``ctx.cancelled``) and to
  the attempt ending ``cancelled``, p50/p99/max, beside the hosts' renewal
  interval (``ops/bench/cancel.py``).
* **fleet** (``--fleet``, alone): ``--hosts`` simulated hosts (default 2,000)
  of ``--devices-per-host`` devices (default 50) speaking the host protocol from
  one process, attached to one ``serve``: its cores with the fleet idle, RSS per
  device, the cost of a heartbeat, and assignment and dispatch latency at
  ``--fleet-rate`` tasks/s (``ops/bench/fleetcell.py``).
* **peers** (``--peers``): the same N zero-duration jobs through procrastinate and
  pgqueuer (extra ``bench``), each alone on a scratch database of the same
  PostgreSQL, with the same worker concurrency (hosts x devices per host).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from fleetlease.ops import eventloop
from fleetlease.ops.bench.calibration import nats_round_trip, pgbench_tps
from fleetlease.ops.bench.fleet import setup_fleet
from fleetlease.ops.bench.leases import lease_cells
from fleetlease.ops.bench.measure import machine_busy_s, xact_commit
from fleetlease.ops.bench.options import SUBMIT_BATCH, BenchError, BenchOptions, say
from fleetlease.ops.bench.peers import peers_cell
from fleetlease.ops.bench.servers import scratch_database, servers
from fleetlease.ops.bench.throughput import throughput_cell

#: Version of the report's layout (the JSON of ``fleetlease bench --json``).
SCHEMA = 1


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 3)


async def run(opts: BenchOptions) -> dict[str, Any]:
    """Run every cell; returns the report (the JSON of ``fleetlease bench --json``)."""
    if opts.fleet:
        return await run_fleet(opts)
    work = Path(tempfile.mkdtemp(prefix="fleetlease-bench-"))
    try:
        async with servers(opts, work) as srv:
            report: dict[str, Any] = {
                "schema": SCHEMA,
                "setup": {
                    "hosts": opts.hosts,
                    "devices_per_host": opts.devices_per_host,
                    "tasks": opts.tasks,
                    "agents": f"in-process (the benchmark process, {eventloop.loop_name()} loop), "
                    "journals on tmpfs",
                    "control_plane": f"fleetlease serve subprocess, {eventloop.loop_name()} loop",
                    "submit": f"user API over NATS, batches of {SUBMIT_BATCH}",
                    "cpus": os.cpu_count(),
                    "embedded": srv.embedded,
                    "python": sys.version.split()[0],
                },
            }
            say(opts, "calibration: NATS round trip")
            calibration: dict[str, Any] = {"nats_round_trip": await nats_round_trip(srv.nats_url)}
            if srv.pgbench is None:
                calibration["pgbench"] = {"error": "pgbench not found"}
            else:
                say(opts, "calibration: pgbench")
                async with scratch_database(srv.database_url, "pgbench") as url:
                    calibration["pgbench"] = await pgbench_tps(srv.pgbench, url, opts.calibration_s)
            tps8 = calibration["pgbench"].get("tps_8")
            ceiling = round(tps8 / 5, 1) if tps8 else None
            calibration["transition_ceiling_tasks_per_s"] = ceiling
            report["calibration"] = calibration

            if opts.floor:
                say(opts, "floor: the control plane's core alone")
                from fleetlease.ops.bench.floor import floor_cell

                try:
                    async with scratch_database(srv.database_url, "floor") as url:
                        report["floor"] = await floor_cell(
                            url,
                            hosts=opts.hosts,
                            devices_per_host=opts.devices_per_host,
                            tasks=opts.tasks,
                            machine_busy_s=machine_busy_s,
                            xact_commit=xact_commit,
                        )
                except Exception as exc:  # one failed cell must not lose the others
                    report["floor"] = {"error": f"{type(exc).__name__}: {exc}"}
            async with scratch_database(srv.database_url, "fleet") as db_url:
                fleet = await setup_fleet(db_url, srv.nats_url, work)
                say(opts, "throughput")
                report["throughput"] = await throughput_cell(opts, fleet)
                try:
                    cells = await lease_cells(opts, fleet)
                except Exception as exc:  # one failed cell must not lose the others
                    error = {"error": f"{type(exc).__name__}: {exc}"}
                    cells = {"renewals": error, "recovery": error}
                report["renewals"] = cells["renewals"]
                report["recovery"] = cells["recovery"]
            if opts.cancel_backlog:
                from fleetlease.ops.bench.cancel import cancel_cell

                try:
                    async with scratch_database(srv.database_url, "cancel") as db_url:
                        fleet = await setup_fleet(db_url, srv.nats_url, work)
                        report["cancel_reach"] = await cancel_cell(opts, fleet)
                except Exception as exc:  # one failed cell must not lose the others
                    report["cancel_reach"] = {"error": f"{type(exc).__name__}: {exc}"}
            ours = report["throughput"]["tasks_per_s"]
            ratios: dict[str, Any] = {"of_transition_ceiling": _ratio(ours, ceiling)}
            if opts.floor:
                floor = report["floor"].get("tasks_per_s")
                ratios["floor_of_transition_ceiling"] = _ratio(floor, ceiling)
                ratios["of_floor"] = _ratio(ours, floor)
            if opts.peers:
                peers = await peers_cell(opts, srv.database_url)
                report["peers"] = peers
                for name in ("procrastinate", "pgqueuer"):
                    ratios[f"vs_{name}"] = _ratio(ours, peers.get(name, {}).get("jobs_per_s"))
            report["ratios"] = ratios
    except Exception as exc:
        # Keep the control plane's logs for a post-mortem.
        raise BenchError(f"{type(exc).__name__}: {exc} (logs kept in {work})") from exc
    shutil.rmtree(work, ignore_errors=True)
    return report


async def run_fleet(opts: BenchOptions) -> dict[str, Any]:
    """The fleet cell alone (``fleetlease bench --fleet``)."""
    from fleetlease.ops.bench.fleetcell import fleet_cell

    work = Path(tempfile.mkdtemp(prefix="fleetlease-bench-"))
    try:
        async with servers(opts, work) as srv:
            report: dict[str, Any] = {
                "schema": SCHEMA,
                "setup": {
                    "hosts": opts.hosts,
                    "devices_per_host": opts.devices_per_host,
                    "control_plane": f"fleetlease serve subprocess, {eventloop.loop_name()} loop",
                    "cpus": os.cpu_count(),
                    "embedded": srv.embedded,
                    "python": sys.version.split()[0],
                },
            }
            async with scratch_database(srv.database_url, "fleet") as db_url:
                fleet = await setup_fleet(db_url, srv.nats_url, work)
                report["fleet"] = await fleet_cell(opts, fleet)
    except Exception as exc:
        raise BenchError(f"{type(exc).__name__}: {exc} (logs kept in {work})") from exc
    shutil.rmtree(work, ignore_errors=True)
    return report
