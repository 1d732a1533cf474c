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
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from structlog.testing import capture_logs

from fleetlease.hostagent.agent import Agent, AgentConfig
from fleetlease.hostagent.devices import SimulatedDeviceManager
from fleetlease.hostagent.journal import Journal
from fleetlease.ops.service import ControlPlaneService
from fleetlease.persistence.model import LeaseTimings, RetryPolicy, TaskKind, TaskSpec, User

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
            await eventually(self._started_or_failed(running), lambda started: started, timeout=30)
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
    await eventually(_journal_size(system.agent_dir("h1")), lambda n: n == 0, timeout=10)
    assert running.agent.stats.results_reported == 2


async def test_an_artifact_emitted_last_is_shipped_before_the_result(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    """The control plane takes artifacts only while the lease is held: the
    agent ships an attempt's queued artifacts before it reports the result."""
    system = await make_system()
    running = await system.start_agent("h1", devices=1)
    size = 4 * 1024 * 1024  # 32 chunks, emitted as the runner returns
    goal = await system.submit({"duration_s": 0, "artifact_bytes": size})
    await system.wait_state(goal, "done")
    (artifact,) = await system.repo.list_artifacts(goal, ADMIN)
    assert artifact["size"] == size
    assert running.agent.stats.artifacts_sent == 1
    assert running.agent.stats.artifacts_dropped == 0


async def test_lease_flips_send_no_heartbeat_but_an_outside_change_is_sent_at_once(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    """The control plane knows a device is in use from its reservation: running
    tasks sends no heartbeat (two of five requests per task before), while a
    device going offline is reported without waiting for the period."""
    system = await make_system()
    running = await system.start_agent("h1", devices=2, heartbeat_s=3600.0)
    sent = running.agent.stats.heartbeats_sent
    ids = [await system.submit({"duration_s": 0.01}) for _ in range(4)]
    for task_id in ids:
        await system.wait_state(task_id, "done")
    assert running.agent.stats.heartbeats_sent == sent

    running.devices.set_offline("h1-dev-1")

    states = await eventually(
        system.repo.list_devices,
        lambda rows: {r["device_id"]: r["state"] for r in rows}.get("h1-dev-1") == "offline",
        timeout=10,
    )
    assert {r["device_id"]: r["state"] for r in states}["h1-dev-0"] == "idle"
    assert running.agent.stats.heartbeats_sent == sent + 1


def _journal_size(directory: Path) -> Callable[[], Awaitable[int]]:
    async def probe() -> int:
        def count() -> int:
            with Journal.in_state_dir(directory) as journal:
                return len(journal.entries())

        return await asyncio.to_thread(count)

    return probe


# --- outcomes and the retry policy ---------------------------------------------------------


async def test_failed_outcome_is_terminal_after_one_attempt(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    system = await make_system()
    await system.start_agent("h1")
    task_id = await system.submit({"duration_s": 0.01, "outcome": "failed"})

    view = await system.wait_state(task_id, "failed")

    assert view["attempt"] == 1
    assert [a["end_reason"] for a in view["attempts"]] == ["failed"]


async def test_retryable_outcome_is_retried_until_the_attempts_run_out(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    system = await make_system()
    await system.start_agent("h1")
    task_id = await system.submit(
        {"duration_s": 0.01, "outcome": "retryable"},
        retry=RetryPolicy(max_attempts=3, backoff_base_s=0.0),
    )

    view = await system.wait_state(task_id, "failed")

    assert view["attempt"] == 3
    assert [a["end_reason"] for a in view["attempts"]] == ["retryable_failure"] * 3


async def test_a_crashing_runner_fails_the_task_without_stopping_the_agent(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    system = await make_system()
    await system.start_agent("h1", devices=1)
    crashed = await system.submit({"duration_s": 0.01, "outcome": "crash"})
    after = await system.submit({"duration_s": 0.01})

    assert (await system.wait_state(crashed, "failed"))["attempt"] == 1
    await system.wait_state(after, "done")


# --- cancellation and lease loss --------------------------------------------------------


async def test_hanging_task_is_cancelled_by_a_user_cancel(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    system = await make_system(lease_s=1.5)
    running = await system.start_agent("h1")
    task_id = await system.submit({"outcome": "hang"})
    await system.wait_state(task_id, "running")

    with capture_logs() as logs:
        await system.cp.cancel(task_id, ADMIN)
        view = await system.wait_state(task_id, "cancelled")
        await eventually(_journal_size(system.agent_dir("h1")), lambda n: n == 0, timeout=10)

    assert view["attempt"] == 1
    events = [e["event"] for e in logs if e.get("task_id") == task_id]
    assert "cancel_requested" in events
    reported = [e for e in logs if e["event"] == "result_reported" and e["task_id"] == task_id]
    assert [e["outcome"] for e in reported] == ["cancelled"]
    assert running.agent.stats.leases_lost == 0


async def test_rejected_renewal_stops_the_runner_and_reports_nothing(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    from fleetlease.transport.subjects import Channel

    system = await make_system(lease_s=1.5)
    running = await system.start_agent("h1", devices=2)
    task_id = await system.submit({"outcome": "hang"})
    await system.wait_state(task_id, "running")
    server = system.service.server  # type: ignore[union-attr]

    with capture_logs() as logs:
        # The jobs channel stalls: renewals do not get through, the lease expires.
        server.stall(Channel.JOBS)
        try:
            await eventually(
                lambda: system.view(task_id),
                lambda v: v["attempts"][0]["end_reason"] == "lease_expired",
                timeout=30,
            )
        finally:
            server.unstall(Channel.JOBS)
        # The next renewal is refused: the agent stops attempt 1 and drops it;
        # the retry (attempt 2) then runs on this agent.
        await eventually(
            lambda: system.view(task_id),
            lambda v: v["attempt"] == 2 and v["state"] == "running",
            timeout=30,
        )
        await eventually(_lost(running.agent), lambda n: n >= 1, timeout=30)
        await system.cp.cancel(task_id, ADMIN)
        await system.wait_state(task_id, "cancelled")

        # The state commits before the agent logs the reply it got.
        async def reports() -> int:
            return sum(1 for e in logs if e["event"] == "result_reported")

        await eventually(reports, lambda n: n >= 1, timeout=30)

    lost = [e for e in logs if e["event"] == "lease_lost"]
    assert [(e["task_id"], e["attempt"]) for e in lost] == [(task_id, 1)]
    reported = [(e["task_id"], e["attempt"]) for e in logs if e["event"] == "result_reported"]
    assert reported == [(task_id, 2)]


def _lost(agent: Agent) -> Callable[[], Awaitable[int]]:
    async def probe() -> int:
        return agent.stats.leases_lost

    return probe


# --- parallelism ----------------------------------------------------------------------------


class _Gate:
    """A runner that records how many attempts run at once and waits for a
    release, so that concurrency is observed, not inferred from timing."""

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0
        self.release = asyncio.Event()

    def factory(self) -> Any:
        gate = self

        class Runner:
            async def run(self, ctx: Any) -> Any:
                from fleetlease.hostagent.runners import RunOutcome

                gate.running += 1
                gate.peak = max(gate.peak, gate.running)
                try:
                    await gate.release.wait()
                finally:
                    gate.running -= 1
                return RunOutcome.done({"device": ctx.device_id})

        return Runner


async def test_devices_run_in_parallel_and_never_more_attempts_than_devices(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    system = await make_system()
    gate = _Gate()
    await system.add_host("h1")
    manager = SimulatedDeviceManager(2, prefix="h1-dev")
    agent = Agent(
        system.config("h1"),
        manager,
        runners={"sim-goal": gate.factory(), "sim-workflow": gate.factory()},
    )
    system.agents.append(RunningAgent(agent, asyncio.create_task(agent.run()), manager))
    ids = [await system.submit() for _ in range(5)]

    async def running_count() -> int:
        return gate.running

    await eventually(running_count, lambda n: n == 2)
    # Both devices are busy: the other three stay queued however long we look.
    views = [await system.view(t) for t in ids]
    assert sorted(v["state"] for v in views).count("running") == 2
    gate.release.set()
    for task_id in ids:
        await system.wait_state(task_id, "done")
    assert gate.peak == 2
    devices = {(await system.view(t))["attempts"][0]["device_id"] for t in ids}
    assert devices == {"h1-dev-0", "h1-dev-1"}


async def test_idle_devices_are_split_between_claims_and_each_covered_by_exactly_one(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    """The idle devices are split between up to ``claim_polls`` outstanding
    claims (a host's tasks are claimed side by side), and a claim that returns an
    assignment frees its other devices at once, before the journal write. A
    claim's own clean-up never uncovers a device a newer claim covers: each idle
    device stays covered by exactly one outstanding claim (with that bug, a freed
    device was covered by two claims and then by none, over and over)."""
    system = await make_system()
    gate = _Gate()
    await system.add_host("h1")
    manager = SimulatedDeviceManager(4, prefix="h1-dev")
    agent = Agent(
        system.config("h1", claim_polls=2),
        manager,
        runners={"sim-goal": gate.factory(), "sim-workflow": gate.factory()},
    )
    system.agents.append(RunningAgent(agent, asyncio.create_task(agent.run()), manager))

    def idle() -> set[str]:
        return {d.device_id for d in manager.snapshot() if d.state == "idle"}

    async def coverage() -> tuple[int, dict[str, int], set[str]]:
        # Checked at every look: no device is listed by two claims in flight.
        listed = [d for devices in agent.claims.outstanding.values() for d in devices]
        assert len(listed) == len(set(listed)), agent.claims.outstanding
        return len(agent.claims.polls), dict(agent.claims.covered), idle()

    def settled(c: tuple[int, dict[str, int], set[str]]) -> bool:
        polls, covered, idle_now = c
        return set(covered) == idle_now and polls == len(set(covered.values()))

    polls, covered, _ = await eventually(coverage, settled)
    assert polls == 2 and len(covered) == 4  # two claims of two devices each
    first = await system.submit()
    await eventually(lambda: _value(gate.running), lambda n: n == 1)
    polls, covered, idle_now = await eventually(coverage, settled)
    assert len(idle_now) == 3 and polls >= 2
    # A second task is claimed by one of those claims while the first runs.
    second = await system.submit()
    await eventually(lambda: _value(gate.running), lambda n: n == 2)
    await eventually(coverage, settled)
    gate.release.set()
    await system.wait_state(first, "done")
    await system.wait_state(second, "done")
    polls, covered, idle_now = await eventually(coverage, lambda c: settled(c) and len(c[2]) == 4)
    assert polls <= 4


async def test_a_device_reporting_its_result_is_claimed_for_and_handed_to_the_next_task(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    """While an attempt reports its result, its device is claimed for already:
    the control plane assigns it again at the result's commit and the parked
    claim takes that assignment at once. The agent acks the new task only once
    the report is answered, and the finished attempt hands the device over
    (never idle in between, never two attempts on it)."""
    system = await make_system()
    reported = asyncio.Event()
    answer = asyncio.Event()

    await system.add_host("h1")
    manager = SimulatedDeviceManager(1, prefix="h1-dev")
    agent = Agent(system.config("h1"), manager)
    report = agent.attempts.report

    async def slow_answer(att: Any) -> None:
        await report(att)  # the control plane has the result
        if not reported.is_set():
            reported.set()
            await answer.wait()  # and its answer is still on the way

    agent.attempts.report = slow_answer
    system.agents.append(RunningAgent(agent, asyncio.create_task(agent.run()), manager))
    first = await system.submit()
    second = await system.submit()
    await system.wait_state(first, "done")
    await eventually(lambda: _value(reported.is_set()), bool)
    # Claimed on the only device while the first report is unanswered (without
    # a claim for a reporting device it stays assigned until the answer)...
    await system.wait_state(second, "dispatched")
    await eventually(lambda: _value(agent.stats.handovers_waited), lambda n: n == 1)
    # ...and not acked before it: one attempt at a time on the device.
    assert (await system.view(second))["state"] == "dispatched"
    assert [d.state for d in manager.snapshot()] == ["busy"]
    answer.set()
    await system.wait_state(second, "done")
    await eventually(lambda: _value([d.state for d in manager.snapshot()]), lambda s: s == ["idle"])
    assert agent.stats.results_reported == 2


async def test_an_agent_stopping_while_an_assignment_waits_for_its_device_frees_it(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    """A stop cancels an assignment waiting for a reporting device: the finished
    attempt then frees the device instead of handing it over, the waiting task
    is never acked, and after its ack deadline it runs on a fresh agent."""
    system = await make_system(ack_s=2.0)
    answer = asyncio.Event()

    await system.add_host("h1")
    manager = SimulatedDeviceManager(1, prefix="h1-dev")
    agent = Agent(system.config("h1"), manager)
    report = agent.attempts.report

    async def slow_answer(att: Any) -> None:
        await report(att)
        await answer.wait()

    agent.attempts.report = slow_answer
    task = asyncio.create_task(agent.run())
    first = await system.submit()
    second = await system.submit()
    await system.wait_state(first, "done")
    await eventually(lambda: _value(agent.stats.handovers_waited), lambda n: n == 1)
    agent.stop()
    # The stop cancels the claims in flight, the waiting one included...
    await eventually(lambda: _value(dict(agent.state.handover)), lambda h: not h)
    answer.set()
    await asyncio.wait_for(task, 60)
    # ...so the finished attempt freed the device, and nobody acked the second.
    assert not agent.state.held and [d.state for d in manager.snapshot()] == ["idle"]
    assert (await system.view(second))["attempts"][0]["acked_at"] is None
    await system.start_agent("h1", devices=1)
    done = await system.wait_state(second, "done")
    assert done["attempt"] == 2


async def _value(v: T) -> T:
    return v


# --- registration -------------------------------------------------------------------------


async def test_host_b_with_host_a_credential_is_refused_and_b_is_untouched(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    from fleetlease.hostagent.agent import RegistrationRefused

    system = await make_system()
    credential_a = await system.add_host("host-a")
    await system.add_host("host-b")
    before = {h["host_id"]: h for h in await system.repo.list_hosts()}

    manager = SimulatedDeviceManager(2, prefix="b")
    agent = Agent(system.config("host-b", credential=credential_a), manager)
    with pytest.raises(RegistrationRefused) as info:
        await asyncio.wait_for(agent.run(), 30)

    assert "host-b" in str(info.value) and "refused" in str(info.value)
    assert credential_a not in str(info.value)
    after = {h["host_id"]: h for h in await system.repo.list_hosts()}
    assert after["host-b"] == before["host-b"]
    assert after["host-b"]["devices"] == 0


# --- sessions, restarts, shutdown -----------------------------------------------------------


async def test_superseded_session_reregisters_reconciles_and_finishes_the_attempt(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    from fleetlease.transport.client import HostClient

    system = await make_system(lease_s=3.0)
    running = await system.start_agent("h1")
    task_id = await system.submit({"duration_s": 2.0})
    await system.wait_state(task_id, "running")

    # Someone registers as h1 (same credential): the agent's session is dead.
    other = HostClient(
        nats_url=system.nats_url,
        host_id="h1",
        credential=system.credentials["h1"],
        prefix=system.prefix,
    )
    await other.connect()
    try:
        await other.register()
    finally:
        await other.close()

    view = await system.wait_state(task_id, "done")
    assert view["attempt"] == 1
    assert running.agent.stats.registrations >= 2
    assert running.agent.stats.leases_lost == 0


async def test_an_attempt_resumed_max_resumes_times_is_reported_as_a_retryable_failure(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    """The agent dies while running an attempt (here: its task is cancelled, so
    nothing is handed back and the journal entry stays); the next agent of the
    host, with ``max_resumes=0``, does not run it again but reports it failed
    and retryable, and the retry runs to done."""
    system = await make_system(lease_s=6.0)
    first = await system.start_agent("h1", devices=1)
    task_id = await system.submit({"duration_s": 1.5})
    await system.wait_state(task_id, "running")
    first.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first.task
    [entry] = await asyncio.to_thread(_journal_entries, system.agent_dir("h1"))
    assert entry.resumes == 0

    with capture_logs() as logs:
        await system.start_agent("h1", devices=1, max_resumes=0)
        view = await system.wait_state(task_id, "done", timeout=60)

    assert [(a["number"], a["end_reason"]) for a in view["attempts"]] == [
        (1, "retryable_failure"),
        (2, "done"),
    ]
    [given_up] = [e for e in logs if e["event"] == "attempt_given_up"]
    assert (given_up["task_id"], given_up["attempt"]) == (task_id, 1)
    assert given_up["reason"] == "agent died 1 time running this attempt"


def _journal_entries(directory: Path) -> list[Any]:
    with Journal.in_state_dir(directory) as journal:
        return journal.entries()


async def test_attempt_survives_a_control_plane_restart(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    system = await make_system(lease_s=6.0)
    await system.start_agent("h1")
    task_id = await system.submit({"duration_s": 1.5})
    await system.wait_state(task_id, "running")

    assert system.service is not None
    await system.service.stop()
    await system.start_service()

    view = await system.wait_state(task_id, "done")
    assert view["attempt"] == 1


async def test_stop_lets_short_attempts_finish_and_hands_back_the_rest(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    system = await make_system()
    running = await system.start_agent("h1", devices=2, grace_s=1.0)
    short = await system.submit({"duration_s": 0.3})
    hanging = await system.submit({"outcome": "hang"})
    await system.wait_state(hanging, "running")

    await running.stop()

    assert (await system.wait_state(short, "done"))["attempt"] == 1
    view = await system.view(hanging)
    assert view["state"] in ("queued", "retrying")
    assert view["attempts"][0]["end_reason"] == "retryable_failure"
    assert running.agent.stats.handed_back == 1
    assert await _journal_size(system.agent_dir("h1"))() == 0


def _spawn_nats(directory: Path, port: int) -> subprocess.Popen[bytes]:
    from fleetlease.ops.embedded import nats_server_binary

    directory.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-l", str(directory / "log")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def _nats_on_port(directory: Path, port: int) -> subprocess.Popen[bytes]:
    """A nats-server on exactly ``port`` (nats-server reuses the address, so a
    port in TIME_WAIT after the previous server is fine)."""
    proc = await asyncio.to_thread(_spawn_nats, directory, port)

    async def accepting() -> bool:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return False
        writer.close()
        await writer.wait_closed()
        return True

    await eventually(accepting, bool, timeout=15)
    return proc


async def test_attempt_survives_a_nats_restart_and_the_agent_reregisters(
    db_url: str, subject_prefix: str, state_dir: Path, tmp_path: Path
) -> None:
    from fleetlease.ops.embedded import free_port

    port = free_port()
    nats = await _nats_on_port(tmp_path / "nats1", port)
    system = System(
        db_url,
        f"nats://127.0.0.1:{port}",
        subject_prefix,
        state_dir,
        LeaseTimings(claim_s=10, ack_s=10, lease_s=10, liveness_s=30),
    )
    try:
        await system.start_service()
        await system.repo.add_user("admin", platform_admin=True)
        await system.repo.add_project("default", owner="admin")
        running = await system.start_agent("h1", devices=1)
        task_id = await system.submit({"duration_s": 2.0})
        await system.wait_state(task_id, "running")

        with capture_logs() as logs:
            nats.kill()
            await asyncio.to_thread(nats.wait)
            nats = await _nats_on_port(tmp_path / "nats2", port)
            view = await system.wait_state(task_id, "done", timeout=60)
            await eventually(_journal_size(system.agent_dir("h1")), lambda n: n == 0, timeout=10)

        assert view["attempt"] == 1
        registered = [e for e in logs if e["event"] == "agent_registered"]
        assert registered and registered[0]["reason"] == "nats_reconnected"
        reconciled = [e for e in logs if e["event"] == "reconcile_done"]
        assert reconciled and reconciled[0]["confirmed"] == 1
        assert running.agent.stats.leases_lost == 0
        reported = [e for e in logs if e["event"] == "result_reported"]
        assert [e["task_id"] for e in reported] == [task_id]
    finally:
        for agent in system.agents:
            agent.agent.stop()
        for agent in system.agents:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(agent.task, 60)
        if system.service is not None:
            await system.service.stop()
        nats.kill()
        await asyncio.to_thread(nats.wait)


async def test_logs_never_carry_the_credential_or_lease_tokens(
    make_system: Callable[..., Awaitable[System]],
) -> None:
    system = await make_system()
    with capture_logs() as logs:
        running = await system.start_agent("h1")
        task_id = await system.submit({"duration_s": 0.05, "log_lines": 2})
        await system.wait_state(task_id, "done")
        await running.stop()

    [attempt] = [e for e in logs if e["event"] == "assignment_received"]
    assert attempt["task_id"] == task_id
    credential = system.credentials["h1"]
    text = repr(logs)
    assert credential not in text
    # Lease tokens are never logged under any key.
    assert not [e for e in logs if any("token" in k for k in e)]


async def test_stop_while_no_control_plane_answers_returns_without_registering(
    nats_url: str, subject_prefix: str, tmp_path: Path
) -> None:
    config = AgentConfig(
        host_id="h1",
        credential="cd" * 32,
        nats_url=nats_url,
        state_dir=tmp_path / "agent",
        prefix=subject_prefix,  # nobody serves this prefix
        resync_jitter_s=0.0,
        backoff_base_s=0.05,
        backoff_cap_s=0.2,
    )
    agent = Agent(config, SimulatedDeviceManager(1))
    with capture_logs() as logs:
        task = asyncio.create_task(agent.run())
        await eventually(_events_named(logs, "registration_failed"), lambda n: n >= 2, timeout=30)
        agent.stop()
        await asyncio.wait_for(task, 30)

    assert not agent.started.is_set()
    assert not [e for e in logs if e["event"] == "agent_registered"]


def _events_named(logs: list[dict[str, Any]], name: str) -> Callable[[], Awaitable[int]]:
    async def probe() -> int:
        return sum(e["event"] == name for e in logs)

    return probe
