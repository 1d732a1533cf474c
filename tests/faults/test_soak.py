"""``fleetlease soak`` as CI runs it: about a minute of seeded faults (serve
SIGKILL, PostgreSQL and NATS restarts, proxy faults, agent partitions, pauses
and kills, actor kills inside a serve) against the whole system of real
processes. The deck deals every fault kind once (shuffled) before any repeats;
with seed 7 ``actor_kill`` is the fourth fault, well inside the minute.

Invariant: zero violations of ``fleetlease.ops.testing.invariants`` and every task finished; the
recovery times are printed figures, not asserted. The 15-minute, 5,000-task
target runs with ``--soak``."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from fleetlease.ops.testing.cluster import REPO_ROOT, child_env


async def soak(tmp_path: Path, *args: str, timeout: float) -> dict[str, object]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetlease.ops.cli", "soak", "--json",
        "--dir", str(tmp_path / "soak"), *args,
        cwd=REPO_ROOT, env=child_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode in (0, 1), err.decode(errors="replace")[-3000:]
    stderr = err.decode(errors="replace")[-3000:]
    assert out.strip(), f"no report (exit {proc.returncode}): {stderr}"
    report: dict[str, object] = json.loads(out)
    print(json.dumps({k: v for k, v in report.items() if k != "faults"}, indent=1))
    for f in report["faults"]:  # type: ignore[attr-defined]
        print(f"  {f['at_s']:6.1f}s {f['kind']:<16} recovery {f['recovery_s']}  {f['detail']}")
    return report


@pytest.mark.chaos
@pytest.mark.timeout(300)
async def test_a_one_minute_soak_has_zero_invariant_violations(tmp_path: Path) -> None:
    report = await soak(tmp_path, "--minutes", "1", "--seed", "7", timeout=280)
    assert report["violations"] == []
    assert report["unfinished"] == 0
    assert report["ok"] is True
    assert report["submitted"] > 0 and report["faults"], "the soak injected nothing"  # type: ignore[operator]
    kills = [f for f in report["faults"] if f["kind"] == "actor_kill"]  # type: ignore[attr-defined]
    assert kills, report["faults_by_kind"]
    assert all("restarted" in f["detail"] for f in kills), kills


@pytest.mark.soak
@pytest.mark.timeout(1500)
async def test_a_fifteen_minute_soak_of_5000_tasks_has_zero_invariant_violations(
    tmp_path: Path,
) -> None:
    report = await soak(
        tmp_path, "--minutes", "15", "--seed", "15", "--rate", "6", "--hosts", "4",
        "--devices", "4", timeout=1450,
    )  # fmt: skip
    assert report["violations"] == []
    assert report["unfinished"] == 0
    assert report["submitted"] >= 5000  # type: ignore[operator]
