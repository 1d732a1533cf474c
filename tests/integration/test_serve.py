"""``fleetlease serve`` as a real subprocess against the test PostgreSQL and NATS:
it serves a host end to end, stops cleanly on SIGTERM (in-flight replies sent,
exit 0), logs JSON on stderr when that is not a terminal, and refuses to start
with one clear line (exit 6, no traceback) when a server is unreachable."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest

from fleetlease.persistence.db import create_engine
from fleetlease.persistence.model import TaskKind, TaskSpec, User
from fleetlease.persistence.repository import Repository
from fleetlease.transport import wire
from fleetlease.transport.client import HostClient
from fleetlease.transport.subjects import Subjects
from tests.inbox import request as principal_request

pytestmark = pytest.mark.embedded

REPO_ROOT = Path(__file__).resolve().parents[2]
ADMIN = User(name="admin", platform_admin=True)


class Serve:
    """A ``fleetlease serve`` child; its stderr collected line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.stderr: list[str] = []
        self.stdout: list[str] = []
        self._events: dict[str, asyncio.Event] = {}
        self._readers = [
            asyncio.ensure_future(self._read(proc.stderr, self.stderr)),
            asyncio.ensure_future(self._read(proc.stdout, self.stdout)),
        ]

    async def _read(self, stream: asyncio.StreamReader | None, into: list[str]) -> None:
        assert stream is not None
        while line := await stream.readline():
            text = line.decode(errors="replace").rstrip("\n")
            into.append(text)
            event = _event_of(text)
            if event is not None:
                self._events.setdefault(event, asyncio.Event()).set()

    async def logged(self, event: str, timeout: float = 60.0) -> None:
        ev = self._events.setdefault(event, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except TimeoutError:
            raise AssertionError(
                f"{event} not logged; stderr:\n" + "\n".join(self.stderr[-40:])
            ) from None

    async def wait(self, timeout: float = 60.0) -> int:
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            self.kill()
            raise
        await asyncio.gather(*self._readers)
        return code

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


def _event_of(line: str) -> str | None:
    try:
        data = json.loads(line)
    except ValueError:
        return None
    return data.get("event") if isinstance(data, dict) else None


async def spawn(*args: str) -> Serve:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    for var in ("FLEETLEASE_DATABASE_URL", "FLEETLEASE_NATS_URL", "FLEETLEASE_PREFIX"):
        env.pop(var, None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetlease.ops.cli", "serve", *args,
        cwd=REPO_ROOT, env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    return Serve(proc)


def serve_args(db_url: str, nats_url: str, prefix: str, state_dir: Path) -> list[str]:
    return [
        "--database-url", db_url, "--nats-url", nats_url,
        "--prefix", prefix, "--state-dir", str(state_dir),
    ]  # fmt: skip


@pytest.fixture
async def serve(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> AsyncIterator[Serve]:
    s = await spawn(*serve_args(db_url, nats_url, subject_prefix, state_dir))
    try:
        await s.logged("server_started")
        yield s
    finally:
        s.kill()
        await s.wait()


@pytest.fixture
async def repo(db_url: str) -> AsyncIterator[Repository]:
    engine = create_engine(db_url, pool_size=4, max_overflow=4)
    r = Repository(engine)
    await r.add_user("admin", platform_admin=True)
    await r.add_project("default", owner="admin")
    try:
        yield r
    finally:
        await engine.dispose()


async def host(repo: Repository, nats_url: str, prefix: str, host_id: str = "h1") -> HostClient:
    cred = await repo.add_host(host_id)
    c = HostClient(nats_url=nats_url, host_id=host_id, credential=cred, prefix=prefix)
    await c.connect()
    await c.register()
    await c.heartbeat([wire.Device(device_id=f"{host_id}-d{i}") for i in range(2)])
    return c


async def test_serve_runs_a_host_end_to_end_and_stops_cleanly_on_sigterm(
    serve: Serve, repo: Repository, nats_url: str, subject_prefix: str
) -> None:
    c = await host(repo, nats_url, subject_prefix)
    try:
        # Submitted straight into the database: the Scheduler's timer in the
        # child assigns it and wakes the parked long-poll.
        task_id = await repo.submit(TaskSpec(kind=TaskKind.GOAL, goal="g", payload={"n": 1}))
        a = await c.claim(wait_s=30)
        assert a is not None and a.task_id == task_id and a.payload == {"n": 1}
        assert (await c.ack(a.task_id, a.attempt, a.lease_token)).state == "running"
        assert (await c.renew(a.task_id, a.attempt, a.lease_token)).state == "running"
        await c.append_logs(a.task_id, a.attempt, 0, ["hello", "world"])
        blob = os.urandom(200_000)
        await c.upload_artifact(a.task_id, a.attempt, a.lease_token, "out.bin", blob)
        res = await c.result(a.task_id, a.attempt, a.lease_token, outcome="done", fingerprint="f")
        assert res.state == "done"
        logs = await repo.read_logs(task_id, ADMIN)
        assert [r["line"] for r in logs] == ["hello", "world"]
        (art,) = await repo.list_artifacts(task_id, ADMIN)
        assert art["sha256"] == hashlib.sha256(blob).hexdigest()

        # In flight at SIGTERM: a parked long-poll and a burst of renewals of a
        # second task. Each gets its reply; the process exits 0.
        second = await repo.submit(TaskSpec(kind=TaskKind.GOAL, goal="g"))
        b = await c.claim(wait_s=30)
        assert b is not None and b.task_id == second
        await c.ack(b.task_id, b.attempt, b.lease_token)
        poll = asyncio.ensure_future(c.claim(wait_s=60))
        renewals = [
            asyncio.ensure_future(c.renew(b.task_id, b.attempt, b.lease_token)) for _ in range(30)
        ]
        final = asyncio.ensure_future(
            c.result(b.task_id, b.attempt, b.lease_token, outcome="done", fingerprint="g")
        )
        # Make sure NATS has every request before the signal.
        for nc in c._conns.values():
            await nc.flush()
        serve.proc.send_signal(signal.SIGTERM)
        assert await poll is None  # released at once with a normal empty reply
        for r in await asyncio.gather(*renewals, return_exceptions=True):
            # A renewal the Lease actor ordered after the result sees the end state.
            assert isinstance(r, wire.LeaseReply) or (
                isinstance(r, wire.RemoteError) and r.code in {"conflict", "gone"}
            ), r
        assert (await final).state == "done"
        assert await serve.wait() == 0
        view = await repo.task_view(second, ADMIN)
        assert view["state"] == "done"
    finally:
        await c.close()
    assert "Traceback" not in "\n".join(serve.stderr)
    assert _event_of(serve.stderr[-1]) in {"server_stopped", "control_plane.stopped"}


async def test_serve_logs_json_lines_on_stderr_when_not_a_terminal(serve: Serve) -> None:
    await serve.logged("control_plane_started")
    serve.proc.send_signal(signal.SIGTERM)
    assert await serve.wait() == 0
    records = [json.loads(line) for line in serve.stderr if line.strip()]
    assert records, "no log lines"
    for rec in records:
        assert {"event", "level", "timestamp"} <= rec.keys()
    events = [r["event"] for r in records]
    assert "server_started" in events and "server_stopped" in events


async def test_a_second_serve_shares_the_work_through_the_queue_groups(
    serve: Serve,
    repo: Repository,
    db_url: str,
    nats_url: str,
    subject_prefix: str,
    state_dir: Path,
) -> None:
    other = await spawn(*serve_args(db_url, nats_url, subject_prefix, state_dir))
    try:
        await other.logged("server_started")
        c = await host(repo, nats_url, subject_prefix)
        try:
            for i in range(6):
                await repo.submit(TaskSpec(kind=TaskKind.GOAL, goal="g", payload={"i": i}))
            seen = []
            for _ in range(6):
                a = await c.claim(wait_s=30)
                assert a is not None
                await c.ack(a.task_id, a.attempt, a.lease_token)
                r = await c.result(
                    a.task_id, a.attempt, a.lease_token, outcome="done", fingerprint="f"
                )
                assert not r.replayed
                seen.append(a.task_id)
            assert len(set(seen)) == 6
        finally:
            await c.close()
        other.proc.send_signal(signal.SIGTERM)
        assert await other.wait() == 0
    finally:
        other.kill()
        await other.wait()


@pytest.mark.parametrize("which", ["database", "nats"])
async def test_an_unreachable_server_is_one_clear_line_and_exit_6(
    which: str, db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> None:
    dead_db = "postgresql://postgres@127.0.0.1:1/nothing"
    dead_nats = "nats://127.0.0.1:1"
    args = serve_args(
        dead_db if which == "database" else db_url,
        dead_nats if which == "nats" else nats_url,
        subject_prefix,
        state_dir,
    )
    s = await spawn(*args)
    try:
        code = await s.wait()
    finally:
        s.kill()
    err = [line for line in s.stderr if line.strip()]
    assert code == 6, err
    assert "Traceback" not in "\n".join(err)
    problems = [line for line in err if line.startswith("fleetlease:")]
    assert len(problems) == 1, err
    assert ("PostgreSQL" if which == "database" else "NATS") in problems[0]
    assert all(_event_of(line) is not None for line in err if line not in problems)


async def test_ops_subject_is_served_by_serve(
    serve: Serve, repo: Repository, nats_url: str, subject_prefix: str
) -> None:
    token = await repo.add_user("alice")
    nc = await nats.connect(nats_url)
    try:
        s = Subjects(subject_prefix)
        req = wire.encode(wire.OpsRequest(token=token, verb="whoami"))
        whoami = s.ops("alice", "whoami")
        reply = wire.decode((await principal_request(nc, s, whoami, req)).data).msg
        assert isinstance(reply, wire.OpsReply), reply
        bad = wire.encode(wire.OpsRequest(token="nope", verb="whoami"))
        reply = wire.decode((await principal_request(nc, s, whoami, bad)).data).msg
        assert isinstance(reply, wire.Error) and reply.code == "unauthorized"
    finally:
        await nc.close()


async def test_serve_starts_and_serves_with_a_dead_member_in_its_nats_url_list(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path, repo: Repository
) -> None:
    urls = f"nats://127.0.0.1:1,{nats_url}"
    s = await spawn(*serve_args(db_url, urls, subject_prefix, state_dir))
    try:
        await s.logged("server_started")
        # A host given the same list reaches it too.
        c = await host(repo, urls, subject_prefix)
        await c.close()
    finally:
        s.kill()
        await s.wait()


@pytest.mark.parametrize("replicas", ["0", "6", "three"])
async def test_a_bad_js_replica_count_is_a_usage_error_before_anything_starts(
    replicas: str, db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> None:
    args = serve_args(db_url, nats_url, subject_prefix, state_dir)
    s = await spawn(*args, "--js-replicas", replicas)
    try:
        code = await s.wait()
    finally:
        s.kill()
    err = [line for line in s.stderr if line.strip()]
    assert code == 2, err
    assert "Traceback" not in "\n".join(err)
    assert [line for line in err if line.startswith("fleetlease:")] == [
        next(line for line in err if "--js-replicas" in line)
    ], err
