"""Real execution: workflow steps and goal commands as processes on the host.

Each attempt gets a fresh workspace under the agent's state dir (removed
afterwards) with an ``artifacts/`` folder in it. A step's environment is built
from scratch: a few harmless variables of the agent's own (``PATH``, ``HOME``,
locale, ``TMPDIR``), the step's declared ``env``, and the runner's
``FLEETLEASE_*`` variables naming the task, attempt, device, workspace and the
task's inputs. Nothing else of the agent's environment is passed on, so its
credential and session key never reach a step, and an input is only ever an
environment variable: never part of a command line.

A step may print marked lines, read by the runner and not logged::

    ::fleetlease::progress::<text>            progress shown on the task
    ::fleetlease::result::<key>=<value>       a field of the task's result

Outcome: every step exited 0 -> done; an exit code the step lists in
``retryable-exit-codes`` -> failed, retryable; any other exit, a timeout, or a
signal -> failed, with the step, its exit code and its last lines in the result.
A step with ``continue-on-error`` records its failure and the workflow goes on.
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from fleetlease.hostagent.runners.base import RunContext, RunOutcome
from fleetlease.hostagent.runners.process import ProcessResult, run_process_group
from fleetlease.hostagent.workflows import (
    InputError,
    Step,
    WorkflowDefinition,
    input_environment,
)

__all__ = [
    "CommandGoalRunner",
    "ProcessWorkflowRunner",
    "StepEnvironment",
    "base_environment",
]

log = structlog.get_logger(__name__)

MARKER = "::fleetlease::"
#: Variables of the agent's environment a step inherits; nothing else is.
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "USER", "LOGNAME")
#: What one attempt may upload in all (the control plane's per-artifact limit is larger).
MAX_ATTEMPT_ARTIFACT_BYTES = 256 * 1024 * 1024
MAX_RESULT_FIELDS = 64
MAX_RESULT_VALUE = 4096

#: Device id -> extra environment for it (e.g. ``ANDROID_SERIAL`` of an adb device).
DeviceEnvironment = Callable[[str], Mapping[str, str]]


def base_environment(source: Mapping[str, str] | None = None) -> dict[str, str]:
    """The inherited part of a step's environment (see ``INHERITED_ENV``)."""
    src = os.environ if source is None else source
    env = {k: src[k] for k in INHERITED_ENV if k in src}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    return env


@dataclass(kw_only=True)
class StepEnvironment:
    """What a step runs with: its workspace and its environment variables."""

    workspace: Path
    artifacts: Path
    env: dict[str, str] = field(default_factory=dict)


def _no_device_env(device_id: str) -> Mapping[str, str]:
    return {}


class _Attempt:
    """The state of one attempt's execution: workspace, uploads, result fields."""

    def __init__(self, ctx: RunContext, root: Path) -> None:
        self.ctx = ctx
        self.workspace = root / f"{ctx.task_id}-{ctx.attempt}"
        self.artifacts = self.workspace / "artifacts"
        self.result: dict[str, Any] = {}
        self.uploaded: dict[str, tuple[int, int]] = {}
        self.uploaded_bytes = 0

    def prepare(self) -> None:
        if self.workspace.exists():
            shutil.rmtree(self.workspace, ignore_errors=True)
        self.artifacts.mkdir(parents=True, mode=0o700)

    def cleanup(self) -> None:
        shutil.rmtree(self.workspace, ignore_errors=True)

    def on_line(self, line: str) -> None:
        if line.startswith(MARKER):
            self._marker(line[len(MARKER) :])
            return
        self.ctx.log(line)

    def _marker(self, rest: str) -> None:
        kind, _, value = rest.partition("::")
        if kind == "progress":
            self.ctx.progress(value[:MAX_RESULT_VALUE])
        elif kind == "result":
            key, sep, val = value.partition("=")
            key = key.strip()
            if sep and key and (key in self.result or len(self.result) < MAX_RESULT_FIELDS):
                self.result[key[:128]] = val[:MAX_RESULT_VALUE]
        else:
            self.ctx.log(MARKER + rest)

    def collect(self, globs: tuple[str, ...]) -> list[tuple[str, Path]]:
        """Files to upload: everything under ``artifacts/`` and the step's globs
        (relative to the workspace, never outside it), new or changed since
        the last collection."""
        found: dict[str, Path] = {}
        for path in sorted(self.artifacts.rglob("*")):
            if path.is_file() and not path.is_symlink():
                found[path.relative_to(self.artifacts).as_posix()] = path
        ws = self.workspace.resolve()
        for pattern in globs:
            for hit in sorted(glob.glob(pattern, root_dir=self.workspace, recursive=True)):
                path = (self.workspace / hit).resolve()
                if (
                    path.is_file()
                    and path.is_relative_to(ws)
                    and not path.is_relative_to(self.artifacts.resolve())
                ):
                    found.setdefault(Path(hit).as_posix(), path)
        fresh: list[tuple[str, Path]] = []
        for name, path in found.items():
            st = path.stat()
            mark = (st.st_size, st.st_mtime_ns)
            if self.uploaded.get(name) != mark:
                fresh.append((name, path))
                self.uploaded[name] = mark
        return fresh

    async def upload(self, globs: tuple[str, ...]) -> None:
        loop = asyncio.get_running_loop()
        for name, path in await loop.run_in_executor(None, self.collect, globs):
            size = path.stat().st_size
            if self.uploaded_bytes + size > MAX_ATTEMPT_ARTIFACT_BYTES:
                self.ctx.log(
                    f"artifact {name} not uploaded: the attempt's artifacts exceed "
                    f"{MAX_ATTEMPT_ARTIFACT_BYTES} bytes"
                )
                continue
            data = await loop.run_in_executor(None, path.read_bytes)
            self.uploaded_bytes += len(data)
            self.ctx.artifact(name, data)


