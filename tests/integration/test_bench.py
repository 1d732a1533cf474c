"""``fleetlease bench`` with tiny sizes, as a subprocess: the JSON report has the
documented shape. The figures themselves are never checked (no timing in tests);
they go into docs/performance.md."""

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
def test_bench_with_tiny_sizes_prints_a_report_of_every_cell(
    pg_server_url: str, nats_url: str
) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleetlease.ops.cli",
            "bench",
            "--hosts",
            "1",
            "--devices-per-host",
            "2",
            "--tasks",
            "20",
            "--renew-leases",
            "6",
            "--recovery-leases",
            "3",
            "--renew-period-s",
            "0.5",
            "--renew-burst-s",
            "0.5",
            "--calibration-s",
            "1",
            "--paced-rate",
            "5",
            "--floor",
            "--cancel-backlog",
            "10",
            "--cancel-count",
            "2",
            "--cancel-lease-s",
            "3",
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
    assert report["setup"]["hosts"] == 1 and report["setup"]["tasks"] == 20
    assert {"agents", "control_plane"} <= set(report["setup"])
    cal = report["calibration"]
    assert set(cal["nats_round_trip"]) == LATENCY_KEYS
    assert {"transition_ceiling_tasks_per_s", "pgbench"} <= set(cal)

    tp = report["throughput"]
    assert tp["tasks"] == 20
    for key in (
        "tasks_per_s",
        "cpu_s_per_task",
        "machine_cpu_s_per_task",
        "commits_per_task",
        "peak_rss_mib",
    ):
        assert isinstance(tp[key], int | float) and tp[key] > 0, key
    assert isinstance(tp["handovers_waited"], int) and tp["handovers_waited"] >= 0
    assert tp["at_half_throughput"]["rate_per_s"] == 5.0
    assert tp["at_half_throughput"]["rate_from"] == "--paced-rate"
    # One at a time, 0.2 s apart: the agents' claims are parked for their idle
    # devices, and are answered by the transaction that assigns.
    assert tp["at_half_throughput"]["claimed_at_assignment"] > 0
    # What one task at a time costs (more than in the saturated run's batches).
    for key in ("cpu_s_per_task", "machine_cpu_s_per_task", "machine_busy_cores"):
        value = tp["at_half_throughput"][key]
        assert isinstance(value, int | float) and value > 0, key
    assert tp["at_half_throughput"]["agents_cpu_s_per_task"] >= 0
    for block in (tp["saturated"], tp["at_half_throughput"]):
        assert set(block["assignment"]) == LATENCY_KEYS
        assert set(block["dispatch"]) == LATENCY_KEYS
        assert block["assignment"]["n"] > 0 and block["dispatch"]["n"] > 0
        assert set(block["phases"]) == {"claim", "ack", "report"}
        assert 0 <= block["claimed_at_assignment"] <= 1
        for phase in block["phases"].values():
            assert set(phase) == LATENCY_KEYS and phase["n"] > 0

    rn = report["renewals"]
    assert rn["leases"] == 6 and rn["claim_timeouts_unrecovered"] == 0
    for key in (
        "rss_per_lease_kib",
        "burst_renewals_per_s",
        "burst_cpu_s_per_renewal",
        "burst_commits_per_renewal",
        "paced_control_plane_cpu_cores",
        "idle_control_plane_cpu_cores",
        "paced_commits_per_renewal",
    ):
        assert key in rn, key
    assert set(rn["paced_round_trip"]) == LATENCY_KEYS

    rc = report["recovery"]
    assert rc["leases"] == 3
    assert rc["lost"] == 0 and rc["duplicated"] == 0
    assert rc["all_leases_served_s"] >= rc["restart_s"] >= 0

    fl = report["floor"]
    assert "error" not in fl, fl
    assert fl["tasks"] == 20 and fl["concurrency"] == 2
    for key in (
        "tasks_per_s",
        "transitions_per_s",
        "process_cpu_s_per_task",
        "machine_cpu_s_per_task",
        "commits_per_task",
    ):
        assert isinstance(fl[key], int | float) and fl[key] > 0, key
    assert {"floor_of_transition_ceiling", "of_floor"} <= set(report["ratios"])

    cx = report["cancel_reach"]
    assert "error" not in cx, cx
    assert cx["running"] == 2 and cx["backlog"] == 10
    assert cx["renewal_interval_s"] == 1.0
    for run in ("quiet", "loaded"):
        c = cx[run]
        assert c["cancels"] == 2
        for key in ("reply", "host", "reply_to_host", "ended", "bench_loop_lag"):
            assert set(c[key]) == LATENCY_KEYS, key
        assert c["reply"]["n"] == c["host"]["n"] == c["ended"]["n"] == 2
        # The intent is committed before the reply: no renewal sent after the
        # reply may miss it.
        assert c["renewals_missing_it"] == 0
    assert cx["loaded"]["load"]["churn_tasks_submitted"] > 0

    assert "of_transition_ceiling" in report["ratios"]
    assert "peers" not in report
