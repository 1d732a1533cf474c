"""The metrics listener of a running control plane: ``/metrics`` scraped from a
``fleetlease serve`` process while a host runs tasks (the values move, the label
values stay bounded), ``/healthz``, and ``/readyz`` with ``fleetlease status``
turning not ready (503, exit 6) when PostgreSQL becomes unreachable and ready
again when it is back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import make_url

from fleetlease.ops.service import ControlPlaneService
from fleetlease.ops.testing.faultproxy import FaultProxy
from fleetlease.persistence.model import TaskKind, TaskSpec
from fleetlease.persistence.repository import Repository
from fleetlease.transport import wire
from fleetlease.transport.client import HostClient
from fleetlease.transport.subjects import Subjects
from tests.inbox import request as principal_request
from tests.integration.test_agent import ADMIN, make_system
from tests.integration.test_agent_process import Processes, procs
from tests.integration.test_serve import Serve, host, repo, serve_args, spawn

pytestmark = pytest.mark.embedded
__all__ = ["make_system", "procs", "repo"]  # fixtures of the other integration tests

REPO_ROOT = Path(__file__).resolve().parents[2]

#: The label names each fleetlease metric may carry: nothing else, and never an id.
ALLOWED_LABELS: dict[str, set[str]] = {
    "fleetlease_tasks": {"state", "project"},
    "fleetlease_hosts": {"state"},
    "fleetlease_devices": {"state"},
    "fleetlease_task_transitions": {"state"},
    "fleetlease_commit_duration_seconds": {"kind", "le"},
    "fleetlease_commit_group_size": {"kind", "le"},
    "fleetlease_assignment_latency_seconds": {"le"},
    "fleetlease_dispatch_latency_seconds": {"le"},
    "fleetlease_event_loop_lag_seconds": {"le"},
    "fleetlease_lease_expiries": {"reason"},
    "fleetlease_task_retries": {"reason"},
    "fleetlease_nats_request_errors": {"code"},
    "fleetlease_refusals": {"principal_kind"},
    "fleetlease_nats_slow_consumers": {"connection"},
    "fleetlease_parked_long_polls": {"kind"},
    "fleetlease_broker_auth_decisions": {"decision"},
    "fleetlease_gc_deleted": {"what"},
}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(url: str) -> tuple[Samples, dict[str, set[str]]]:
    """Every sample of ``url``/metrics, and each family's label names."""
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.get(f"{url}/metrics")
    assert resp.status_code == 200, resp.text
    samples: Samples = {}
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(resp.text):
        names = labels.setdefault(family.name, set())
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
            names.update(s.labels)
    return samples, labels


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def until(
    url: str, check: Callable[[Samples], bool], what: str, timeout: float = 30.0
) -> Samples:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        samples, _ = await scrape(url)
        if check(samples):
            return samples
        if asyncio.get_running_loop().time() > deadline:
            fl = {k: v for k, v in samples.items() if k[0].startswith("fleetlease_")}
            raise AssertionError(f"{what} within {timeout}s; fleetlease samples: {fl}")
        await asyncio.sleep(0.2)


async def ops_submit(nats_url: str, prefix: str, user: str, token: str, goal: str) -> None:
    """A submit through the user API (as ``fleetlease submit`` sends it)."""
    nc = await nats.connect(nats_url)
    try:
        s = Subjects(prefix)
        args = {"goal": goal, "project": "default"}
        req = wire.encode(wire.OpsRequest(token=token, verb="submit", args=args))
        reply = wire.decode((await principal_request(nc, s, s.ops(user, "submit"), req)).data).msg
        assert isinstance(reply, wire.OpsReply), reply
    finally:
        await nc.close()


def listening_url(s: Serve) -> str:
    for line in s.stderr:
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("event") == "metrics_listening":
            return str(data["url"])
    raise AssertionError("no metrics_listening line:\n" + "\n".join(s.stderr[-20:]))


