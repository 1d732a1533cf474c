"""The JSON contract of the operator CLI, field by field: one task submitted with
every option set, run on a simulated host, and every documented field of
``submit``, ``tasks``, ``task show``, ``watch``, ``hosts``, ``devices``,
``artifacts`` and ``whoami`` compared with the values submitted or recorded,
not only checked for presence (README, "JSON output")."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from fleetlease.persistence import tables as t
from fleetlease.persistence.model import TaskKind, TaskSpec
from tests.integration import test_ops_cli
from tests.integration.test_ops_cli import ADMIN, Run, SimHost, System, eventually

# The fixtures of the CLI tests: a control plane with the ops API, a simulated host.
system = test_ops_cli.system
host = test_ops_cli.host

REPO_ROOT = Path(__file__).resolve().parents[2]
LIST_ONLY = {"cursor"}
SHOW_ONLY = {"attempts", "payload", "selector", "host_id", "device_id", "waiting_reason"}


def _time(text: Any) -> datetime:
    assert isinstance(text, str), text
    at = datetime.fromisoformat(text)
    assert at.utcoffset() is not None and at.utcoffset().total_seconds() == 0, text
    return at


def _unplaceable() -> TaskSpec:
    """A task no device matches: its one event is ``queued``."""
    return TaskSpec(kind=TaskKind.GOAL, goal="filler", selector={"platform": "none"})


async def test_every_documented_field_carries_the_submitted_value(
    system: System, host: SimHost
) -> None:
    admin = system.admin_token
    cli = system.cli
    assert (await cli("project", "add", "proj", "--owner", ADMIN, token=admin)).code == 0

    # Two watchers, one printing JSON lines, one the piped line view, both
    # parked on the events long-poll before anything happens.
    feed = system.service.ops.feed
    as_json = asyncio.create_task(_watch(system, "--json"))
    await eventually(lambda: _parked(feed), lambda n: n >= 1)
    as_lines = asyncio.create_task(_watch(system))
    await eventually(lambda: _parked(feed), lambda n: n >= 2)

    payload = {"sim": {"outcome": "done"}, "n": [1, 2.5, None, True], "s": "é"}
    submitted = await cli(
        "submit", "--goal", "open settings", "--payload", json.dumps(payload),
        "--selector", "platform=android", "--priority", "7", "--max-attempts", "4",
        "--backoff", "2.5", "--project", "proj", "--request-id", "contract-1", "--json",
        token=admin,
    )  # fmt: skip
    sub = submitted.json()
    assert set(sub) == {"id"}
    tid = sub["id"]
    again = await cli(
        "submit", "--goal", "open settings", "--payload", json.dumps(payload),
        "--selector", "platform=android", "--priority", "7", "--max-attempts", "4",
        "--backoff", "2.5", "--project", "proj", "--request-id", "contract-1", "--json",
        token=admin,
    )  # fmt: skip
    assert again.json() == {"id": tid}

    a = await host.take()
    assert a.task_id == tid
    devices = (await cli("devices", "--json", token=admin)).json()
    assert {(d["host_id"], d["device_id"]) for d in devices} == {("h1", "d0"), ("h1", "d1")}
    for d in devices:
        assert set(d) >= {"host_id", "device_id", "state", "capabilities", "task_id"}
        assert d["capabilities"] == {"platform": "android"}
        assert d["state"] in {"idle", "busy", "offline"}
        assert d["task_id"] == (tid if d["device_id"] == a.device_id else None)

    data = b"\x89PNG" * 50
    await host.client.upload_artifact(tid, a.attempt, a.lease_token, "screen.png", data)
    await host.finish(a, answer=42)

    # --- task show ---------------------------------------------------------------
    show: dict[str, Any] = (await cli("task", "show", tid, "--json", token=admin)).json()
    (db_attempt,) = await system.rows(sa.select(t.attempts).where(t.attempts.c.task_id == tid))
    assert {k: v for k, v in show.items() if k != "attempts"} == {
        "id": tid,
        "state": "done",
        "kind": "goal",
        "goal": "open settings",
        "workflow": None,
        "project": "proj",
        "owner": ADMIN,
        "priority": 7,
        "attempt": 1,
        "max_attempts": 4,
        "retry_at": None,
        "cancel": {"requested": False, "by": None, "at": None},
        "result": {"answer": 42},
        "terminal_reason": "done",
        "reconcile": None,
        "created_at": show["created_at"],
        "updated_at": show["updated_at"],
        "finished_at": show["finished_at"],
        "payload": payload,
        "selector": {"platform": "android"},
        "request_id": "contract-1",
        "waiting_reason": None,
        "host_id": "h1",
        "device_id": a.device_id,
    }
    assert _time(show["created_at"]) <= _time(show["updated_at"])
    assert _time(show["finished_at"]) == _time(show["updated_at"])
    (attempt,) = show["attempts"]
    assert attempt == {
        "number": 1,
        "host_id": "h1",
        "device_id": a.device_id,
        "lease_id": a.lease_id,
        "assigned_at": db_attempt.assigned_at.isoformat(),
        "started_at": db_attempt.acked_at.isoformat(),
        "ended_at": db_attempt.ended_at.isoformat(),
        "end_reason": "done",
        "lease_expires_at": attempt["lease_expires_at"],
    }
    # Started when the host acknowledged it: after the assignment and the claim.
    assert db_attempt.assigned_at <= db_attempt.claimed_at <= db_attempt.acked_at
    assert _time(attempt["started_at"]) <= _time(attempt["ended_at"])
    assert _time(show["created_at"]) <= _time(attempt["assigned_at"])

    # --- tasks: the task show object without the placement and the history -------
    listed = (await cli("tasks", "--json", token=admin)).json()
    assert [x["id"] for x in listed] == [tid]
    expected = {k: v for k, v in show.items() if k not in SHOW_ONLY}
    assert {k: v for k, v in listed[0].items() if k not in LIST_ONLY} == expected
    assert set(listed[0]) == set(expected) | LIST_ONLY
    for flags in (
        ("--state", "done"),
        ("--host", "h1"),
        ("--project", "proj"),
        ("--request-id", "contract-1"),
    ):
        assert [x["id"] for x in (await cli("tasks", *flags, "--json", token=admin)).json()] == [
            tid
        ], flags
    for flags in (("--state", "queued"), ("--project", "default"), ("--request-id", "other")):
        assert (await cli("tasks", *flags, "--json", token=admin)).json() == [], flags

    # --- artifacts, hosts, whoami --------------------------------------------------
    (art,) = (await cli("artifacts", tid, "--json", token=admin)).json()
    assert art == {
        "task_id": tid,
        "attempt": 1,
        "name": "screen.png",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "created_at": art["created_at"],
    }
    assert _time(attempt["started_at"]) <= _time(art["created_at"]) <= _time(show["finished_at"])

    (h,) = (await cli("hosts", "--json", token=admin)).json()
    (generation,) = await system.rows(
        sa.select(t.hosts.c.session_generation, t.hosts.c.last_seen).where(
            t.hosts.c.host_id == "h1"
        )
    )
    assert h == {
        "host_id": "h1",
        "live": True,
        "last_seen": generation.last_seen.isoformat(),
        "session_generation": generation.session_generation,
        "devices": 2,
        "revoked": False,
        # The test's host speaks the protocol without an advert: any workflow.
        "workflows": None,
        "goal_runner": None,
        "drain": None,
    }
    assert (await cli("whoami", "--json", token=admin)).json() == {
        "name": ADMIN,
        "platform_admin": True,
    }

    # --- watch ---------------------------------------------------------------------
    # Tasks no device can take end the watchers (one event each).
    cp = system.service.control_plane
    for _ in range(40):
        if as_json.done() and as_lines.done():
            break
        await cp.submit(_unplaceable())
        await asyncio.wait({as_json, as_lines}, timeout=0.2)
    run_json = await as_json
    run_lines = await as_lines
    assert run_json.code == 0 and run_lines.code == 0, (run_json.err, run_lines.err)
    events = [json.loads(x) for x in run_json.out.splitlines()]
    mine = [e for e in events if e["task_id"] == tid]
    assert mine[0]["state"] == "queued" and mine[-1]["state"] == "done"
    assert {"running", "done"} <= {e["state"] for e in mine}
    for e in mine:
        assert set(e) == {"task_id", "state", "attempt", "host_id", "device_id", "at"}
        _time(e["at"])
        if e["state"] == "queued":
            assert (e["attempt"], e["host_id"], e["device_id"]) == (0, None, None)
        else:
            assert (e["attempt"], e["host_id"], e["device_id"]) == (1, "h1", a.device_id), e
    lines = [x for x in run_lines.out.splitlines() if tid in x]
    assert len(lines) == len(mine)
    assert any(f"h1/{a.device_id}" in x and "done" in x for x in lines), lines


async def _watch(system: System, *flags: str) -> Run:
    """``fleetlease watch`` as a child process, its stdout a pipe."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    for var in ("FLEETLEASE_TOKEN", "FLEETLEASE_NATS_URL", "FLEETLEASE_PREFIX"):
        env.pop(var, None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetlease.ops.cli", "watch", "--max-events", "40",
        "--for", "120", *flags, "--nats-url", system.nats_url, "--prefix", system.prefix,
        "--state-dir", str(system.cli.state_dir), "--token", system.admin_token,
        cwd=REPO_ROOT, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode is not None
    return Run(proc.returncode, out.decode(), err.decode())


def _parked(feed: Any) -> Any:
    async def count() -> int:
        return len(feed._waiters)

    return count()
