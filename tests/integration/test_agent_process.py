"""``fleetlease agent`` as a real process: crashes (SIGKILL, also at exact points
through ``FLEETLEASE_AGENT_FAILPOINTS``), restarts, SIGTERM, a refused
credential, and the process's sockets (outbound only).

The control plane runs in the test process (``ControlPlaneService``). Agents log
JSON lines to a file per run, which the tests read as events.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from fleetlease.hostagent.journal import Journal, JournalRecord
from fleetlease.transport.client import HostClient
from fleetlease.transport.wire import RemoteError

# The fixture is defined in test_agent.py; importing it makes pytest see it here.
from tests.integration.test_agent import (
    ADMIN,
    System,
    eventually,
    make_system,  # noqa: F401
)

REPO = Path(__file__).resolve().parents[2]


@dataclass
class AgentProcess:
    proc: subprocess.Popen[bytes]
    log_path: Path

    def events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return out
        for line in text.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                out.append(event)
        return out

    def named(self, name: str, **match: Any) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events()
            if e.get("event") == name and all(e.get(k) == v for k, v in match.items())
        ]

    async def wait_event(self, name: str, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        async def probe() -> list[dict[str, Any]]:
            if self.proc.poll() is not None and not self.named(name, **match):
                raise AssertionError(
                    f"agent exited ({self.proc.returncode}) before {name}: "
                    + self.log_path.read_text(errors="replace")[-3000:]
                )
            return self.named(name, **match)

        found = await eventually(probe, lambda events: bool(events), timeout=timeout)
        return found[0]

    async def wait_exit(self, timeout: float = 60.0) -> int:
        return await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)


@dataclass
class Processes:
    system: System
    tmp: Path
    running: list[AgentProcess] = field(default_factory=list)

    def token_file(self, host_id: str, credential: str | None = None) -> Path:
        path = self.tmp / f"{host_id}-{len(self.running)}.token"
        path.write_text((credential or self.system.credentials[host_id]) + "\n")
        path.chmod(0o600)
        return path

    def spawn(
        self,
        host_id: str,
        *,
        credential: str | None = None,
        devices: str = "simulated:1",
        failpoints: str = "",
        grace_s: float = 5.0,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
    ) -> AgentProcess:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("FLEETLEASE_") and k != "PYTHONPATH"
        }
        env["PYTHONPATH"] = str(REPO)
        if failpoints:
            env["FLEETLEASE_AGENT_FAILPOINTS"] = failpoints
        env.update(extra_env or {})
        log_path = self.tmp / f"{host_id}-run{len(self.running)}.log"
        argv = [
            sys.executable,
            "-m",
            "fleetlease.ops.cli",
            "agent",
            "--host-id",
            host_id,
            "--token-file",
            str(self.token_file(host_id, credential)),
            "--nats-url",
            self.system.nats_url,
            "--prefix",
            self.system.prefix,
            "--state-dir",
            str(self.system.state_dir),
            "--devices",
            devices,
            "--claim-wait-s",
            "2",
            "--resync-jitter-s",
            "0",
            "--grace-s",
            str(grace_s),
            *extra_args,
        ]
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        agent = AgentProcess(proc, log_path)
        self.running.append(agent)
        return agent


@pytest.fixture
async def procs(
    make_system: Callable[..., Awaitable[System]],  # noqa: F811
    tmp_path: Path,
) -> AsyncIterator[Callable[..., Awaitable[Processes]]]:
    made: list[Processes] = []

    async def make(**timings: float) -> Processes:
        system = await make_system(**timings)
        p = Processes(system, tmp_path)
        made.append(p)
        return p

    try:
        yield make
    finally:
        for p in made:
            for agent in p.running:
                agent.kill()
                await asyncio.to_thread(agent.proc.wait)
                # Shown by pytest only when the test fails: what the agent warned of.
                for event in agent.events():
                    if event.get("level") in ("warning", "error", "critical"):
                        print(f"{agent.log_path.name}: {json.dumps(event)[:2000]}")


def journal_entries(system: System, host_id: str) -> list[JournalRecord]:
    with Journal.in_state_dir(system.agent_dir(host_id)) as journal:
        return journal.entries()


# --- crashes ---------------------------------------------------------------------------


async def test_sigkill_mid_run_lease_expires_and_attempt_2_runs_elsewhere(
    procs: Callable[..., Awaitable[Processes]],
) -> None:
    p = await procs(lease_s=2.0)
    system = p.system
    await system.add_host("h-a")
    agent_a = p.spawn("h-a")
    await agent_a.wait_event("agent_registered")
    task_id = await system.submit({"duration_s": 3.0})
    await eventually(
        lambda: system.view(task_id),
        lambda v: v["state"] == "running" and v["attempts"][0]["host_id"] == "h-a",
    )

    agent_a.kill()
    assert await agent_a.wait_exit() == -signal.SIGKILL
    # Another host picks the task up once attempt 1's lease has expired.
    await system.start_agent("h-b", devices=1)
    view = await system.wait_state(task_id, "done", timeout=60)

    assert view["attempt"] == 2
    assert [a["host_id"] for a in view["attempts"]] == ["h-a", "h-b"]
    assert view["attempts"][0]["end_reason"] == "lease_expired"

    # Attempt 1's late result, with everything it had (credential, lease token
    # from its journal), is rejected and changes nothing.
    [stale] = journal_entries(system, "h-a")
    assert stale.task_id == task_id and stale.attempt == 1
    client = HostClient(
        nats_url=system.nats_url,
        host_id="h-a",
        credential=system.credentials["h-a"],
        prefix=system.prefix,
    )
    await client.connect()
    try:
        await client.register()
        with pytest.raises(RemoteError) as info:
            await client.result(
                task_id,
                1,
                stale.lease_token,
                outcome="done",
                result={"late": True},
                fingerprint="late-attempt-1",
            )
    finally:
        await client.close()
    assert info.value.code in ("conflict", "gone")
    after = await system.view(task_id)
    assert (after["state"], after["attempt"], after["result"]) == (
        "done",
        2,
        view["result"],
    )

    # Restarted, agent A is told to discard its stale entry and reports nothing.
    restarted = p.spawn("h-a")
    await restarted.wait_event("reconcile_done", discarded=1)
    assert restarted.named("journal_entry_discarded", task_id=task_id, attempt=1)
    assert not restarted.named("result_reported")
    assert journal_entries(system, "h-a") == []


async def test_sigkill_after_result_recorded_is_reported_once_on_restart(
    procs: Callable[..., Awaitable[Processes]],
) -> None:
    p = await procs(lease_s=10.0)
    system = p.system
    await system.add_host("h-a")
    crashing = p.spawn("h-a", failpoints="after_result_recorded")
    await crashing.wait_event("agent_registered")
    task_id = await system.submit({"duration_s": 0.05})

    assert await crashing.wait_exit() == -signal.SIGKILL
    [entry] = journal_entries(system, "h-a")
    assert entry.fingerprint is not None and str(entry.outcome) == "done"
    assert (await system.view(task_id))["state"] == "running"
    assert not crashing.named("result_reported")

    restarted = p.spawn("h-a")
    view = await system.wait_state(task_id, "done")
    await restarted.wait_event("result_reported", task_id=task_id)

    assert view["attempt"] == 1
    reports = restarted.named("result_reported", task_id=task_id)
    assert [(r["fingerprint"], r["replayed"]) for r in reports] == [(entry.fingerprint, False)]
    assert restarted.named("attempt_resumed", task_id=task_id)
    await eventually(lambda: asyncio.to_thread(journal_entries, system, "h-a"), lambda e: e == [])


async def test_sigkill_after_the_result_is_acknowledged_is_not_reported_again(
    procs: Callable[..., Awaitable[Processes]],
) -> None:
    p = await procs(lease_s=10.0)
    system = p.system
    await system.add_host("h-a")
    crashing = p.spawn("h-a", failpoints="after_result_reported")
    await crashing.wait_event("agent_registered")
    task_id = await system.submit({"duration_s": 0.05})

    assert await crashing.wait_exit() == -signal.SIGKILL
    assert (await system.view(task_id))["state"] == "done"
    assert len(journal_entries(system, "h-a")) == 1

    restarted = p.spawn("h-a")
    await restarted.wait_event("reconcile_done", discarded=1)

    assert not restarted.named("result_reported")
    assert journal_entries(system, "h-a") == []
    view = await system.view(task_id)
    assert (view["state"], view["attempt"]) == ("done", 1)


async def test_lines_a_resumed_run_logs_after_a_sigkill_all_arrive(
    procs: Callable[..., Awaitable[Processes]],
) -> None:
    p = await procs(lease_s=20.0)
    system = p.system
    await system.add_host("h-a")
    crashing = p.spawn("h-a")
    await crashing.wait_event("agent_registered")
    task_id = await system.submit({"duration_s": 8.0, "log_lines": 3})
    await eventually(
        lambda: system.repo.read_logs(task_id, ADMIN), lambda lines: len(lines) == 3, timeout=30
    )

    crashing.kill()
    assert await crashing.wait_exit() == -signal.SIGKILL
    restarted = p.spawn("h-a")
    await restarted.wait_event("attempt_resume_counted", task_id=task_id, resumes=1)
    view = await system.wait_state(task_id, "done", timeout=60)
    lines = await eventually(
        lambda: system.repo.read_logs(task_id, ADMIN), lambda lines: len(lines) == 6, timeout=30
    )

    assert view["attempt"] == 1
    texts = [f"goal: simulated log line {i}/3" for i in (1, 2, 3)]
    assert [(x["attempt"], x["seq"], x["line"]) for x in lines] == [
        *((1, seq, text) for seq, text in zip((1, 2, 3), texts, strict=True)),
        *((1, 2**32 + seq, text) for seq, text in zip((1, 2, 3), texts, strict=True)),
    ]


# --- process behaviour ------------------------------------------------------------------


async def test_agent_process_has_no_listening_socket(
    procs: Callable[..., Awaitable[Processes]],
) -> None:
    p = await procs()
    system = p.system
    await system.add_host("h-a")
    agent = p.spawn("h-a", devices="simulated:2")
    await agent.wait_event("agent_registered")
    task_id = await system.submit({"outcome": "hang"})
    await system.wait_state(task_id, "running")

    conns = psutil.Process(agent.proc.pid).net_connections(kind="all")

    assert not [c for c in conns if c.status == psutil.CONN_LISTEN]
    inet = [c for c in conns if c.family in (2, 10)]  # AF_INET, AF_INET6
    assert inet, "expected the outbound NATS connections"
    # Every internet socket is an outbound TCP connection to NATS (no UDP, no
    # bound-but-unconnected socket).
    assert all(c.type == 1 and c.raddr for c in inet), inet  # SOCK_STREAM
    assert {c.raddr.port for c in inet} == {int(system.nats_url.rsplit(":", 1)[1])}
    await system.cp.cancel(task_id, ADMIN)
    await system.wait_state(task_id, "cancelled")


async def test_sigterm_hands_back_a_running_attempt_and_exits_0(
    procs: Callable[..., Awaitable[Processes]],
) -> None:
    p = await procs()
    system = p.system
    await system.add_host("h-a")
    agent = p.spawn("h-a", grace_s=0.5)
    await agent.wait_event("agent_registered")
    task_id = await system.submit({"outcome": "hang"})
    await system.wait_state(task_id, "running")

    agent.proc.send_signal(signal.SIGTERM)

    assert await agent.wait_exit() == 0
    view = await system.view(task_id)
    assert view["state"] in ("queued", "retrying")
    assert view["attempts"][0]["end_reason"] == "retryable_failure"
    assert agent.named("attempt_handed_back", task_id=task_id)
    assert journal_entries(system, "h-a") == []


async def test_cli_with_another_hosts_credential_exits_3_and_leaves_that_host_untouched(
    procs: Callable[..., Awaitable[Processes]],
) -> None:
    p = await procs()
    system = p.system
    credential_a = await system.add_host("host-a")
    await system.add_host("host-b")
    before = {h["host_id"]: h for h in await system.repo.list_hosts()}

    agent = p.spawn("host-b", credential=credential_a)

    assert await agent.wait_exit() == 3
    output = agent.log_path.read_text()
    assert "registration of host 'host-b' refused" in output
    assert credential_a not in output
    after = {h["host_id"]: h for h in await system.repo.list_hosts()}
    assert after == before