def _step_failure(step: Step, res: ProcessResult) -> str:
    if res.stopped == "timeout":
        return f"step {step.name!r} timed out"
    if res.exit_code is not None and res.exit_code < 0:
        return f"step {step.name!r} was killed by signal {-res.exit_code}"
    return f"step {step.name!r} exited {res.exit_code}"


class ProcessWorkflowRunner:
    """Runs workflow tasks from the host's definitions, each step a process group.

    ``definitions`` are the workflows this host serves; ``work_root`` is where
    attempt workspaces are made; ``device_env`` gives a device's extra variables;
    ``on_group`` tells the agent each process group it starts, so that after a
    crash it can end the groups of attempts it no longer runs.
    """

    def __init__(
        self,
        definitions: Mapping[str, WorkflowDefinition],
        work_root: Path,
        *,
        device_env: DeviceEnvironment = _no_device_env,
        grace_s: float = 10.0,
        environ: Mapping[str, str] | None = None,
        on_group: Callable[[RunContext, int], None] | None = None,
    ) -> None:
        self.definitions = dict(definitions)
        self.work_root = work_root
        self.device_env = device_env
        self.grace_s = grace_s
        self._base_env = base_environment(environ)
        self._on_group = on_group

    async def run(self, ctx: RunContext) -> RunOutcome:
        wf = self.definitions.get(ctx.workflow or "")
        if wf is None:
            return RunOutcome.failed(f"this host has no workflow {ctx.workflow!r}", retryable=True)
        try:
            inputs = wf.resolve_inputs(_inputs_of(ctx.payload))
        except InputError as exc:
            return RunOutcome.failed(str(exc))
        return await self.run_definition(ctx, wf, inputs)

    async def run_definition(
        self,
        ctx: RunContext,
        wf: WorkflowDefinition,
        inputs: Mapping[str, str | int | float | bool],
        *,
        extra_env: Mapping[str, str] | None = None,
    ) -> RunOutcome:
        """Run ``wf`` for ``ctx`` in a fresh workspace, removed afterwards."""
        attempt = _Attempt(ctx, self.work_root)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, attempt.prepare)
        try:
            return await self._run_steps(ctx, wf, inputs, attempt, dict(extra_env or {}))
        finally:
            await loop.run_in_executor(None, attempt.cleanup)

    def _env(
        self,
        ctx: RunContext,
        wf: WorkflowDefinition,
        step: Step,
        attempt: _Attempt,
        inputs: Mapping[str, str | int | float | bool],
        extra_env: Mapping[str, str],
    ) -> dict[str, str]:
        env = dict(self._base_env)
        env.update(step.env)
        env.update(self.device_env(ctx.device_id))
        env.update(input_environment(inputs))
        env.update(extra_env)
        env.update({
            "FLEETLEASE_TASK_ID": ctx.task_id,
            "FLEETLEASE_ATTEMPT": str(ctx.attempt),
            "FLEETLEASE_DEVICE_ID": ctx.device_id,
            "FLEETLEASE_WORKFLOW": wf.name,
            "FLEETLEASE_STEP": step.name,
            "FLEETLEASE_WORKSPACE": str(attempt.workspace),
            "FLEETLEASE_ARTIFACTS": str(attempt.artifacts),
        })  # fmt: skip
        return env

    async def _run_steps(
        self,
        ctx: RunContext,
        wf: WorkflowDefinition,
        inputs: Mapping[str, str | int | float | bool],
        attempt: _Attempt,
        extra_env: Mapping[str, str],
    ) -> RunOutcome:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wf.timeout_s
        failures: list[dict[str, Any]] = []
        for step in wf.steps:
            if ctx.cancelled.is_set():
                return RunOutcome.cancelled(result=attempt.result)
            left = deadline - loop.time()
            if left <= 0:
                return self._failed(attempt, f"workflow {wf.name!r} timed out", step, None)
            timeout = min(step.timeout_s or left, left)
            ctx.log(f"::step {step.name}")
            res = await run_process_group(
                step.run,
                cwd=attempt.workspace,
                env=self._env(ctx, wf, step, attempt, inputs, extra_env),
                on_line=attempt.on_line,
                timeout_s=timeout,
                stop=ctx.cancelled,
                grace_s=self.grace_s,
                on_start=self._group_started(ctx),
            )
            await attempt.upload(step.artifacts)
            if res.stopped == "cancelled":
                return RunOutcome.cancelled(result=attempt.result)
            if res.exit_code == 0 and res.stopped is None:
                continue
            if res.stopped == "timeout" and (step.timeout_s or 0) > left:
                return self._failed(attempt, f"workflow {wf.name!r} timed out", step, res)
            if step.continue_on_error:
                failures.append({"step": step.name, "exit_code": res.exit_code})
                continue
            retryable = res.stopped is None and res.exit_code in step.retryable_exit_codes
            return self._failed(attempt, _step_failure(step, res), step, res, retryable=retryable)
        if failures:
            attempt.result.setdefault("continued_after", failures)
        return RunOutcome.done(result=attempt.result)

    def _group_started(self, ctx: RunContext) -> Callable[[int], None] | None:
        on_group = self._on_group
        if on_group is None:
            return None

        def started(pgid: int) -> None:
            on_group(ctx, pgid)

        return started

    @staticmethod
    def _failed(
        attempt: _Attempt,
        reason: str,
        step: Step,
        res: ProcessResult | None,
        *,
        retryable: bool = False,
    ) -> RunOutcome:
        result = dict(attempt.result)
        result["failed_step"] = step.name
        if res is not None:
            result["exit_code"] = res.exit_code
            result["output_tail"] = list(res.tail)
        return RunOutcome.failed(reason, retryable=retryable, result=result)


