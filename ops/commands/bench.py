"""``fleetlease bench``: the whole system measured on this machine, beside its
calibration (pgbench, the NATS round trip) and, with ``--peers``, beside
procrastinate and pgqueuer. Prints a table, or the report as JSON with ``--json``.

Without ``--database-url`` / ``--nats-url`` it starts embedded servers for the run.
Every database it uses is a scratch one created and dropped on that server.
What each figure means: ``ops/bench/runner.py``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from fleetlease.ops import eventloop, interpreter
from fleetlease.ops.cli import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, CliError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark the whole system here (throughput, latency, renewals, recovery)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--hosts", type=int, default=None, help="simulated agents (default 4; --fleet: 2000)"
    )
    p.add_argument(
        "--devices-per-host",
        type=int,
        default=None,
        help="devices of each agent (default 16; --fleet: 50)",
    )
    p.add_argument(
        "--fleet",
        action="store_true",
        help="run the fleet cell alone: a whole fleet of simulated hosts on one serve "
        "(idle cost, memory per device, latency at --fleet-rate)",
    )
    p.add_argument(
        "--fleet-rate", type=float, default=100.0, help="tasks/s of the fleet's load (default 100)"
    )
    p.add_argument(
        "--fleet-full-snapshots",
        action="store_true",
        help="the fleet's hosts send their complete device snapshot in every heartbeat "
        "(default: only the digest of an unchanged one, as the agent does)",
    )
    p.add_argument(
        "--fleet-claim-wait-s",
        type=float,
        default=20.0,
        help="long-poll wait of the fleet's claims (default 20, the agent's default; max 60)",
    )
    p.add_argument(
        "--fleet-idle-s", type=float, default=30.0, help="the fleet's idle window (default 30)"
    )
    p.add_argument(
        "--fleet-load-s", type=float, default=30.0, help="the fleet's load window (default 30)"
    )
    p.add_argument("--tasks", type=int, default=5000, help="zero-duration tasks (default 5000)")
    p.add_argument(
        "--renew-leases",
        type=int,
        default=10_000,
        help="leases held open in the renewal cell (default 10000; 0 skips it and recovery)",
    )
    p.add_argument(
        "--renew-period-s",
        type=float,
        default=10.0,
        help="renewal period of each lease in the paced renewal run (default 10)",
    )
    p.add_argument(
        "--renew-burst-s", type=float, default=5.0, help="length of the renewal burst (default 5)"
    )
    p.add_argument(
        "--recovery-leases",
        type=int,
        default=1000,
        help="active leases when the control plane is killed (default 1000; 0 skips it)",
    )
    p.add_argument(
        "--calibration-s", type=float, default=10.0, help="length of each pgbench run (default 10)"
    )
    p.add_argument(
        "--paced-rate",
        type=float,
        default=None,
        help="tasks/s of the latency run (default: half the throughput just measured)",
    )
    p.add_argument(
        "--peers", action="store_true", help="also run procrastinate and pgqueuer (extra 'bench')"
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also run the control plane's actors and write-through alone, in process, "
        "with no transport and no agents (an upper bound for this machine)",
    )
    p.add_argument(
        "--cancel-backlog",
        type=int,
        default=2000,
        help="tasks queued behind the running ones in the cancel-reach cell "
        "(default 2000; 0 skips the cell)",
    )
    p.add_argument(
        "--cancel-count",
        type=int,
        default=50,
        help="cancels of running tasks in each run of the cancel-reach cell (default 50)",
    )
    p.add_argument(
        "--cancel-lease-s",
        type=float,
        default=9.0,
        help="lease of the cancel-reach cell; hosts renew every third of it (default 9)",
    )
    p.add_argument(
        "--database-url",
        help="a PostgreSQL server where scratch databases may be created "
        "(env FLEETLEASE_DATABASE_URL; embedded when not given)",
    )
    p.add_argument("--nats-url", help="NATS URL (env FLEETLEASE_NATS_URL; embedded when not given)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from fleetlease.ops.bench import BenchError, BenchOptions, run
    from fleetlease.ops.render import is_tty, print_json

    try:
        renew = args.renew_leases
        hosts = args.hosts if args.hosts is not None else (2000 if args.fleet else 4)
        per_host = args.devices_per_host
        if per_host is None:
            per_host = 50 if args.fleet else 16
        opts = BenchOptions(
            hosts=hosts,
            devices_per_host=per_host,
            fleet=args.fleet,
            fleet_rate=args.fleet_rate,
            fleet_idle_s=args.fleet_idle_s,
            fleet_load_s=args.fleet_load_s,
            fleet_full_snapshots=args.fleet_full_snapshots,
            fleet_claim_wait_s=args.fleet_claim_wait_s,
            tasks=args.tasks,
            renew_leases=renew,
            recovery_leases=min(args.recovery_leases, renew),
            renew_period_s=args.renew_period_s,
            renew_burst_s=args.renew_burst_s,
            calibration_s=args.calibration_s,
            paced_rate=args.paced_rate,
            peers=args.peers,
            floor=args.floor,
            cancel_backlog=args.cancel_backlog,
            cancel_count=args.cancel_count,
            cancel_lease_s=args.cancel_lease_s,
            database_url=args.database_url or os.environ.get("FLEETLEASE_DATABASE_URL") or None,
            nats_url=args.nats_url or os.environ.get("FLEETLEASE_NATS_URL") or None,
            progress=_progress if is_tty(sys.stderr) else None,
        )
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    eventloop.checked_factory(lambda message: CliError(message, EXIT_USAGE))
    _quiet_logs()
    # SIGTERM / SIGHUP unwind like Ctrl-C, so the serve subprocess, agents and
    # scratch databases of the run are cleaned up (killed with the default
    # action, the bench left its serve running and holding 40 connections).
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    # The in-process agents get what `fleetlease agent` processes get: the
    # interpreter settings and the event loop.
    interpreter.tune()
    try:
        report = eventloop.run(run(opts))
    except BenchError as exc:
        raise CliError(str(exc), EXIT_UNAVAILABLE) from exc
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if args.json:
        print_json(report)
    elif "fleet" in report:
        print_fleet_report(report)
    else:
        print_report(report)
    return EXIT_OK


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _progress(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


def _quiet_logs() -> None:
    import logging

    import structlog

    # Once, for the whole run: each logger is assembled on first use (see
    # ``configure_logging``'s ``cache``), as in ``serve`` and ``agent``.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
        cache_logger_on_first_use=True,
    )


def _f(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    return f"{value}{unit}"


def _lat(d: dict[str, Any] | None) -> str:
    if not d or not d.get("n"):
        return "-"
    return f"{d['p50_ms']:.2f} / {d['p99_ms']:.2f} / {d['max_ms']:.2f} ms"


def print_fleet_report(r: dict[str, Any]) -> None:
    from rich.table import Table

    from fleetlease.ops.render import console

    f = r["fleet"]
    table = Table(
        title=(
            f"fleetlease bench --fleet: {f['hosts']:,} hosts x {f['devices_per_host']} devices "
            f"({f['simulated_hosts']}; load average {f['load_average_at_start']})"
        )
    )
    table.add_column("phase")
    table.add_column("figure")
    table.add_column("value", justify="right")
    e, i, m, ld = f["empty"], f["idle"], f["memory"], f["load"]
    table.add_row("empty", "control-plane cores, no host", _f(e["control_plane_cores"], "", 3))
    table.add_row("attach", "every host registered in", _f(f["attach_s"], " s", 1))
    table.add_row("idle", "control-plane cores", _f(i["control_plane_cores"], "", 3))
    table.add_row("", "machine cores (of the whole machine)", _f(i["machine_cores"], "", 2))
    table.add_row("", "heartbeats/s, claims/s", f"{i['heartbeats_per_s']} / {i['claims_per_s']}")
    table.add_row("", "claims parked (mean)", f"{i['claims_parked_mean']:,}")
    table.add_row(
        "", "control-plane CPU per heartbeat", _f(i["control_plane_cpu_ms_per_heartbeat"], " ms", 3)
    )
    table.add_row("", "commits per heartbeat", _f(i["commits_per_heartbeat"], "", 3))
    table.add_row(
        "", "device rows written per heartbeat", _f(i["device_rows_written_per_heartbeat"], "", 3)
    )
    table.add_row("", "WAL bytes per heartbeat", f"{i['wal_bytes_per_heartbeat']:,}")
    table.add_row("", "heartbeat round trip", _lat(i["heartbeat_round_trip"]))
    table.add_row("", "errors", str(i["errors"] or "none"))
    rss = f"{m['rss_empty_mib']} / {m['rss_attached_mib']} MiB"
    table.add_row("memory", "RSS empty / attached", rss)
    table.add_row("", "RSS per device (attached - empty)", _f(m["kib_per_device"], " KiB", 2))
    table.add_row(f"load {ld['rate_per_s']:g}/s", "assignment latency", _lat(ld["assignment"]))
    table.add_row("", "dispatch latency", _lat(ld["dispatch"]))
    table.add_row("", "control-plane cores", _f(ld["control_plane_cores"], "", 3))
    table.add_row("", "errors", str(ld["errors"] or "none"))
    for name, t in f["targets"].items():
        table.add_row(
            "targets" if name == "idle_cores" else "",
            f"{name} < {t['target']:g}",
            f"{'met' if t['met'] else 'NOT met'} ({t['measured']})",
        )
    console().print(table)


def print_report(r: dict[str, Any]) -> None:
    from rich.table import Table

    from fleetlease.ops.render import console

    s = r["setup"]
    table = Table(
        title=(
            f"fleetlease bench: {s['hosts']} hosts x {s['devices_per_host']} devices, "
            f"{s['tasks']} tasks ({s['control_plane']}; agents {s['agents']})"
        ),
        show_lines=False,
    )
    table.add_column("cell")
    table.add_column("figure")
    table.add_column("value", justify="right")
    cal = r["calibration"]
    pg = cal.get("pgbench", {})
    table.add_row("calibration", "pgbench simple-update TPS, 1 client", _f(pg.get("tps_1")))
    table.add_row("", "pgbench simple-update TPS, 8 clients", _f(pg.get("tps_8")))
    table.add_row(
        "", "transition ceiling (TPS 8 / 5), tasks/s", _f(cal.get("transition_ceiling_tasks_per_s"))
    )
    table.add_row("", "NATS request/reply p50 / p99 / max", _lat(cal.get("nats_round_trip")))
    tp = r["throughput"]
    table.add_row("throughput", "tasks/s (submit to done)", _f(tp["tasks_per_s"]))
    table.add_row("", "commits per task", _f(tp["commits_per_task"], digits=2))
    table.add_row("", "control-plane CPU per task", _f(tp["cpu_s_per_task"] * 1000, " ms", 3))
    if tp.get("agents_cpu_s_per_task") is not None:
        table.add_row(
            "",
            "benchmark process (agents) CPU per task",
            _f(tp["agents_cpu_s_per_task"] * 1000, " ms", 3),
        )
    if tp.get("machine_cpu_s_per_task") is not None:
        table.add_row(
            "",
            "whole machine CPU per task (PostgreSQL, NATS, every process)",
            _f(tp["machine_cpu_s_per_task"] * 1000, " ms", 3),
        )
    table.add_row("", "control-plane peak RSS", _f(tp["peak_rss_mib"], " MiB"))
    if tp.get("handovers_waited") is not None:
        table.add_row(
            "",
            "assignments that waited for the device's last report",
            f"{tp['handovers_waited']:,}",
        )
    for key, what in (("saturated", "saturated"), ("at_half_throughput", "paced")):
        share = tp[key].get("claimed_at_assignment")
        if share is not None:
            table.add_row(
                "", f"leases claimed by the assigning transaction, {what}", f"{share:.0%}"
            )
    table.add_row("", "assignment latency, saturated", _lat(tp["saturated"]["assignment"]))
    table.add_row("", "dispatch latency, saturated", _lat(tp["saturated"]["dispatch"]))
    phases = tp["saturated"].get("phases") or {}
    for name, what in (
        ("claim", "assigned -> claimed"),
        ("ack", "claimed -> acked"),
        ("report", "acked -> result"),
    ):
        if name in phases:
            table.add_row("", f"{what}, saturated", _lat(phases[name]))
    half = tp["at_half_throughput"]
    table.add_row("", f"assignment latency at {half['rate_per_s']:.0f}/s", _lat(half["assignment"]))
    table.add_row("", f"dispatch latency at {half['rate_per_s']:.0f}/s", _lat(half["dispatch"]))
    if half.get("machine_cpu_s_per_task") is not None:
        table.add_row(
            "",
            f"CPU per task at {half['rate_per_s']:.0f}/s: control plane / benchmark / machine",
            " / ".join(
                _f(half[k] * 1000, " ms", 2)
                for k in ("cpu_s_per_task", "agents_cpu_s_per_task", "machine_cpu_s_per_task")
            ),
        )
        table.add_row(
            "",
            f"machine busy at {half['rate_per_s']:.0f}/s (of {os.cpu_count()} cores)",
            _f(half["machine_busy_cores"], " cores", 2),
        )
    rn = r.get("renewals")
    if rn and "error" in rn:
        table.add_row("renewals, recovery", "failed", rn["error"])
    elif rn:
        table.add_row("renewals", "active leases", _f(rn["leases"]))
        table.add_row("", "RSS per active lease", _f(rn["rss_per_lease_kib"], " KiB"))
        table.add_row("", "renewals/s, burst", _f(rn["burst_renewals_per_s"]))
        table.add_row(
            "", "CPU per renewal, burst", _f(rn["burst_cpu_s_per_renewal"] * 1000, " ms", 3)
        )
        table.add_row("", "commits per renewal, burst", _f(rn["burst_commits_per_renewal"], "", 3))
        table.add_row(
            "",
            f"control-plane cores, every lease each {rn['period_s']:g} s",
            _f(rn["paced_control_plane_cpu_cores"], "", 3),
        )
        if "idle_control_plane_cpu_cores" in rn:
            table.add_row(
                "",
                "control-plane cores, leases held idle",
                _f(rn["idle_control_plane_cpu_cores"], "", 3),
            )
        table.add_row("", "renew round trip, paced", _lat(rn["paced_round_trip"]))
        if "paced_commits_per_renewal" in rn:
            table.add_row(
                "", "commits per renewal, paced", _f(rn["paced_commits_per_renewal"], "", 3)
            )
    rc = r.get("recovery")
    if rc and "error" not in rc:
        table.add_row(
            "recovery", f"SIGKILL with {rc['leases']} leases: restart", _f(rc["restart_s"], " s", 2)
        )
        table.add_row("", "until every lease served again", _f(rc["all_leases_served_s"], " s", 2))
        table.add_row("", "lost / duplicated tasks", f"{rc['lost']} / {rc['duplicated']}")
    cx = r.get("cancel_reach")
    if cx and "error" in cx:
        table.add_row("cancel reach", "failed", cx["error"])
    elif cx:
        table.add_row(
            "cancel reach",
            f"{cx['running']} running, {cx['backlog']:,} queued: hosts renew every",
            _f(cx["renewal_interval_s"], " s", 1),
        )
        for run in ("quiet", "loaded"):
            c = cx[run]
            table.add_row("", f"{run}: cancel -> ops reply", _lat(c["reply"]))
            table.add_row("", f"{run}: cancel -> host learns it", _lat(c["host"]))
            table.add_row("", f"{run}: ops reply -> host learns it", _lat(c["reply_to_host"]))
            table.add_row("", f"{run}: cancel -> attempt ended cancelled", _lat(c["ended"]))
            table.add_row(
                "",
                f"{run}: renewals after the reply missing the cancel",
                str(c["renewals_missing_it"]),
            )
            table.add_row("", f"{run}: benchmark event-loop lag", _lat(c["bench_loop_lag"]))
    fl = r.get("floor")
    if fl and "error" in fl:
        table.add_row("floor", "failed", fl["error"])
    elif fl:
        table.add_row("floor", "actors + write-through alone: tasks/s", _f(fl["tasks_per_s"]))
        table.add_row("", "... transitions/s (5 per task)", _f(fl["transitions_per_s"]))
        table.add_row("", "commits per task", _f(fl["commits_per_task"], digits=2))
        table.add_row(
            "",
            "CPU per task: control plane (no transport) / machine",
            " / ".join(
                _f(fl[k] * 1000, " ms", 2)
                for k in ("process_cpu_s_per_task", "machine_cpu_s_per_task")
            ),
        )
    peers = r.get("peers")
    if peers:
        for name in ("procrastinate", "pgqueuer"):
            p = peers.get(name, {})
            table.add_row(
                "peers" if name == "procrastinate" else "",
                f"{name} jobs/s (concurrency {peers['concurrency']})",
                p.get("error") or _f(p.get("jobs_per_s")),
            )
    ratios = r.get("ratios", {})
    table.add_row(
        "ratios", "ours / transition ceiling", _f(ratios.get("of_transition_ceiling"), "", 2)
    )
    if "floor_of_transition_ceiling" in ratios:
        table.add_row(
            "", "floor / transition ceiling", _f(ratios["floor_of_transition_ceiling"], "", 2)
        )
        table.add_row("", "ours / floor", _f(ratios.get("of_floor"), "", 2))
    for name in ("procrastinate", "pgqueuer"):
        if f"vs_{name}" in ratios:
            table.add_row("", f"ours / {name}", _f(ratios.get(f"vs_{name}"), "", 2))
    console().print(table)
