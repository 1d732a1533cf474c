"""Real execution in the agent: which runners serve a host's tasks, the
environment a device adds to a step, and the process groups left behind by an
agent that died.

``fleetlease agent --workflows DIR`` serves the definitions of ``DIR`` with the
process workflow runner; ``--goal-command CMD`` runs goal tasks through ``CMD``.
Without them, the runners named by ``--workflow-runner`` / ``--goal-runner``
(the simulated ones by default) are used.

Process groups. Every step runs in a process group of its own (a new session),
which outlives the agent if the agent is killed. The agent records each group
in the attempt's journal entry as it starts, with the start time of its leader
(from ``/proc``). A restarted agent ends the groups of the attempts it is not
running (SIGTERM, then SIGKILL) before it reconciles. The start time guards
against a reused pid: a live leader whose start time differs is another
process, left alone; a group whose leader has exited is still ours, since
Linux never hands out a pid while a process group of that id exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog

from fleetlease.hostagent.devices import DeviceInfo
from fleetlease.hostagent.journal import Journal, JournalRecord, JournalThread
from fleetlease.hostagent.runners.base import RunContext, RunnerFactory
from fleetlease.hostagent.runners.workflow import CommandGoalRunner, ProcessWorkflowRunner
from fleetlease.hostagent.workflows import DefinitionError, WorkflowDefinition, load_workflows
from fleetlease.transport.wire.messages import MAX_WORKFLOWS

__all__ = [
    "COMMAND_GOAL_RUNNER",
    "PROCESS_WORKFLOW_RUNNER",
    "ExecutionPlan",
    "GroupRecorder",
    "device_environment",
    "end_orphan_groups",
    "end_recorded_groups",
    "group_leader_start",
    "load_definitions",
    "plan_execution",
]

log = structlog.get_logger(__name__)

#: Runner names the agent reports for the real runners.
PROCESS_WORKFLOW_RUNNER = "process-workflow"
COMMAND_GOAL_RUNNER = "command-goal"
#: Workspaces of attempts live here, under the agent's state dir.
WORK_DIRNAME = "work"


def group_leader_start(pid: int) -> int | None:
    """The start time (clock ticks since boot, field 22 of ``/proc/PID/stat``)
    of process ``pid``, or None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text.rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state): field 22 is fields[19].
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours(pgid: int, start: int | None) -> bool:
    now = group_leader_start(pgid)
    if now is None:
        # Leader gone: only members of the recorded group can carry its id.
        return True
    return start is not None and now == start


async def end_recorded_groups(groups: Iterable[tuple[int, int | None]], grace_s: float) -> int:
    """End every recorded process group still alive (SIGTERM to the group, SIGKILL
    after ``grace_s``); returns how many were signalled."""
    return len(await _end_groups(groups, grace_s))


async def _end_groups(groups: Iterable[tuple[int, int | None]], grace_s: float) -> list[int]:
    """``end_recorded_groups``, returning the groups signalled."""
    targets: list[int] = []
    for pgid, start in groups:
        if pgid <= 1 or pgid == os.getpgrp():
            continue
        if _group_alive(pgid) and _ours(pgid, start):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGTERM)
                targets.append(pgid)
    if not targets:
        return targets
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while loop.time() < deadline:
        if not any(_group_alive(g) for g in targets):
            return targets
        await asyncio.sleep(0.05)
    for pgid in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    return targets


async def end_orphan_groups(
    entries: Iterable[JournalRecord], calls: JournalThread, journal: Journal, *, grace_s: float
) -> None:
    """End the process groups recorded for ``entries`` (attempts this agent
    process is not running) and forget them in the journal. Every group gets
    its SIGTERM at once and one grace period is waited in all, so many orphans
    cost one grace period, not one each."""
    orphans = [e for e in entries if e.groups]
    if not orphans:
        return
    signalled = set(await _end_groups([g for e in orphans for g in e.groups], grace_s))
    for entry in orphans:
        log.info(
            "orphan_process_groups_ended",
            task_id=entry.task_id,
            attempt=entry.attempt,
            recorded=len(entry.groups),
            signalled=sum(1 for pgid, _start in entry.groups if pgid in signalled),
        )
        await calls.call(journal.clear_groups, entry.task_id, entry.attempt)