@pytest.fixture
async def observed(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> AsyncIterator[Serve]:
    s = await spawn(
        *serve_args(db_url, nats_url, subject_prefix, state_dir),
        "--metrics", "127.0.0.1:0", "--ack-s", "1",
    )  # fmt: skip
    try:
        await s.logged("server_started")
        await s.logged("metrics_listening")
        yield s
    finally:
        s.kill()
        await s.wait()


async def test_metrics_move_as_tasks_run_and_their_labels_stay_bounded(
    observed: Serve, repo: Repository, nats_url: str, subject_prefix: str
) -> None:
    url = listening_url(observed)
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(f"{url}/healthz")).status_code == 200
        ready = await client.get(f"{url}/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["ready"] is True
    assert set(ready.json()["checks"]) == {"database", "migrations", "nats", "actors"}

    before, _ = await scrape(url)
    assert value(before, "fleetlease_database_up") == 1.0
    assert value(before, "process_resident_memory_bytes") > 0

    token = await repo.add_user("alice", platform_admin=True)
    c = await host(repo, nats_url, subject_prefix)
    try:
        # Done: queued -> assigned -> dispatched -> running -> done, with renewals.
        await ops_submit(nats_url, subject_prefix, "alice", token, "done")
        a = await c.claim(wait_s=30)
        assert a is not None
        done_id = a.task_id
        await c.ack(a.task_id, a.attempt, a.lease_token)
        for _ in range(3):
            await c.renew(a.task_id, a.attempt, a.lease_token)
        await c.result(a.task_id, a.attempt, a.lease_token, outcome="done", fingerprint="f")

        # Claimed and never acked: the Reaper expires it (--ack-s 1) into retrying.
        retry_id = await repo.submit(TaskSpec(kind=TaskKind.GOAL, goal="retry"))
        b = await c.claim(wait_s=30)
        assert b is not None and b.task_id == retry_id

        # A host that does not hold its credential is refused.
        impostor = HostClient(
            nats_url=nats_url, host_id="h1", credential="x" * 64, prefix=subject_prefix
        )
        await impostor.connect()
        try:
            with pytest.raises(wire.RemoteError) as refused:
                await impostor.register()
            assert refused.value.code == "unauthorized"
        finally:
            await impostor.close()

        after = await until(
            url,
            lambda s: (
                value(s, "fleetlease_lease_expiries_total", reason="ack_expired") >= 1
                and value(s, "fleetlease_task_transitions_total", state="done") >= 1
            ),
            "the ack expiry and the done task",
        )
        # A claim parked waiting for work shows as a parked long-poll.
        parked = asyncio.ensure_future(c.claim(wait_s=20))
        try:
            await until(
                url,
                lambda s: value(s, "fleetlease_parked_long_polls", kind="claim") >= 1,
                "a parked claim",
            )
        finally:
            parked.cancel()
            with pytest.raises(asyncio.CancelledError):
                await parked
    finally:
        await c.close()

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    for state in ("queued", "assigned", "dispatched", "running", "done", "retrying"):
        assert moved("fleetlease_task_transitions_total", state=state) >= 1, state
    assert moved("fleetlease_task_retries_total", reason="ack_expired") >= 1
    assert moved("fleetlease_commit_duration_seconds_count", kind="transition") >= 3
    assert moved("fleetlease_commit_duration_seconds_count", kind="renew") >= 3
    assert moved("fleetlease_commit_group_size_count", kind="renew") >= 1
    assert moved("fleetlease_lease_renewals_total") >= 3
    # The submit through this process's user API is seen queued, then assigned.
    assert moved("fleetlease_assignment_latency_seconds_count") >= 1
    assert moved("fleetlease_dispatch_latency_seconds_count") >= 2
    assert moved("fleetlease_event_loop_lag_seconds_count") >= 1  # probed every 0.1 s
    assert moved("fleetlease_nats_request_errors_total", code="unauthorized") >= 1
    assert moved("fleetlease_refusals_total", principal_kind="host") >= 1
    assert value(after, "fleetlease_hosts", state="live") == 1
    states = ("idle", "busy", "offline")
    assert sum(value(after, "fleetlease_devices", state=s) for s in states) == 2
    assert (
        value(after, "fleetlease_tasks", state="retrying", project="default")
        + value(after, "fleetlease_tasks", state="assigned", project="default")
        == 1
    )

    # Bounded labels: only the declared label names, and no task or host id anywhere.
    _, label_names = await scrape(url)
    for name, allowed in ALLOWED_LABELS.items():
        assert label_names.get(name, set()) <= allowed, (name, label_names.get(name))
    values = {v for (_, labels) in after for _, v in labels}
    assert not values & {done_id, retry_id, "h1", "h1-d0", "h1-d1"}
    fleet = sorted(n for n in label_names if n.startswith("fleetlease_"))
    print(f"fleetlease metric families exposed: {len(fleet)}; samples: {len(after)}")

    observed.proc.send_signal(signal.SIGTERM)
    assert await observed.wait() == 0


async def run_status(*args: str) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("FLEETLEASE_METRICS_URL", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetlease.ops.cli", "status", *args,
        cwd=REPO_ROOT, env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def readyz(url: str) -> tuple[int, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.get(f"{url}/readyz")
    return resp.status_code, resp.json()


async def until_ready(url: str, ready: bool, timeout: float = 30.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        code, report = await readyz(url)
        if report["ready"] is ready:
            assert code == (200 if ready else 503)
            return report
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"ready is not {ready} within {timeout}s: {report}")
        await asyncio.sleep(0.2)


async def test_readyz_and_status_follow_the_database(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> None:
    u = make_url(db_url)
    proxy = await FaultProxy((u.host or "127.0.0.1", u.port or 5432), name="pg").start()
    through = u.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    service = ControlPlaneService(
        database_url=through,
        nats_url=nats_url,
        state_dir=state_dir,
        prefix=subject_prefix,
        metrics="127.0.0.1:0",
        pool_size=2,
    )
    try:
        await service.start()
        url = service.observer.url
        async with httpx.AsyncClient(timeout=30) as client:
            assert (await client.get(f"{url}/healthz")).status_code == 200
        await until_ready(url, True)
        code, out = await run_status("--metrics-url", url)
        assert code == 0, out
        assert out.startswith("ready")

        proxy.refuse()
        proxy.reset()
        report = await until_ready(url, False)
        checks = report["checks"]
        assert isinstance(checks, dict)
        assert checks["database"]["ok"] is False
        assert checks["nats"]["ok"] is True and checks["actors"]["ok"] is True
        async with httpx.AsyncClient(timeout=30) as client:
            assert (await client.get(f"{url}/healthz")).status_code == 200
            scraped = await client.get(f"{url}/metrics")
        assert scraped.status_code == 200
        assert "fleetlease_database_up 0.0" in scraped.text

        code, out = await run_status("--metrics-url", url, "--json")
        assert code == 6, out
        shown = json.loads(out)
        assert shown["ready"] is False and shown["checks"]["database"]["ok"] is False
        code, out = await run_status("--metrics-url", url)
        assert code == 6 and out.startswith("NOT READY"), out
        assert "database" in out and "FAIL" in out

        proxy.heal()
        await until_ready(url, True)
        code, out = await run_status("--metrics-url", url)
        assert code == 0, out

        # A schema behind the code is not ready either.
        async with service.engine.begin() as conn:
            head = (await conn.execute(sa.text("SELECT version_num FROM alembic_version"))).scalar()
            await conn.execute(sa.text("UPDATE alembic_version SET version_num = 'older'"))
        report = await until_ready(url, False)
        assert report["checks"]["migrations"]["ok"] is False
        assert "older" in report["checks"]["migrations"]["detail"]
        async with service.engine.begin() as conn:
            await conn.execute(
                sa.text("UPDATE alembic_version SET version_num = :head"), {"head": head}
            )
        await until_ready(url, True)
    finally:
        proxy.heal()
        await service.stop()
        await proxy.stop()
    # Nothing listens any more: unavailable.
    code, out = await run_status("--metrics-url", url)
    assert code == 6 and "cannot reach" in out, out


async def test_an_agent_serves_its_metrics_and_readiness_with_metrics_flag(
    procs: Callable[..., Awaitable[Processes]],
) -> None:
    p = await procs()
    system = p.system
    await system.add_host("h-m")
    agent = p.spawn("h-m", devices="simulated:2", extra_args=("--metrics", "127.0.0.1:0"))
    url = str((await agent.wait_event("metrics_listening"))["url"])
    await agent.wait_event("agent_registered")
    await until_ready(url, True)
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(f"{url}/healthz")).status_code == 200

    task_id = await system.submit({"outcome": "hang"})
    await system.wait_state(task_id, "running")
    samples = await until(
        url, lambda s: value(s, "fleetlease_agent_attempts") == 1, "the agent's running attempt"
    )
    assert value(samples, "fleetlease_agent_registered") == 1
    assert value(samples, "fleetlease_agent_registrations_total") >= 1
    assert value(samples, "fleetlease_agent_assignments_total") >= 1
    assert sum(v for (n, _), v in samples.items() if n == "fleetlease_agent_devices") == 2
    assert value(samples, "process_resident_memory_bytes") > 0
    await until(
        url, lambda s: value(s, "fleetlease_event_loop_lag_seconds_count") > 0, "a loop-lag probe"
    )

    await system.cp.cancel(task_id, ADMIN)
    await system.wait_state(task_id, "cancelled")
    agent.proc.send_signal(signal.SIGTERM)
    assert await agent.wait_exit() == 0


async def test_serve_with_a_metrics_address_in_use_exits_6_with_one_line(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        s = await spawn(
            *serve_args(db_url, nats_url, subject_prefix, state_dir),
            "--metrics", f"127.0.0.1:{port}",
        )  # fmt: skip
        code = await s.wait()
    err = "\n".join(s.stderr)
    assert code == 6, err
    assert f"cannot listen on --metrics 127.0.0.1:{port}" in err
    assert "Traceback" not in err
