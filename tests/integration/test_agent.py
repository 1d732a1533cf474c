"""The host agent end to end: a real control plane (``ControlPlaneService``:
repository on PostgreSQL, actors, NATS server) and real agents, in-process here
(``Agent.run`` as a task) and as ``fleetlease agent`` subprocesses in
``test_agent_process.py`` where a crash is simulated.

Every wait is on a condition (the task's state in the database, a journal, an
agent's counters), never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from structlog.testing import capture_logs

from hostagent.agent import HANDBACK_REASON, Agent, AgentConfig
from hostagent.devices import SimulatedDeviceManager
from hostagent.journal import Journal
from ops.service import ControlPlaneService
from persistence.model import LeaseTimings, RetryPolicy, TaskKind, TaskSpec, User

T = TypeVar("T")

ADMIN = User(name="admin", platform_admin=True)


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


@dataclass
class RunningAgent:
    agent: Agent
    task: asyncio.Task[None]
    devices: SimulatedDeviceManager

    async def stop(self) -> None:
        self.agent.stop()
        await asyncio.wait_for(asyncio.shield(self.task), 60)


@dataclass
class System:
    db_url: str
    nats_url: str
    prefix: str
    state_dir: Path
    timings: LeaseTimings
    service: ControlPlaneService | None = None
    agents: list[RunningAgent] = field(default_factory=list)
    credentials: dict[str, str] = field(default_factory=dict)

    @property
    def repo(self) -> Any:
        assert self.service is not None and self.service.repo is not None
        return self.service.repo

    @property
    def cp(self) -> Any:
        assert self.service is not None
        return self.service.control_plane

    async def start_service(self) -> ControlPlaneService:
        self.service = ControlPlaneService(
            database_url=self.db_url,
            nats_url=self.nats_url,
            state_dir=self.state_dir / "server",
            prefix=self.prefix,
            migrate=False,
            timings=self.timings,
            heartbeat_s=1.0,
            scheduler_interval_s=0.1,
        )
        (self.state_dir / "server").mkdir(exist_ok=True)
        await self.service.start()
        return self.service

    async def add_host(self, host_id: str) -> str:
        credential: str = await self.repo.add_host(host_id)
        self.credentials[host_id] = credential
        return credential

    def agent_dir(self, host_id: str) -> Path:
        return self.state_dir / "agents" / host_id

    def config(self, host_id: str, credential: str | None = None, **overrides: Any) -> AgentConfig:
        fields: dict[str, Any] = {
            "host_id": host_id,
            "credential": credential or self.credentials[host_id],
            "nats_url": self.nats_url,
            "state_dir": self.agent_dir(host_id),
            "prefix": self.prefix,
            "claim_wait_s": 2.0,
            "min_poll_interval_s": 0.2,
            "resync_jitter_s": 0.0,
            "backoff_base_s": 0.05,
            "backoff_cap_s": 0.5,
            "grace_s": 5.0,
            "request_timeout_s": 5.0,
        }
        fields.update(overrides)
        return AgentConfig(**fields)

    async def start_agent(
        self, host_id: str, devices: int = 2, *, wait: bool = True, **overrides: Any
    ) -> RunningAgent:
        if host_id not in self.credentials:
            await self.add_host(host_id)
        manager = SimulatedDeviceManager(devices, prefix=f"{host_id}-dev")
        agent = Agent(self.config(host_id, **overrides), manager)
        running = RunningAgent(agent, asyncio.create_task(agent.run()), manager)
        self.agents.append(running)
        if wait:
            await eventually(
                self._started_or_failed(running), lambda started: started, timeout=30
            )
            if running.task.done():
                running.task.result()  # raise what stopped it
        return running

    def _started_or_failed(self, running: RunningAgent) -> Callable[[], Awaitable[bool]]:
        async def probe() -> bool:
            return running.agent.started.is_set() or running.task.done()

        return probe

    async def submit(self, sim: dict[str, Any] | None = None, **overrides: Any) -> str:
        fields: dict[str, Any] = {
            "kind": TaskKind.GOAL,
            "goal": "open the settings",
            "payload": {"sim": sim or {"duration_s": 0.05}},
            "project": "default",
            "owner": "admin",
            "retry": RetryPolicy(max_attempts=3, backoff_base_s=0.0),
        }
        fields.update(overrides)
        task_id: str = await self.cp.submit(TaskSpec(**fields))
        return task_id

    async def view(self, task_id: str) -> dict[str, Any]:
        view: dict[str, Any] = await self.repo.task_view(task_id, ADMIN)
        return view

    async def wait_state(self, task_id: str, *states: str, timeout: float = 30.0) -> dict[str, Any]:
        async def probe() -> dict[str, Any]:
            return await self.view(task_id)

        return await eventually(probe, lambda v: v["state"] in states, timeout=timeout)


@pytest.fixture
async def make_system(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> AsyncIterator[Callable[..., Awaitable[System]]]:
    systems: list[System] = []

    async def make(**timings: float) -> System:
        base = {"claim_s": 10.0, "ack_s": 10.0, "lease_s": 6.0, "liveness_s": 30.0}
        base.update(timings)
        system = System(db_url, nats_url, subject_prefix, state_dir, LeaseTimings(**base))
        systems.append(system)
        await system.start_service()
        await system.repo.add_user("admin", platform_admin=True)
        await system.repo.add_project("default", owner="admin")
        return system

    try:
        yield make
    finally:
        for system in systems:
            for running in system.agents:
                running.agent.stop()
            for running in system.agents:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(running.task, 60)
            if system.service is not None:
                await system.service.stop()


# --- happy paths ------------------------------------------------------------------------


async def test_goal_and_workflow_tasks_run_to_done(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    system = await make_system()
    running = await system.start_agent("h1", devices=2)
    goal = await system.submit({"duration_s": 0.05, "log_lines": 3, "artifact_bytes": 1000})
    workflow = await system.submit(
        kind=TaskKind.WORKFLOW,
        goal=None,
        workflow="smoke",
        payload={"steps": [{"duration_s": 0.01}, {"duration_s": 0.02, "log_lines": 2}]},
    )

    done_goal = await system.wait_state(goal, "done")
    done_workflow = await system.wait_state(workflow, "done")

    assert done_goal["attempt"] == 1 and done_workflow["attempt"] == 1
    assert done_workflow["result"]["steps_completed"] == 2
    assert [a["host_id"] for a in done_goal["attempts"]] == ["h1"]
    # Logs and the artifact arrive on their own channels.
    await eventually(
        lambda: system.repo.read_logs(goal, ADMIN), lambda lines: len(lines) == 3, timeout=10
    )
    artifacts = await eventually(
        lambda: system.repo.list_artifacts(goal, ADMIN), lambda a: len(a) == 1, timeout=10
    )
    assert artifacts[0]["size"] == 1000
    # Nothing stays in the journal once results are acknowledged.
    await eventually(
        _journal_size(system.agent_dir("h1")), lambda n: n == 0, timeout=10
    )
    assert running.agent.stats.results_reported == 2


def _journal_size(directory: Path) -> Callable[[], Awaitable[int]]:
    async def probe() -> int:
        def count() -> int:
            with Journal.in_state_dir(directory) as journal:
                return len(journal.entries())

        return await asyncio.to_thread(count)

    return probe