def _inputs_of(payload: Mapping[str, Any]) -> Mapping[str, Any]:
    inputs = payload.get("inputs", {})
    if not isinstance(inputs, Mapping):
        raise InputError("payload 'inputs' must be an object")
    return inputs


class CommandGoalRunner:
    """Runs goal tasks through an executable of the host's choosing (the
    automation runtime that turns a goal into device actions). The goal is in
    ``FLEETLEASE_GOAL``, the device in ``FLEETLEASE_DEVICE_ID``; streaming,
    artifacts, stopping and the outcome follow the workflow step's rules (exit
    75, ``EX_TEMPFAIL``, is retryable)."""

    RETRYABLE_EXIT_CODES = frozenset({75})

    def __init__(
        self,
        command: str,
        work_root: Path,
        *,
        device_env: DeviceEnvironment = _no_device_env,
        grace_s: float = 10.0,
        timeout_s: float = 3600.0,
        environ: Mapping[str, str] | None = None,
        on_group: Callable[[RunContext, int], None] | None = None,
    ) -> None:
        self.command = command
        self.definition = WorkflowDefinition(
            name="goal",
            timeout_s=timeout_s,
            steps=(Step(name="goal", run=command, retryable_exit_codes=self.RETRYABLE_EXIT_CODES),),
        )
        self._runner = ProcessWorkflowRunner(
            {}, work_root, device_env=device_env, grace_s=grace_s, environ=environ,
            on_group=on_group,
        )  # fmt: skip

    async def run(self, ctx: RunContext) -> RunOutcome:
        return await self._runner.run_definition(
            ctx, self.definition, {}, extra_env={"FLEETLEASE_GOAL": ctx.goal or ""}
        )
