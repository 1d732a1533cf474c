"""The operator CLI end to end: ``ops.cli.main`` talking over a real NATS to a
control plane (``ControlPlaneService``, with ``ops/userapi`` behind the ops
subjects) on a real PostgreSQL. A host is simulated with the signed
``HostClient`` so that tasks really run, log, upload and finish.

Every output of every command goes through ``Cli.__call__``, which keeps it, so
that the last test of each scenario can scan them all for secrets.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
import structlog

from fleetlease.ops.cli import main
from fleetlease.ops.service import ControlPlaneService
from fleetlease.persistence import tables as t
from fleetlease.persistence.model import LeaseTimings
from fleetlease.transport import wire
from fleetlease.transport.auth import ServerSecret
from fleetlease.transport.client import HostClient

T = TypeVar("T")

ADMIN = "admin"

TASK_KEYS = {
    "id",
    "state",
    "kind",
    "attempt",
    "max_attempts",
    "retry_at",
    "cancel",
    "result",
    "reconcile",
}
ATTEMPT_KEYS = {
    "number",
    "host_id",
    "device_id",
    "lease_id",
    "started_at",
    "ended_at",
    "end_reason",
}


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        assert self.code == 0, (self.code, self.err)
        return json.loads(self.out)


@dataclass
class Cli:
    """Runs ``fleetlease ARGS`` in a thread (it calls ``asyncio.run``) against the
    test's NATS and prefix, capturing what it prints."""

    capsys: pytest.CaptureFixture[str]
    nats_url: str
    prefix: str
    state_dir: Path
    outputs: list[str] = field(default_factory=list)

    async def __call__(self, *argv: str, token: str | None = None) -> Run:
        self.capsys.readouterr()
        full = [*argv, "--nats-url", self.nats_url, "--prefix", self.prefix]
        full += ["--state-dir", str(self.state_dir), "--timeout", "20"]
        if token is not None:
            full += ["--token", token]
        try:
            code = await asyncio.to_thread(main, full)
        except SystemExit as exc:  # argparse usage errors
            code = int(exc.code or 0)
        captured = self.capsys.readouterr()
        self.outputs.append(captured.out + captured.err)
        return Run(code, captured.out, captured.err)


@dataclass
class System:
    service: ControlPlaneService
    cli: Cli
    admin_token: str
    db_url: str
    nats_url: str
    prefix: str

    @property
    def repo(self) -> Any:
        return self.service.repo

    async def user(self, name: str, *, platform_admin: bool = False) -> str:
        argv = ["user", "add", name, "--json"]
        if platform_admin:
            argv.append("--platform-admin")
        data = (await self.cli(*argv, token=self.admin_token)).json()
        token: str = data["token"]
        return token

    async def submit(self, token: str, *argv: str) -> str:
        data = (await self.cli("submit", *argv, "--json", token=token)).json()
        task_id: str = data["id"]
        return task_id

    async def show(self, task_id: str, token: str | None = None) -> dict[str, Any]:
        data: dict[str, Any] = (
            await self.cli("task", "show", task_id, "--json", token=token or self.admin_token)
        ).json()
        return data

    async def scalar(self, query: Any) -> Any:
        assert self.service.engine is not None
        async with self.service.engine.connect() as conn:
            return (await conn.execute(query)).scalar()

    async def rows(self, query: Any) -> list[Any]:
        assert self.service.engine is not None
        async with self.service.engine.connect() as conn:
            return list((await conn.execute(query)).all())


