"""The ``fleetlease`` CLI as a real process against a real ``fleetlease serve``
(PostgreSQL, NATS): cancel answers the truth about a task that ended, usage
errors and oversized arguments are one typed line, and a closed pipe is quiet.
A host is simulated with the signed ``HostClient`` so that tasks really end."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import shlex
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from fleetlease.ops import limits
from fleetlease.ops.cli import exit_code_for
from fleetlease.ops.client import OpsClient, OpsError
from fleetlease.persistence import repository as repository_module
from fleetlease.persistence import tables as t
from fleetlease.persistence.db import create_engine
from fleetlease.persistence.repository import Repository
from fleetlease.transport import wire
from fleetlease.transport.client import HostClient
from tests.integration.test_serve import REPO_ROOT, Serve, serve

__all__ = ["serve"]

pytestmark = pytest.mark.embedded


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@dataclass
class Fleet:
    serve: Serve
    repo: Repository
    token: str
    nats_url: str
    prefix: str
    state_dir: Path

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        for var in ("FLEETLEASE_TOKEN", "FLEETLEASE_NATS_URL", "FLEETLEASE_PREFIX"):
            env.pop(var, None)
        return env

    def _argv(self, *argv: str) -> list[str]:
        return [
            sys.executable, "-m", "fleetlease.ops.cli", *argv,
            "--nats-url", self.nats_url, "--prefix", self.prefix,
            "--state-dir", str(self.state_dir), "--token", self.token, "--timeout", "20",
        ]  # fmt: skip

    async def cli(self, *argv: str) -> Run:
        proc = await asyncio.create_subprocess_exec(
            *self._argv(*argv),
            cwd=REPO_ROOT,
            env=self._env(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode is not None
        return Run(proc.returncode, out.decode(), err.decode())

    async def piped_to_head(self, *argv: str) -> Run:
        """``fleetlease ARGV | head -1``: the CLI's own exit code and stderr."""
        cmd = " ".join(shlex.quote(a) for a in self._argv(*argv))
        script = f'{cmd} 2>"$ERR" | head -1; echo "${{PIPESTATUS[0]}}" >"$RC"'
        err_file, rc_file = self.state_dir / "err", self.state_dir / "rc"
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", script,
            cwd=REPO_ROOT,
            env={**self._env(), "ERR": str(err_file), "RC": str(rc_file)},
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
        return Run(int(rc_file.read_text().strip()), out.decode(), err_file.read_text())

    async def submit(self, goal: str = "open the settings app") -> str:
        run = await self.cli("submit", "--goal", goal, "--json")
        assert run.code == 0, run.err
        task_id: str = run.json()["id"]
        return task_id

    async def task_row(self, task_id: str) -> dict[str, Any]:
        async with self.repo.engine.connect() as conn:
            row = (await conn.execute(sa.select(t.tasks).where(t.tasks.c.id == task_id))).one()
        return dict(row._mapping)