class _GroupSink(Protocol):
    def record_process_group(
        self, task_id: str, attempt: int, pgid: int, start: int | None
    ) -> None: ...


class GroupRecorder:
    """The runners' ``on_group`` callback, bound to the agent once it exists."""

    def __init__(self) -> None:
        self.sink: _GroupSink | None = None

    def __call__(self, ctx: RunContext, pgid: int) -> None:
        sink = self.sink
        if sink is not None:
            sink.record_process_group(ctx.task_id, ctx.attempt, pgid, group_leader_start(pgid))


def device_environment(snapshot: Callable[[], list[DeviceInfo]]) -> Callable[[str], dict[str, str]]:
    """A device's extra step environment: ``FLEETLEASE_DEVICE_SERIAL`` always,
    ``ANDROID_SERIAL`` for an Android device (its id is its adb serial)."""

    def env(device_id: str) -> dict[str, str]:
        out = {"FLEETLEASE_DEVICE_SERIAL": device_id}
        for d in snapshot():
            if d.device_id == device_id and d.capabilities.get("platform") == "android":
                out["ANDROID_SERIAL"] = device_id
        return out

    return env


def load_definitions(
    directory: Path, *, report: Callable[[str], None]
) -> dict[str, WorkflowDefinition]:
    """The valid definitions of ``directory``; each invalid file is logged
    (``workflow_invalid`` with file and line) and passed to ``report``."""
    if not directory.is_dir():
        raise ValueError(f"--workflows {directory}: not a directory")
    found, errors = load_workflows(directory)
    for err in errors:
        _log_invalid(err)
        report(f"fleetlease agent: invalid workflow definition: {err}")
    log.info("workflows_loaded", directory=str(directory), workflows=sorted(found),
             invalid=len(errors))  # fmt: skip
    return found


def _log_invalid(err: DefinitionError) -> None:
    log.warning("workflow_invalid", path=err.path, line=err.line, error=err.message)


@dataclass(kw_only=True)
class ExecutionPlan:
    """The runners an agent uses and what it advertises about them."""

    goal_runner: str
    workflow_runner: str
    runners: dict[str, RunnerFactory] = field(default_factory=dict)
    #: The workflows served; None: whatever the workflow runner is asked for.
    workflows: tuple[str, ...] | None = None
    recorder: GroupRecorder = field(default_factory=GroupRecorder)

    def bind(self, sink: Any) -> None:
        self.recorder.sink = sink


def plan_execution(
    *,
    state_dir: Path,
    available: Mapping[str, RunnerFactory],
    goal_runner: str,
    workflow_runner: str,
    workflows_dir: Path | None,
    goal_command: str | None,
    device_snapshot: Callable[[], list[DeviceInfo]],
    grace_s: float,
    report: Callable[[str], None],
) -> ExecutionPlan:
    """Choose the runners from the command line (see the module doc)."""
    plan = ExecutionPlan(
        goal_runner=goal_runner, workflow_runner=workflow_runner, runners=dict(available)
    )
    work_root = state_dir / WORK_DIRNAME
    env = device_environment(device_snapshot)
    if workflows_dir is not None:
        definitions = load_definitions(workflows_dir, report=report)
        recorder = plan.recorder

        def make_workflow_runner() -> ProcessWorkflowRunner:
            return ProcessWorkflowRunner(
                definitions, work_root, device_env=env, grace_s=grace_s, on_group=recorder
            )

        if len(definitions) > MAX_WORKFLOWS:
            raise ValueError(
                f"--workflows: {len(definitions)} workflows, at most {MAX_WORKFLOWS} per host"
            )
        plan.runners[PROCESS_WORKFLOW_RUNNER] = make_workflow_runner
        plan.workflow_runner = PROCESS_WORKFLOW_RUNNER
        plan.workflows = tuple(sorted(definitions))
    if goal_command is not None:
        if not goal_command.strip():
            raise ValueError("--goal-command must be non-empty")
        recorder = plan.recorder

        def make_goal_runner() -> CommandGoalRunner:
            return CommandGoalRunner(
                goal_command, work_root, device_env=env, grace_s=grace_s, on_group=recorder
            )

        plan.runners[COMMAND_GOAL_RUNNER] = make_goal_runner
        plan.goal_runner = COMMAND_GOAL_RUNNER
    return plan