async def eventually(
    probe: Callable[[], Awaitable[T]], ok: Callable[[T], bool], timeout: float = 30.0
) -> T:
    """Poll ``probe`` until ``ok`` holds (a condition, never a fixed sleep)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    value = await probe()
    while not ok(value):
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s; last value {value!r}")
        await asyncio.sleep(0.05)
        value = await probe()
    return value


@pytest.fixture
async def system(
    db_url: str,
    nats_url: str,
    subject_prefix: str,
    state_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[System]:
    for var in ("FLEETLEASE_TOKEN", "FLEETLEASE_NATS_URL", "FLEETLEASE_PREFIX"):
        monkeypatch.delenv(var, raising=False)
    # The in-process control plane logs; keep that out of the CLI output we check.
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    service = ControlPlaneService(
        database_url=db_url,
        nats_url=nats_url,
        state_dir=state_dir,
        prefix=subject_prefix,
        migrate=False,
        timings=LeaseTimings(claim_s=30, ack_s=15, lease_s=30),
        scheduler_interval_s=0.2,
    )
    await service.start()
    try:
        assert service.repo is not None
        admin_token = await service.repo.add_user(ADMIN, platform_admin=True)
        await service.repo.add_project("default", owner=ADMIN)
        cli = Cli(capsys, nats_url, subject_prefix, state_dir)
        yield System(service, cli, admin_token, db_url, nats_url, subject_prefix)
    finally:
        await service.stop()
        structlog.reset_defaults()


@dataclass
class SimHost:
    """A host driven step by step through the signed host protocol."""

    client: HostClient
    credential: str
    session_keys: list[bytes] = field(default_factory=list)
    lease_tokens: list[str] = field(default_factory=list)

    async def start(self, devices: int = 2) -> None:
        await self.client.connect()
        ok = await self.client.register()
        self.session_keys.append(ok.session_key)
        await self.client.heartbeat(
            [
                wire.Device(device_id=f"d{i}", state="idle", capabilities={"platform": "android"})
                for i in range(devices)
            ]
        )

    async def take(self, wait_s: float = 10.0) -> wire.Assignment:
        assignment = await self.client.claim(wait_s)
        assert assignment is not None, "no assignment arrived"
        self.lease_tokens.append(assignment.lease_token)
        await self.client.ack(assignment.task_id, assignment.attempt, assignment.lease_token)
        return assignment

    async def finish(self, a: wire.Assignment, outcome: str = "done", **result: Any) -> None:
        await self.client.result(
            a.task_id,
            a.attempt,
            a.lease_token,
            outcome=outcome,
            result=result or {"ok": outcome == "done"},
            fingerprint=f"{a.task_id}:{a.attempt}:{outcome}",
        )


@pytest.fixture
async def host(system: System) -> AsyncIterator[SimHost]:
    run = await system.cli("host", "add", "h1", "--json", token=system.admin_token)
    credential = run.json()["token"]
    client = HostClient(
        nats_url=system.nats_url, host_id="h1", credential=credential, prefix=system.prefix
    )
    sim = SimHost(client, credential)
    await sim.start()
    try:
        yield sim
    finally:
        await client.close()


# --- users, projects, roles -----------------------------------------------------------


async def test_user_add_prints_a_token_once_that_then_identifies_the_user(
    system: System,
) -> None:
    run = await system.cli("user", "add", "alice", token=system.admin_token)
    assert run.code == 0, run.err
    token = run.out.strip().splitlines()[-1]
    assert len(token) == 64
    who = await system.cli("whoami", "--json", token=token)
    assert who.json() == {"name": "alice", "platform_admin": False}
    stored = await system.scalar(sa.select(t.users.c.token_hash).where(t.users.c.name == "alice"))
    assert bytes(stored) != token.encode()
    again = await system.cli("user", "add", "alice", token=system.admin_token)
    assert again.code == 5, again.err
    assert token not in again.out + again.err


async def test_project_add_gives_owner_and_admins_their_roles(system: System) -> None:
    await system.user("alice")
    await system.user("bob")
    run = await system.cli(
        "project",
        "add",
        "p1",
        "--owner",
        "alice",
        "--admin",
        "bob",
        "--json",
        token=system.admin_token,
    )
    assert run.json() == {"name": "p1", "owner": "alice", "admins": ["bob"]}
    table = await system.cli("project", "add", "p2", "--owner", "alice", token=system.admin_token)
    assert table.code == 0 and "p2" in table.out


async def test_owner_project_admin_and_platform_admin_may_read_and_cancel_others_may_not(
    system: System,
) -> None:
    alice = await system.user("alice")
    bob = await system.user("bob")
    carol = await system.user("carol", platform_admin=True)
    dave = await system.user("dave")
    await system.cli(
        "project", "add", "p1", "--owner", "alice", "--admin", "bob", token=system.admin_token
    )
    ids = [await system.submit(alice, "--goal", f"g{i}", "--project", "p1") for i in range(3)]

    for token in (alice, bob, carol):
        assert (await system.show(ids[0], token))["owner"] == "alice"

    # A user with no role: forbidden on every read and on cancel, and nothing written.
    for argv in (
        ("task", "show", ids[0]),
        ("cancel", ids[0]),
        ("logs", ids[0]),
        ("artifacts", ids[0]),
    ):
        run = await system.cli(*argv, token=dave)
        assert run.code == 3, (argv, run.code, run.err)
        assert "forbidden" in run.err
        assert run.out == ""
    cancel_cols = await system.rows(
        sa.select(t.tasks.c.status, t.tasks.c.cancel_requested_at).where(t.tasks.c.id == ids[0])
    )
    assert cancel_cols == [("queued", None)]
    listed = (await system.cli("tasks", "--json", token=dave)).json()
    assert listed == []

    for token, task_id, who in (
        (alice, ids[0], "alice"),
        (bob, ids[1], "bob"),
        (carol, ids[2], "carol"),
    ):
        rec = (await system.cli("cancel", task_id, "--json", token=token)).json()
        assert rec["id"] == task_id
        assert rec["state"] == "cancelled" and rec["completed"] is True
        assert rec["cancel"]["requested"] is True and rec["cancel"]["by"] == who
        # Idempotent: repeating returns the first intent.
        again = (await system.cli("cancel", task_id, "--json", token=carol)).json()
        assert again["state"] == "cancelled"
        assert again["cancel"]["by"] == who


async def test_submitting_into_a_project_needs_a_role_on_it(system: System) -> None:
    await system.user("alice")
    dave = await system.user("dave")
    await system.cli("project", "add", "p1", "--owner", "alice", token=system.admin_token)
    run = await system.cli("submit", "--goal", "x", "--project", "p1", token=dave)
    assert run.code == 3 and "forbidden" in run.err
    run = await system.cli("submit", "--goal", "x", "--project", "nope", token=dave)
    assert run.code == 4 and "not found" in run.err
    assert await system.scalar(sa.select(sa.func.count()).select_from(t.tasks)) == 0


async def test_admin_verbs_need_a_platform_admin(system: System) -> None:
    alice = await system.user("alice")
    for argv in (
        ("user", "add", "eve"),
        ("project", "add", "p", "--owner", "alice"),
        ("host", "add", "hx"),
        ("host", "revoke", "hx"),
        ("host", "list"),
    ):
        run = await system.cli(*argv, token=alice)
        assert run.code == 3, (argv, run.err)
        assert run.err.count("\n") == 1
    assert await system.scalar(sa.select(sa.func.count()).select_from(t.users)) == 2
    assert await system.scalar(sa.select(sa.func.count()).select_from(t.hosts)) == 0


# --- commands and their JSON shapes -------------------------------------------------------


async def test_every_command_has_its_documented_json_shape(system: System, host: SimHost) -> None:
    admin = system.admin_token
    task_id = await system.submit(
        admin,
        "--goal",
        "open settings",
        "--payload",
        '{"sim": {"outcome": "done"}}',
        "--selector",
        "platform=android",
        "--priority",
        "5",
        "--max-attempts",
        "2",
    )
    uuid.UUID(task_id)
    a = await host.take()
    assert a.task_id == task_id
    await host.client.append_logs(task_id, a.attempt, 0, ["hello", "world"])
    await host.client.upload_artifact(
        task_id, a.attempt, a.lease_token, "screen.png", b"\x89PNG" * 100
    )
    await host.finish(a, answer=42)

    task = await system.show(task_id)
    assert task.keys() >= TASK_KEYS
    assert task["state"] == "done" and task["kind"] == "goal"
    assert task["attempt"] == 1 and task["max_attempts"] == 2
    assert task["cancel"] == {"requested": False, "by": None, "at": None}
    assert task["result"] == {"answer": 42}
    assert task["retry_at"] is None
    assert len(task["attempts"]) == 1
    attempt = task["attempts"][0]
    assert attempt.keys() >= ATTEMPT_KEYS
    assert attempt["number"] == 1 and attempt["host_id"] == "h1"
    assert attempt["device_id"] == a.device_id and attempt["lease_id"] == a.lease_id
    assert attempt["started_at"] and attempt["ended_at"] and attempt["end_reason"] == "done"

    listed = (await system.cli("tasks", "--json", token=admin)).json()
    assert [x["id"] for x in listed] == [task_id]
    assert listed[0].keys() >= TASK_KEYS and "attempts" not in listed[0]
    assert (await system.cli("tasks", "--state", "queued", "--json", token=admin)).json() == []
    by_host = (await system.cli("tasks", "--host", "h1", "--json", token=admin)).json()
    assert [x["id"] for x in by_host] == [task_id]

    logs = (await system.cli("logs", task_id, "--json", token=admin)).json()
    assert logs["state"] == "done" and logs["terminal"] is True
    assert [line["line"] for line in logs["lines"]] == ["hello", "world"]
    assert {"id", "attempt", "seq", "ts", "line"} <= logs["lines"][0].keys()

    arts = (await system.cli("artifacts", task_id, "--json", token=admin)).json()
    assert [(x["name"], x["size"], x["attempt"]) for x in arts] == [("screen.png", 400, 1)]
    assert arts[0]["sha256"] == hashlib.sha256(b"\x89PNG" * 100).hexdigest()
    assert "object_name" not in arts[0]

    hosts = (await system.cli("hosts", "--json", token=admin)).json()
    assert len(hosts) == 1
    h = hosts[0]
    assert {"host_id", "live", "last_seen", "session_generation", "devices"} <= h.keys()
    assert h["host_id"] == "h1" and h["live"] is True and h["devices"] == 2

    devices = (await system.cli("devices", "--json", token=admin)).json()
    assert sorted(d["device_id"] for d in devices) == ["d0", "d1"]
    for d in devices:
        assert {"host_id", "device_id", "state", "capabilities", "task_id"} <= d.keys()
        assert d["capabilities"] == {"platform": "android"}

    listing = (await system.cli("host", "list", "--json", token=admin)).json()
    assert [x["host_id"] for x in listing] == ["h1"]

    who = (await system.cli("whoami", "--json", token=admin)).json()
    assert who == {"name": "admin", "platform_admin": True}

    many = (
        await system.cli("submit", "--workflow", "wf", "--count", "3", "--json", token=admin)
    ).json()
    assert len(many["ids"]) == 3 and len(set(many["ids"])) == 3

    rec = (await system.cli("cancel", many["ids"][0], "--json", token=admin)).json()
    assert set(rec) == {"id", "state", "cancel", "completed", "already_ended"}
    assert set(rec["cancel"]) == {"requested", "by", "at"}


async def test_tables_are_printed_without_json(system: System, host: SimHost) -> None:
    admin = system.admin_token
    task_id = await system.submit(admin, "--goal", "open settings")
    a = await host.take()
    await host.client.append_logs(task_id, a.attempt, 0, ["a line"])
    await host.finish(a)
    for argv, expected in (
        (("tasks",), task_id),
        (("task", "show", task_id), "open settings"),
        (("hosts",), "h1"),
        (("devices",), "d1"),
        (("host", "list"), "h1"),
        (("logs", task_id), "a line"),
        (("artifacts", task_id), "no artifacts"),
        (("whoami",), "admin"),
    ):
        run = await system.cli(*argv, token=admin)
        assert run.code == 0, (argv, run.err)
        assert expected in run.out, (argv, run.out)
        with pytest.raises(ValueError):
            json.loads(run.out)
    plain = await system.cli("submit", "--goal", "x", token=admin)
    assert uuid.UUID(plain.out.strip())


async def test_submit_count_submits_every_task_in_batches(system: System) -> None:
    run = await system.cli(
        "submit", "--goal", "bulk", "--count", "250", "--json", token=system.admin_token
    )
    ids = run.json()["ids"]
    assert len(set(ids)) == 250
    assert await system.scalar(sa.select(sa.func.count()).select_from(t.tasks)) == 250


async def test_a_submit_repeated_with_its_request_id_returns_the_first_tasks(
    system: System,
) -> None:
    admin = system.admin_token
    one = await system.submit(admin, "--goal", "once", "--request-id", "deploy-42")
    assert await system.submit(admin, "--goal", "once", "--request-id", "deploy-42") == one
    assert (await system.show(one))["request_id"] == "deploy-42"

    argv = ("submit", "--goal", "bulk", "--count", "150", "--request-id", "bulk-7", "--json")
    first = (await system.cli(*argv, token=admin)).json()["ids"]
    again = (await system.cli(*argv, token=admin)).json()["ids"]
    assert again == first and len(set(first)) == 150
    assert await system.scalar(sa.select(sa.func.count()).select_from(t.tasks)) == 151

    # The same key for another task is refused, and writes nothing.
    run = await system.cli("submit", "--goal", "twice", "--request-id", "deploy-42", token=admin)
    assert run.code == 5 and "request_id" in run.err
    run = await system.cli("submit", "--goal", "x", "--request-id", "a#1", token=admin)
    assert run.code == 2 and "request_id" in run.err
    assert await system.scalar(sa.select(sa.func.count()).select_from(t.tasks)) == 151


async def test_cancel_of_a_running_task_reaches_the_host_and_ends_cancelled(
    system: System, host: SimHost
) -> None:
    admin = system.admin_token
    task_id = await system.submit(
        admin, "--goal", "hang", "--payload", '{"sim": {"outcome": "hang"}}'
    )
    a = await host.take()
    rec = (await system.cli("cancel", task_id, "--json", token=admin)).json()
    assert rec["completed"] is False and rec["cancel"]["requested"] is True
    status = await host.client.renew(a.task_id, a.attempt, a.lease_token)
    assert status.cancel_requested is True
    await host.finish(a, "cancelled")
    task = await system.show(task_id)
    assert task["state"] == "cancelled"
    assert task["cancel"]["by"] == "admin"
    assert task["attempts"][0]["end_reason"] == "cancelled"


async def test_logs_follow_pages_until_the_task_is_terminal(system: System, host: SimHost) -> None:
    admin = system.admin_token
    task_id = await system.submit(admin, "--goal", "chatty")
    a = await host.take()
    await host.client.append_logs(task_id, a.attempt, 0, [f"line {i}" for i in range(5)])

    async def host_side() -> None:
        for first in range(5, 1500, 500):
            lines = [f"line {i}" for i in range(first, min(first + 500, 1500))]
            await host.client.append_logs(task_id, a.attempt, first, lines)
        await host.finish(a)

    follower = asyncio.create_task(system.cli("logs", task_id, "--follow", "--json", token=admin))
    await host_side()
    run = await asyncio.wait_for(follower, 60)
    assert run.code == 0, run.err
    lines = [json.loads(x)["line"] for x in run.out.splitlines()]
    assert lines == [f"line {i}" for i in range(1500)]


async def test_artifacts_download_writes_the_bytes(
    system: System, host: SimHost, tmp_path: Path
) -> None:
    admin = system.admin_token
    task_id = await system.submit(admin, "--goal", "shoot")
    a = await host.take()
    data = bytes(range(256)) * 4000  # ~1 MB: several slices
    await host.client.upload_artifact(task_id, a.attempt, a.lease_token, "blob.bin", data)
    await host.finish(a)
    target = tmp_path / "out.bin"
    run = await system.cli(
        "artifacts", task_id, "--get", "blob.bin", "--output", str(target), "--json", token=admin
    )
    info = run.json()
    assert target.read_bytes() == data
    assert info["sha256"] == hashlib.sha256(data).hexdigest() and info["size"] == len(data)
    dave = await system.user("dave")
    denied = await system.cli("artifacts", task_id, "--get", "blob.bin", token=dave)
    assert denied.code == 3


async def test_watch_prints_one_line_per_state_change_when_piped(system: System) -> None:
    admin = system.admin_token
    watcher = asyncio.create_task(
        system.cli("watch", "--json", "--max-events", "2", "--for", "60", token=admin)
    )
    ids: list[str] = []

    async def submit_until_seen() -> list[str]:
        # The subscription starts inside the thread: submit until it has seen two.
        while not watcher.done():
            ids.append(await system.service.control_plane.submit(_spec()))
            await asyncio.sleep(0.2)
        return ids

    await asyncio.wait_for(submit_until_seen(), 60)
    run = watcher.result()
    assert run.code == 0, run.err
    events = [json.loads(x) for x in run.out.splitlines()]
    assert len(events) == 2
    for e in events:
        assert e["task_id"] in ids and e["state"] == "queued"
        assert set(e) == {"task_id", "state", "attempt", "host_id", "device_id", "at"}


async def test_watch_hides_tasks_the_user_may_not_read(system: System) -> None:
    alice = await system.user("alice")
    await system.cli("project", "add", "pa", "--owner", "alice", token=system.admin_token)
    watcher = asyncio.create_task(system.cli("watch", "--json", "--for", "3", token=alice))
    mine: list[str] = []
    theirs: list[str] = []
    while not watcher.done():
        theirs.append(await system.service.control_plane.submit(_spec()))
        mine.append(await system.service.control_plane.submit(_spec(owner="alice", project="pa")))
        await asyncio.sleep(0.2)
    run = watcher.result()
    seen = {json.loads(x)["task_id"] for x in run.out.splitlines()}
    assert seen and seen <= set(mine)


def _spec(owner: str = ADMIN, project: str = "default") -> Any:
    from fleetlease.persistence.model import TaskKind, TaskSpec

    return TaskSpec(kind=TaskKind.GOAL, goal="watched", owner=owner, project=project)


async def test_host_revoke_ends_the_hosts_sessions(system: System, host: SimHost) -> None:
    run = await system.cli("host", "revoke", "h1", "--json", token=system.admin_token)
    data = run.json()
    assert data["host_id"] == "h1" and data["revoked"] is True and data["ended"] == []
    with pytest.raises(wire.RemoteError) as err:
        await host.client.heartbeat([])
    assert err.value.code == "unauthorized"
    assert (await system.cli("hosts", "--json", token=system.admin_token)).json() == []
    listing = (await system.cli("host", "list", "--json", token=system.admin_token)).json()
    assert listing[0]["revoked"] is True


# --- failures and exit codes ---------------------------------------------------------------


async def test_failures_print_one_line_and_exit_with_the_code_of_their_kind(
    system: System,
) -> None:
    admin = system.admin_token
    missing = str(uuid.uuid4())
    cases = [
        (("task", "show", missing), admin, 4),
        (("cancel", missing), admin, 4),
        (("task", "show", "not-a-uuid"), admin, 2),
        (("tasks", "--state", "sleeping"), admin, 2),
        (("submit", "--goal", "x", "--payload", "[1]"), admin, 2),
        (("submit", "--goal", "x", "--workflow", "y"), admin, 2),
        (("submit", "--goal", "x", "--selector", "novalue"), admin, 2),
        (("whoami",), "0" * 64, 3),
        (("whoami",), "", 3),
        (("user", "add", "admin"), admin, 5),
        (("user", "add", "bad name"), admin, 2),
        (("host", "revoke", "nohost"), admin, 4),
    ]
    for argv, token, code in cases:
        run = await system.cli(*argv, token=token or None)
        assert run.code == code, (argv, run.code, run.err)
        assert run.out == "", (argv, run.out)
        assert run.err.strip(), argv
        assert "Traceback" not in run.err
        assert run.err.count("\n") == 1, (argv, run.err)  # usage errors too


async def test_no_control_plane_answering_is_unavailable(
    system: System, capsys: pytest.CaptureFixture[str]
) -> None:
    cli = Cli(capsys, system.nats_url, system.prefix + "x", system.cli.state_dir)
    run = await cli("tasks", token=system.admin_token)
    assert run.code == 6 and "no control plane" in run.err
    nowhere = Cli(capsys, "nats://127.0.0.1:1", system.prefix, system.cli.state_dir)
    run = await nowhere("tasks", token=system.admin_token)
    assert run.code == 6 and "cannot reach NATS" in run.err


async def test_the_token_comes_from_the_environment_or_the_context_file(
    system: System, monkeypatch: pytest.MonkeyPatch, state_dir: Path
) -> None:
    alice = await system.user("alice")
    monkeypatch.setenv("FLEETLEASE_TOKEN", alice)
    assert (await system.cli("whoami", "--json")).json()["name"] == "alice"
    monkeypatch.delenv("FLEETLEASE_TOKEN")
    token_file = state_dir / "admin.token"
    token_file.write_text(system.admin_token + "\n")
    (state_dir / "context.json").write_text(
        json.dumps(
            {
                "nats_url": system.nats_url,
                "prefix": system.prefix,
                "admin_token_path": str(token_file),
            }
        )
    )
    assert (await system.cli("whoami", "--json")).json()["name"] == "admin"
    token_file.unlink()
    run = await system.cli("whoami")
    assert run.code == 3 and "no user token" in run.err


async def test_direct_mode_creates_the_first_admin_without_a_token(system: System) -> None:
    run = await system.cli(
        "user", "add", "root", "--platform-admin", "--database-url", system.db_url, "--json"
    )
    data = run.json()
    assert data["name"] == "root" and data["platform_admin"] is True
    who = (await system.cli("whoami", "--json", token=data["token"])).json()
    assert who == {"name": "root", "platform_admin": True}
    run = await system.cli(
        "project", "add", "rp", "--owner", "root", "--direct", "--database-url", system.db_url
    )
    assert run.code == 0, run.err


# --- the safe projection ----------------------------------------------------------------------


def _forms(secret: bytes | str) -> set[str]:
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    forms = {raw.hex(), raw.hex().upper(), base64.b64encode(raw).decode(), repr(raw)}
    if isinstance(secret, str):
        forms.add(secret)
        digest = hashlib.sha256(secret.encode()).digest()
        forms |= {digest.hex(), base64.b64encode(digest).decode()}
    return {f for f in forms if len(f) >= 16}


async def test_no_output_of_any_command_contains_a_lease_token_hash_credential_or_session_key(
    system: System, host: SimHost, tmp_path: Path
) -> None:
    admin = system.admin_token
    alice = await system.user("alice")
    user_add_outputs = len(system.cli.outputs)
    await system.cli("project", "add", "pa", "--owner", "alice", token=admin)

    # Tasks in every interesting state: done (logs + artifact), cancelled while
    # running, retrying after a retryable failure, queued.
    done_id = await system.submit(alice, "--goal", "done", "--project", "pa")
    a = await host.take()
    await host.client.append_logs(done_id, a.attempt, 0, ["log"])
    await host.client.upload_artifact(done_id, a.attempt, a.lease_token, "a.txt", b"artifact")
    await host.finish(a)
    hang_id = await system.submit(alice, "--goal", "hang", "--project", "pa")
    b = await host.take()
    await system.cli("cancel", hang_id, token=alice)
    await host.client.renew(b.task_id, b.attempt, b.lease_token)
    retry_id = await system.submit(
        alice, "--goal", "retry", "--max-attempts", "3", "--project", "pa"
    )
    c = await host.take()
    await host.client.result(
        c.task_id,
        c.attempt,
        c.lease_token,
        outcome="failed",
        retryable=True,
        reason="flaky",
        fingerprint="f1",
    )
    queued_id = await system.submit(alice, "--goal", "wait", "--project", "pa")

    commands: list[tuple[str, ...]] = [("tasks",), ("whoami",), ("hosts",), ("devices",)]
    for x in (done_id, hang_id, retry_id, queued_id):
        commands += [("task", "show", x), ("logs", x), ("artifacts", x)]
    for token in (admin, alice):
        for json_flag in ((), ("--json",)):
            for argv in commands:
                run = await system.cli(*argv, *json_flag, token=token)
                assert run.code == 0, (argv, run.err)
    await system.cli(
        "artifacts", done_id, "--get", "a.txt", "-o", str(tmp_path / "a"), "--json", token=alice
    )
    await system.cli("host", "list", token=admin)
    await system.cli("host", "list", "--json", token=admin)
    await system.cli("cancel", hang_id, "--json", token=alice)
    await system.cli("cancel", queued_id, token=admin)
    await system.cli("host", "revoke", "h1", "--json", token=admin)

    # Every secret that exists in the system, raw and as stored.
    secrets: set[str] = set()
    for token in host.lease_tokens:
        secrets |= _forms(token)
    for key in host.session_keys:
        secrets |= _forms(key)
    for (h,) in await system.rows(sa.select(t.attempts.c.lease_token_hash)):
        if h is not None:
            secrets |= _forms(bytes(h))
    for (h,) in await system.rows(sa.select(t.hosts.c.credential_hash)):
        secrets |= _forms(bytes(h))
    for (h,) in await system.rows(sa.select(t.users.c.token_hash)):
        secrets |= _forms(bytes(h))
    secrets |= _forms(ServerSecret.load_or_create(system.cli.state_dir / "server.secret").value)
    assert len(host.lease_tokens) == 3 and host.session_keys

    outputs = system.cli.outputs
    assert len(outputs) > 60
    for i, text in enumerate(outputs):
        for s in secrets:
            assert s not in text, f"output {i} leaks a secret"
        # The one-time secrets appear only in the output of the command that made
        # them: the host credential in `host add` (output 0), alice's token in
        # her `user add`; the admin's token never.
        if i > 0:
            assert host.credential not in text, f"output {i} leaks the host credential"
        if i != user_add_outputs - 1:
            assert alice not in text, f"output {i} leaks a user token"
        assert admin not in text, f"output {i} leaks the admin token"