@pytest.fixture
async def fleet(
    serve: Serve, db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> AsyncIterator[Fleet]:
    engine = create_engine(db_url, pool_size=2, max_overflow=2)
    repo = Repository(engine)
    token = await repo.add_user("admin", platform_admin=True)
    await repo.add_project("default", owner="admin")
    try:
        yield Fleet(serve, repo, token, nats_url, subject_prefix, state_dir)
    finally:
        await engine.dispose()


@pytest.fixture
async def host(fleet: Fleet) -> AsyncIterator[HostClient]:
    credential = await fleet.repo.add_host("h1")
    client = HostClient(
        nats_url=fleet.nats_url, host_id="h1", credential=credential, prefix=fleet.prefix
    )
    await client.connect()
    await client.register()
    await client.heartbeat([wire.Device(device_id="d0")])
    try:
        yield client
    finally:
        await client.close()


async def take(host: HostClient) -> wire.Assignment:
    assignment = await host.claim(20.0)
    assert assignment is not None, "no assignment arrived"
    await host.ack(assignment.task_id, assignment.attempt, assignment.lease_token)
    return assignment


# --- cancel tells the truth ------------------------------------------------------------------


async def test_cancelling_a_task_that_ended_writes_nothing_and_answers_its_terminal_state(
    fleet: Fleet, host: HostClient
) -> None:
    task_id = await fleet.submit()
    a = await take(host)
    await host.result(
        a.task_id, a.attempt, a.lease_token, outcome="failed", fingerprint=f"{a.task_id}:f"
    )
    before = await fleet.task_row(task_id)
    assert before["status"] == "failed"

    as_json = await fleet.cli("cancel", task_id, "--json")
    as_table = await fleet.cli("cancel", task_id)

    assert as_json.code == 5, as_json.err
    reply = as_json.json()
    assert (reply["id"], reply["state"], reply["already_ended"]) == (task_id, "failed", True)
    assert reply["cancel"] == {"requested": False, "by": None, "at": None}
    assert reply["completed"] is False
    assert as_table.code == 5, as_table.err
    assert "already failed" in as_table.out
    assert "cancelled" not in as_table.out
    assert await fleet.task_row(task_id) == before  # nothing written


async def test_repeating_a_cancel_of_a_live_task_returns_the_first_request(
    fleet: Fleet, host: HostClient
) -> None:
    task_id = await fleet.submit()
    await take(host)

    first = await fleet.cli("cancel", task_id, "--json")
    row = await fleet.task_row(task_id)
    again = await fleet.cli("cancel", task_id, "--json")
    table = await fleet.cli("cancel", task_id)

    assert first.code == 0, first.err
    assert again.code == 0, again.err
    assert first.json()["cancel"]["requested"] is True
    assert again.json()["cancel"] == first.json()["cancel"]
    assert again.json()["already_ended"] is False
    assert await fleet.task_row(task_id) == row  # the repeat wrote nothing
    assert table.code == 0, table.err
    assert "stopping the running attempt" in table.out


# --- errors are one line ----------------------------------------------------------------------


async def test_an_unknown_flag_is_one_line_naming_the_subcommand_and_the_flag(
    fleet: Fleet,
) -> None:
    for argv in (["submit", "--goal", "g", "--bogus"], ["submit", "--bogus"]):
        run = await fleet.cli(*argv)
        assert run.code == 2, run
        assert run.err.strip().splitlines() == [
            "fleetlease submit: unknown flag --bogus (see fleetlease submit --help)"
        ]
        assert run.out == ""
    nested = await fleet.cli("host", "add", "h9", "--bogus=1")
    assert nested.err.strip() == (
        "fleetlease host add: unknown flag --bogus (see fleetlease host add --help)"
    )


async def test_an_oversized_goal_or_argument_is_the_same_bad_request_whatever_its_size(
    fleet: Fleet,
) -> None:
    goal_error = f"fleetlease: bad request: goal is larger than {limits.MAX_TEXT} bytes"
    for size in (limits.MAX_TEXT + 1, 120_000):
        run = await fleet.cli("submit", "--goal", "g" * size)
        assert (run.code, run.err.strip().splitlines()) == (2, [goal_error]), run
    # Selector values of ~1.2 MB in all: past the broker's payload limit.
    selector_error = (
        f"fleetlease: bad request: selector value is larger than {limits.MAX_TEXT} bytes"
    )
    for selectors in (1, 10):
        argv = ["submit", "--goal", "g"]
        for i in range(selectors):
            argv += ["--selector", f"k{i}=" + "v" * 120_000]
        run = await fleet.cli(*argv)
        assert (run.code, run.err.strip().splitlines()) == (2, [selector_error]), run
    assert await fleet.repo.list_tasks(await _admin(fleet)) == []


async def test_an_oversized_payload_is_the_same_bad_request_whatever_its_size(
    fleet: Fleet,
) -> None:
    """Past what a command line carries: through the CLI's client, in process."""
    assert limits.MAX_DOC == repository_module.MAX_PAYLOAD_BYTES
    client = OpsClient(nats_url=fleet.nats_url, token=fleet.token, prefix=fleet.prefix)
    async with client:
        for size in (limits.MAX_DOC + 1, 3 * 1024 * 1024):
            with pytest.raises(OpsError) as err:
                await client.call("submit", goal="g", payload={"x": "p" * size})
            assert (err.value.code, exit_code_for(err.value), str(err.value)) == (
                "bad_request",
                2,
                f"bad request: payload is larger than {limits.MAX_DOC} bytes",
            )
        # The API refuses the same for a client that does not check first.
        with pytest.raises(OpsError) as err:
            await _unchecked(client).call("submit", goal="g", payload={"x": "p" * 300_000})
        assert str(err.value) == f"bad request: payload is larger than {limits.MAX_DOC} bytes"
        with pytest.raises(OpsError) as err:
            await _unchecked(client).call("submit", goal="g" * 5000)
        assert str(err.value) == f"bad request: goal is larger than {limits.MAX_TEXT} bytes"
    assert await fleet.repo.list_tasks(await _admin(fleet)) == []


def _unchecked(client: OpsClient) -> OpsClient:
    """The same client without its own size check (what another client sends)."""

    class Unchecked(OpsClient):
        def _checked(self, verb: str, args: dict[str, Any], request: wire.OpsRequest) -> bytes:
            return wire.encode(request)

    return Unchecked(
        nats_url=client.nats_url,
        token=client.token,
        prefix=client.prefix,
        nc=client.nc,
        user=client.user,
    )


async def _admin(fleet: Fleet) -> Any:
    return await fleet.repo.authenticate_user(fleet.token)


async def test_logs_into_a_closed_pipe_exit_quietly(fleet: Fleet, host: HostClient) -> None:
    task_id = await fleet.submit()
    a = await take(host)
    lines = [f"line {i:05d} " + "x" * 200 for i in range(2000)]  # ~400 KB, past a pipe
    for first in range(0, len(lines), 500):
        await host.append_logs(a.task_id, a.attempt, first + 1, lines[first : first + 500])

    run = await fleet.piped_to_head("logs", task_id)

    assert run.out.count("\n") == 1 and "line 00000" in run.out
    assert run.err == ""
    assert run.code == 0


# --- watch counts the fleet ------------------------------------------------------------------


async def test_watch_on_a_terminal_counts_every_task_not_the_rows_it_shows(fleet: Fleet) -> None:
    for _ in range(4):
        await fleet.submit()  # no host: they stay queued
    master, slave = pty.openpty()
    env = {**fleet._env(), "COLUMNS": "160", "LINES": "40", "TERM": "xterm"}
    proc = await asyncio.create_subprocess_exec(
        *fleet._argv("watch", "--limit", "1", "--for", "60"),
        cwd=REPO_ROOT, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=slave, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    os.close(slave)
    screen = bytearray()

    def read_all() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                return
            if not chunk:
                return
            screen.extend(chunk)

    async def shown(text: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while text not in screen.decode(errors="replace"):
            assert loop.time() < deadline, f"{text!r} not shown: {bytes(screen[-2000:])!r}"
            assert proc.returncode is None, "watch ended early"
            await asyncio.sleep(0.05)

    reader = asyncio.create_task(asyncio.to_thread(read_all))
    try:
        await shown("queued 4")  # one row shown, four tasks counted
        await fleet.submit()
        await shown("queued 5")  # counted again after the change
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.communicate(), 60)
        await asyncio.wait_for(reader, 30)
        os.close(master)
