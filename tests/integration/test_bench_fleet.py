"""``fleetlease bench --fleet`` with a tiny fleet, as a subprocess: the report
has its documented fields and they are sane. The figures themselves are never
checked against a target (no timing in tests); they go into
docs/performance.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

LATENCY_KEYS = {"n", "p50_ms", "p99_ms", "max_ms"}


@pytest.mark.timeout(300)
def test_bench_fleet_with_a_tiny_fleet_reports_every_phase(
    pg_server_url: str, nats_url: str
) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleetlease.ops.cli",
            "bench",
            "--fleet",
            "--hosts",
            "20",
            "--devices-per-host",
            "5",
            "--fleet-idle-s",
            "3",
            "--fleet-load-s",
            "2",
            "--fleet-rate",
            "10",
            "--database-url",
            pg_server_url,
            "--nats-url",
            nats_url,
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)

    assert report["schema"] == 1
    fleet = report["fleet"]
    assert (fleet["hosts"], fleet["devices_per_host"], fleet["devices"]) == (20, 5, 100)
    assert fleet["heartbeat_s"] == 5.0  # the production default, told at registration
    assert fleet["attach_errors"] == {}

    idle = fleet["idle"]
    for key in ("control_plane_cores", "machine_cores", "bench_process_cores"):
        assert idle[key] >= 0
    assert idle["heartbeats_per_s"] > 0
    assert idle["claims_parked_mean"] > 0
    assert idle["control_plane_cpu_ms_per_heartbeat"] > 0
    assert idle["device_rows_written_per_heartbeat"] == 0  # nothing changed
    assert idle["wal_bytes_per_heartbeat"] >= 0
    assert set(idle["heartbeat_round_trip"]) == LATENCY_KEYS
    assert idle["heartbeat_round_trip"]["n"] > 0
    assert idle["errors"] == {}

    memory = fleet["memory"]
    assert 0 < memory["rss_empty_mib"] <= memory["rss_attached_mib"] * 1.5
    assert memory["kib_per_device_whole_rss"] > 0

    load = fleet["load"]
    assert load["tasks"] == 20 and "load_incomplete" not in fleet
    for key in ("assignment", "dispatch"):
        assert set(load[key]) == LATENCY_KEYS
        assert load[key]["n"] == 20
        assert 0 <= load[key]["p50_ms"] <= load[key]["p99_ms"] <= load[key]["max_ms"]
    assert load["errors"] == {}
    assert set(load["bench_loop_lag"]) == LATENCY_KEYS and load["bench_loop_lag"]["n"] > 0
    serve = load["serve"]
    assert serve["loop_lag_probes"] > 0  # the load phase lasts seconds; a probe every 0.1 s
    shares = serve["loop_lag_share_later_than_ms"]
    assert set(shares) == {"1", "2.5", "5", "10", "25", "50", "100"}
    assert all(0 <= v <= 1 for v in shares.values())
    assert list(shares.values()) == sorted(shares.values(), reverse=True)
    assert set(serve["gc_collections"]) == {"0", "1", "2"}

    targets = fleet["targets"]
    assert set(targets) == {"idle_cores", "kib_per_device", "dispatch_p99_ms"}
    for t in targets.values():
        assert {"target", "measured", "met"} == set(t)
