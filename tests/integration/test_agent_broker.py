"""``fleetlease agent`` against a secured broker as a real process:
a host revoked while its agent runs is kicked by the control plane, and the
auth callout refuses its reconnects ("Authorization Violation"); the agent
must then exit with one clear line and its own exit code (7) instead of
retrying forever, and so must a revoked agent starting afresh. An agent whose
server is merely unreachable keeps retrying until it is stopped.

The nats-server runs the generated secure config; the control plane
(``ControlPlaneService`` with ``broker_security=True``) runs in the test
process and serves the callout from the test's PostgreSQL database.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fleetlease.ops.embedded import EmbeddedNats
from fleetlease.transport.broker_config import secure_embedded_args
from fleetlease.transport.subjects import Subjects

pytestmark = pytest.mark.embedded

REPO = Path(__file__).resolve().parents[2]
EXIT_BROKER_REFUSED = 7


@dataclass
class AgentRun:
    """An agent process; its output (JSON log lines on stderr, and the final
    one-line error of the CLI) goes to ``log_path``."""

    proc: subprocess.Popen[bytes]
    log_path: Path

    def _lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def events(self, name: str, **match: Any) -> list[dict[str, Any]]:
        found = []
        for line in self._lines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if (
                isinstance(event, dict)
                and event.get("event") == name
                and all(event.get(k) == v for k, v in match.items())
            ):
                found.append(event)
        return found

    async def wait_event(self, name: str, *, count: int = 1, timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.events(name)) < count:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"agent exited ({self.proc.returncode}) before {count} x {name}: "
                    + self.log_path.read_text(errors="replace")[-3000:]
                )
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {count} x {name}")
            await asyncio.sleep(0.1)

    async def wait_exit(self, timeout: float = 60.0) -> int:
        return await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout)

    def plain_lines(self) -> list[str]:
        """The output lines that are not JSON log events."""
        plain = []
        for line in self._lines():
            try:
                json.loads(line)
            except ValueError:
                plain.append(line)
        return plain


@dataclass
class Secured:
    url: str
    service: Any
    state: Path
    prefix: str
    tmp: Path
    runs: list[AgentRun]

    def spawn(self, host_id: str, credential: str, *, url: str | None = None) -> AgentRun:
        n = len(self.runs)
        token = self.tmp / f"{host_id}-{n}.token"
        token.write_text(credential + "\n")
        token.chmod(0o600)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLEASE_")}
        env["PYTHONPATH"] = str(REPO)
        argv = [
            sys.executable, "-m", "fleetlease.ops.cli", "agent", "--host-id", host_id,
            "--token-file", str(token), "--nats-url", url or self.url,
            "--prefix", self.prefix, "--state-dir", str(self.tmp / "agent-state"),
            "--devices", "simulated:1", "--claim-wait-s", "2", "--resync-jitter-s", "0",
            "--broker-refused-s", "1",
        ]  # fmt: skip
        log_path = self.tmp / f"agent-{n}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        run = AgentRun(proc, log_path)
        self.runs.append(run)
        return run


@pytest.fixture
async def secured(tmp_path: Path, db_url: str, subject_prefix: str) -> AsyncIterator[Secured]:
    from fleetlease.ops.service import ControlPlaneService

    state = tmp_path / "state"
    server = EmbeddedNats(
        tmp_path / "nats", extra_args=secure_embedded_args(state, subjects=Subjects(subject_prefix))
    )
    await asyncio.to_thread(server.start)
    service = ControlPlaneService(
        database_url=db_url,
        nats_url=server.url,
        state_dir=state,
        prefix=subject_prefix,
        broker_security=True,
    )
    s = Secured(server.url, service, state, subject_prefix, tmp_path, [])
    try:
        await service.start()
        assert service.repo is not None
        await service.repo.add_user("admin", platform_admin=True)
        yield s
    finally:
        for run in s.runs:
            if run.proc.poll() is None:
                run.proc.kill()
            await asyncio.to_thread(run.proc.wait)
        await service.stop()
        await asyncio.to_thread(server.stop)


async def test_a_revoked_agent_exits_with_its_own_code_and_one_line(secured: Secured) -> None:
    credential = await secured.service.repo.add_host("h1")
    agent = secured.spawn("h1", credential)
    await agent.wait_event("reconcile_done", timeout=60)

    await secured.service.repo.revoke_host("h1")
    assert await secured.service.broker_auth.disconnect_host("h1") >= 1

    code = await agent.wait_exit(60)
    assert code == EXIT_BROKER_REFUSED, agent.plain_lines()
    [line] = agent.plain_lines()
    assert line.startswith("fleetlease: the NATS server refuses host 'h1'"), line
    assert "authorization violation" in line.lower()
    assert credential not in line and credential not in agent.log_path.read_text()
    assert agent.events("nats_reconnected") == []  # refused, never let back in
    assert agent.events("broker_refused")

    # Starting it again is refused at the first connect, the same way.
    again = secured.spawn("h1", credential)
    assert await again.wait_exit(60) == EXIT_BROKER_REFUSED, again.plain_lines()
    assert len(again.plain_lines()) == 1
    assert not again.events("agent_registered")


async def test_an_unreachable_server_is_retried_until_the_agent_is_stopped(
    secured: Secured,
) -> None:
    credential = await secured.service.repo.add_host("h2")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = secured.spawn("h2", credential, url=f"nats://127.0.0.1:{port}")
    # Plain connection errors: logged and retried, never fatal.
    await agent.wait_event("nats_error", count=3, timeout=60)
    assert agent.proc.poll() is None
    assert not agent.events("broker_refused")

    agent.proc.send_signal(signal.SIGTERM)
    assert await agent.wait_exit(30) == 0, agent.plain_lines()
