"""The fleet cell of ``fleetlease bench --fleet``: one ``fleetlease serve`` with
a whole fleet of simulated hosts attached (``ops/bench/simhosts.py``).

Phases, all against the same control plane (production timings: heartbeat
5 s, lease 30 s, claim 30 s, ack 15 s, liveness 30 s):

* **empty**: the control plane started, no host attached: its RSS and its
  CPU over a few seconds (what it costs with nothing to do);
* **attach**: every host registers, heartbeats and parks its claims;
* **idle**: the fleet attached and nothing submitted, for ``fleet_idle_s``:
  the control plane's cores (heartbeats and parked claims only), per
  heartbeat its CPU, the commits, device rows written and WAL bytes of the
  scratch database (WAL: of the whole PostgreSQL server), the heartbeat round
  trip, and the RSS per device;
* **load**: zero-duration tasks submitted one by one at ``fleet_rate`` for
  ``fleet_load_s``, the whole fleet attached: assignment latency (``queued`` to
  ``assigned`` event) and dispatch latency (``assigned`` event to the host
  holding the lease), p50/p99/max, and the control plane's cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import urllib.request
from typing import Any

from fleetlease.ops.bench.fleet import Events, Fleet, ServeProcess, with_repo
from fleetlease.ops.bench.measure import (
    latency_ms,
    libpq_url,
    machine_busy_s,
    until,
    until_all,
)
from fleetlease.ops.bench.options import ZERO, BenchError, BenchOptions, say
from fleetlease.ops.bench.simhosts import SimFleet, cpu_s
from fleetlease.ops.observe.looplag import LoopLagProbe

#: The production timings of ``fleetlease serve`` (its defaults).
_LEASE_S, _CLAIM_S, _ACK_S, _LIVENESS_S = 30.0, 30.0, 15.0, 30.0
_EMPTY_S = 5.0
_LAG_PROBE_S = 0.005
#: The targets of the cell: idle cores, KiB per device, dispatch p99 in ms.
TARGETS = {"idle_cores": 0.5, "kib_per_device": 4.0, "dispatch_p99_ms": 10.0}


async def _counters(db_url: str) -> dict[str, int]:
    """Commits of the scratch database, device rows written, WAL bytes."""
    import asyncpg

    conn = await asyncpg.connect(libpq_url(db_url))
    try:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        commits = await conn.fetchval(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        rows = await conn.fetchrow(
            "SELECT n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables"
            " WHERE relname = 'devices'"
        )
        wal = await conn.fetchval("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
    finally:
        await conn.close()
    return {
        "commits": int(commits),
        "device_rows_written": int(rows["n_tup_ins"] + rows["n_tup_upd"] + rows["n_tup_del"]),
        "wal_bytes": int(wal),
    }


async def _add_hosts(db_url: str, names: list[str]) -> dict[str, str]:
    async def run(repo: Any) -> dict[str, str]:
        sem = asyncio.Semaphore(4)

        async def one(h: str) -> tuple[str, str]:
            async with sem:
                return h, await repo.add_host(h)

        return dict(await asyncio.gather(*(one(h) for h in names)))

    return await with_repo(db_url, run)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def _scrape(url: str) -> dict[str, float] | None:
    """The samples of the serve's ``/metrics`` this cell reports on: its loop
    lag's cumulative buckets (``lag:<le>``) and its garbage collections
    (``gc:<generation>``); None when they cannot be read."""

    def scrape() -> str:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            return str(resp.read().decode())

    try:
        text = await asyncio.to_thread(scrape)
    except OSError:
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("fleetlease_event_loop_lag_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[f"lag:{le}"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("python_gc_collections_total{"):
            gen = line.split('generation="', 1)[1].split('"', 1)[0]
            out[f"gc:{gen}"] = float(line.rsplit(" ", 1)[1])
    return out


def _serve_report(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, Any]:
    """Over a phase: the serve's loop-lag probes and the share of them later
    than each bound; its garbage collections per generation."""
    if before is None or after is None:
        return {"error": "the serve's metrics could not be read"}
    diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    lag = {float(k[4:]): v for k, v in diff.items() if k.startswith("lag:")}
    total = lag.get(float("inf"), 0.0)
    return {
        "loop_lag_probes": int(total),
        "loop_lag_share_later_than_ms": {
            f"{le * 1000:g}": round(1 - n / total, 4)
            for le, n in sorted(lag.items())
            if total and le != float("inf") and 0.001 <= le <= 0.1
        },
        "gc_collections": {k[3:]: int(v) for k, v in sorted(diff.items()) if k.startswith("gc:")},
    }


class _Marks:
    def __init__(self, serve: ServeProcess) -> None:
        self.serve = serve
        self.t = time.monotonic()
        self.serve_cpu = serve.cpu_s()
        self.bench_cpu = cpu_s()
        self.machine = machine_busy_s()

    def cores(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.t, 1e-9)
        return {
            "seconds": round(elapsed, 1),
            "control_plane_cores": round((self.serve.cpu_s() - self.serve_cpu) / elapsed, 3),
            "bench_process_cores": round((cpu_s() - self.bench_cpu) / elapsed, 3),
            "machine_cores": round((machine_busy_s() - self.machine) / elapsed, 3),
        }


async def fleet_cell(opts: BenchOptions, fleet: Fleet) -> dict[str, Any]:
    from fleetlease.ops.bench.throughput import _latencies
    from fleetlease.ops.client import OpsClient

    hosts, per_host = opts.hosts, opts.devices_per_host
    devices = hosts * per_host
    host_ids = [f"fl-{i}" for i in range(hosts)]
    say(opts, f"fleet: adding {hosts} hosts")
    creds = await _add_hosts(fleet.db_url, host_ids)
    state = fleet.work / "serve-fleet"
    state.mkdir()
    serve = ServeProcess(
        database_url=fleet.db_url,
        nats_url=fleet.nats_url,
        state_dir=state,
        prefix=fleet.prefix,
        token=fleet.token,
        lease_s=_LEASE_S,
        claim_s=_CLAIM_S,
        ack_s=_ACK_S,
        liveness_s=_LIVENESS_S,
        metrics="127.0.0.1:0",
    )
    sim = SimFleet(
        nats_url=fleet.nats_url,
        prefix=fleet.prefix,
        credentials=creds,
        devices_per_host=per_host,
        connections=opts.fleet_connections,
        digests=not opts.fleet_full_snapshots,
        claim_wait_s=opts.fleet_claim_wait_s,
    )
    events = Events()
    report: dict[str, Any] = {
        "hosts": hosts,
        "devices_per_host": per_host,
        "devices": devices,
        "simulated_hosts": f"one asyncio process, {opts.fleet_connections} NATS connections",
        "heartbeats": "complete snapshot every time"
        if opts.fleet_full_snapshots
        else "digest of an unchanged snapshot",
        "load_average_at_start": _load(),
    }
    serve.spawn()
    try:
        await serve.ready()
        metrics_url = await serve.metrics_url()
        await events.start(fleet.nats_url, f"{fleet.prefix}.events.task")
        say(opts, "fleet: empty control plane")
        marks = _Marks(serve)
        await asyncio.sleep(_EMPTY_S)
        empty = marks.cores()
        rss_empty = serve.rss()

        say(opts, f"fleet: attaching {hosts} x {per_host} devices")
        t0 = time.monotonic()
        await sim.start()
        report["attach_s"] = round(time.monotonic() - t0, 2)
        report["heartbeat_s"] = sim.heartbeat_s
        report["claim_polls_per_host"] = sim.claim_polls
        report["claim_wait_s"] = sim.claim_wait_s
        # Settled: every host heartbeated twice since (an overloaded control
        # plane may never get there: the idle phase then measures that).
        target = 2 * hosts
        base = sim.heartbeats_sent
        try:
            await until(
                lambda: sim.heartbeats_sent - base >= target,
                max(30.0, 6 * sim.heartbeat_s),
                "two heartbeats of every host",
            )
            report["settled"] = True
        except BenchError:
            report["settled"] = False
        report["attach_errors"] = dict(sim.errors)

        say(opts, f"fleet: idle for {opts.fleet_idle_s:g} s")
        errors_before = dict(sim.errors)
        counters = await _counters(fleet.db_url)
        hb0, claims0, rtt0 = sim.heartbeats_sent, sim.claims_sent, len(sim.heartbeat_rtt_s)
        parked: list[int] = []
        marks = _Marks(serve)
        deadline = time.monotonic() + opts.fleet_idle_s
        while time.monotonic() < deadline:
            parked.append(sim.claims_outstanding)
            await asyncio.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
        idle = marks.cores()
        after = await _counters(fleet.db_url)
        rss_attached = serve.rss()
        beats = max(sim.heartbeats_sent - hb0, 1)
        serve_cpu = idle["control_plane_cores"] * idle["seconds"]
        report["empty"] = {**empty, "rss_mib": round(rss_empty / 2**20, 1)}
        report["idle"] = {
            **idle,
            "heartbeats_per_s": round(beats / idle["seconds"], 1),
            "heartbeats_expected_per_s": round(hosts / sim.heartbeat_s, 1),
            "claims_per_s": round((sim.claims_sent - claims0) / idle["seconds"], 1),
            "claims_parked_mean": round(sum(parked) / max(len(parked), 1)),
            "control_plane_cpu_ms_per_heartbeat": round(serve_cpu / beats * 1000, 3),
            "commits_per_heartbeat": round((after["commits"] - counters["commits"]) / beats, 3),
            "device_rows_written_per_heartbeat": round(
                (after["device_rows_written"] - counters["device_rows_written"]) / beats, 3
            ),
            "wal_bytes_per_heartbeat": round((after["wal_bytes"] - counters["wal_bytes"]) / beats),
            "heartbeat_round_trip": latency_ms(sim.heartbeat_rtt_s[rtt0:]),
            "errors": _diff(sim.errors, errors_before),
        }
        report["memory"] = {
            "rss_empty_mib": round(rss_empty / 2**20, 1),
            "rss_attached_mib": round(rss_attached / 2**20, 1),
            "kib_per_device": round((rss_attached - rss_empty) / devices / 1024, 3),
            "kib_per_device_whole_rss": round(rss_attached / devices / 1024, 3),
        }

        n = max(1, round(opts.fleet_rate * opts.fleet_load_s))
        say(opts, f"fleet: {n} tasks at {opts.fleet_rate:g}/s")
        errors_before = dict(sim.errors)
        async with OpsClient(
            nats_url=fleet.nats_url, token=fleet.token, prefix=fleet.prefix, timeout_s=30.0
        ) as ops:
            await ops.call("whoami")
            ids: list[str] = []
            pending: set[asyncio.Task[Any]] = set()
            serve_marks = await _scrape(metrics_url)
            marks = _Marks(serve)
            # How late this process's loop runs a timer: the simulated hosts
            # share it, so a reply that reached the process waits this long
            # before its host sees it, and that wait is in the dispatch figure.
            bench_lags: list[float] = []
            lag = LoopLagProbe(_LAG_PROBE_S, record=bench_lags.append).start()
            start = time.monotonic()
            for i in range(n):
                delay = start + i / opts.fleet_rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                pending.add(asyncio.ensure_future(ops.call("submit", goal="bench", payload=ZERO)))
            submit_errors: dict[str, int] = {}
            for reply in await asyncio.gather(*pending, return_exceptions=True):
                if isinstance(reply, BaseException):
                    # An overloaded control plane refuses submits: counted.
                    what = f"{type(reply).__name__}: {str(reply)[:60]}"
                    submit_errors[what] = submit_errors.get(what, 0) + 1
                else:
                    ids.append(str(reply["id"]))
            try:
                await until_all(
                    events.watch(ids, "done"), len(set(ids)), "fleet tasks done", stall_s=30.0
                )
            except BenchError as exc:
                report["load_incomplete"] = str(exc)
            loaded = marks.cores()
            await lag.stop()
            bench_lag = latency_ms(bench_lags)
            serve_seen = _serve_report(serve_marks, await _scrape(metrics_url))
        report["load"] = {
            "rate_per_s": opts.fleet_rate,
            "tasks": len(ids),
            **loaded,
            **_latencies(ids, events, sim.held_at),
            # How late the simulated hosts' own loop ran: part of dispatch.
            "bench_loop_lag": bench_lag,
            # How late the control plane's loop ran its probe (every 0.1 s),
            # and its garbage collections.
            "serve": serve_seen,
            "errors": _diff(sim.errors, errors_before),
            "submit_errors": submit_errors,
        }
        report["peak_rss_mib"] = round(serve.peak_rss() / 2**20, 1)
        report["load_average_at_end"] = _load()
        report["targets"] = {
            "idle_cores": {
                "target": TARGETS["idle_cores"],
                "measured": idle["control_plane_cores"],
                "met": idle["control_plane_cores"] < TARGETS["idle_cores"],
            },
            "kib_per_device": {
                "target": TARGETS["kib_per_device"],
                "measured": report["memory"]["kib_per_device"],
                "met": report["memory"]["kib_per_device"] < TARGETS["kib_per_device"],
            },
            "dispatch_p99_ms": {
                "target": TARGETS["dispatch_p99_ms"],
                "measured": report["load"]["dispatch"]["p99_ms"],
                "met": (report["load"]["dispatch"]["p99_ms"] or float("inf"))
                < TARGETS["dispatch_p99_ms"],
            },
        }
        return report
    finally:
        with contextlib.suppress(Exception):
            await sim.stop()
        await events.close()
        await serve.stop()


def _diff(now: Any, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in sorted(now.items()) if v - before.get(k, 0)}
