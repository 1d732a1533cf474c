"""Simulated runners for tests, demos and chaos runs: they do nothing to a
device but behave, from the agent's side, like real ones (logs, an artifact,
a duration, any outcome, a hang or a crash), as the task payload asks.

Payload of a goal task::

    {"sim": {"duration_s": 0.1, "outcome": "done", "log_lines": 0, "artifact_bytes": 0}}

``outcome`` is one of ``done``, ``failed``, ``retryable`` (failed, retryable),
``hang`` (never finishes until cancelled), ``crash`` (raises ``RuntimeError``,
on purpose, to exercise ``run_safely``) or ``kill_agent`` (SIGKILLs the agent
process after the duration: a poison task, for the fault suite). Every field is optional; unknown
fields are ignored. A workflow task's payload is ``{"steps": [<sim dict>, ...]}``.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from fleetlease.hostagent.runners.base import RunContext, RunOutcome

__all__ = [
    "MAX_ARTIFACT_BYTES",
    "SimPayloadError",
    "SimSpec",
    "SimulatedGoalRunner",
    "SimulatedWorkflowRunner",
    "parse_sim",
]

SimOutcome = Literal["done", "failed", "retryable", "hang", "crash", "kill_agent"]
_SIM_OUTCOMES: tuple[str, ...] = ("done", "failed", "retryable", "hang", "crash", "kill_agent")

#: The artifact is built in memory; a payload must not be able to exhaust the host.
MAX_ARTIFACT_BYTES = 64 * 1024 * 1024
# Yield to the loop every so many log lines so a large count neither starves
# the heartbeat nor delays noticing a cancel.
_LOG_YIELD_EVERY = 500
_ARTIFACT_PATTERN = b"fleetlease simulated artifact\n"


class SimPayloadError(ValueError):
    """The simulation payload is malformed; ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"invalid payload field {field!r}: {message}")
        self.field = field


@dataclass(frozen=True, kw_only=True)
class SimSpec:
    duration_s: float = 0.1
    outcome: SimOutcome = "done"
    log_lines: int = 0
    artifact_bytes: int = 0


def _int_field(raw: Mapping[str, Any], key: str, where: str) -> int:
    value = raw.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SimPayloadError(f"{where}.{key}", f"must be an integer, got {type(value).__name__}")
    if value < 0:
        raise SimPayloadError(f"{where}.{key}", f"must be >= 0, got {value}")
    return value


def parse_sim(raw: object, *, where: str = "sim") -> SimSpec:
    """Validate one sim dict; raises ``SimPayloadError`` naming the field."""
    if not isinstance(raw, Mapping):
        raise SimPayloadError(where, f"must be an object, got {type(raw).__name__}")
    duration = raw.get("duration_s", 0.1)
    if isinstance(duration, bool) or not isinstance(duration, int | float):
        raise SimPayloadError(
            f"{where}.duration_s", f"must be a number, got {type(duration).__name__}"
        )
    if not math.isfinite(duration) or duration < 0:
        raise SimPayloadError(
            f"{where}.duration_s", f"must be a finite number >= 0, got {duration}"
        )
    outcome = raw.get("outcome", "done")
    if not isinstance(outcome, str):
        raise SimPayloadError(f"{where}.outcome", f"must be a string, got {type(outcome).__name__}")
    if outcome not in _SIM_OUTCOMES:
        raise SimPayloadError(f"{where}.outcome", f"must be one of {list(_SIM_OUTCOMES)}")
    log_lines = _int_field(raw, "log_lines", where)
    artifact_bytes = _int_field(raw, "artifact_bytes", where)
    if artifact_bytes > MAX_ARTIFACT_BYTES:
        raise SimPayloadError(
            f"{where}.artifact_bytes", f"must be <= {MAX_ARTIFACT_BYTES}, got {artifact_bytes}"
        )
    return SimSpec(
        duration_s=float(duration),
        outcome=cast(SimOutcome, outcome),
        log_lines=log_lines,
        artifact_bytes=artifact_bytes,
    )


def _artifact_data(size: int) -> bytes:
    # Deterministic, so a repeated run produces the same bytes.
    repeats = size // len(_ARTIFACT_PATTERN) + 1
    return (_ARTIFACT_PATTERN * repeats)[:size]


async def _wait_cancelled(ctx: RunContext, timeout_s: float | None) -> bool:
    """Wait up to ``timeout_s`` (forever if None); True if cancelled meanwhile."""
    if ctx.cancelled.is_set():
        return True
    try:
        await asyncio.wait_for(ctx.cancelled.wait(), timeout_s)
    except TimeoutError:
        return False
    return True


async def _run_step(ctx: RunContext, spec: SimSpec, *, label: str, artifact_name: str) -> bool:
    """Emit the step's logs and artifact and wait its duration. Returns False if
    cancelled before the end; raises ``RuntimeError`` for ``crash``."""
    for i in range(spec.log_lines):
        ctx.log(f"{label}: simulated log line {i + 1}/{spec.log_lines}")
        if (i + 1) % _LOG_YIELD_EVERY == 0:
            await asyncio.sleep(0)
            if ctx.cancelled.is_set():
                return False
    if spec.artifact_bytes:
        ctx.artifact(artifact_name, _artifact_data(spec.artifact_bytes))
    if spec.outcome == "hang":
        await _wait_cancelled(ctx, None)
        return False
    if await _wait_cancelled(ctx, spec.duration_s):
        return False
    if spec.outcome == "crash":
        raise RuntimeError(f"{label}: simulated crash")
    if spec.outcome == "kill_agent":
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _ending(spec: SimSpec, result: dict[str, Any]) -> RunOutcome:
    if spec.outcome == "failed":
        return RunOutcome.failed("simulated failure", result=result)
    if spec.outcome == "retryable":
        return RunOutcome.failed("simulated retryable failure", retryable=True, result=result)
    return RunOutcome.done(result)


class SimulatedGoalRunner:
    """A ``TaskRunner`` driven by ``payload["sim"]`` (see the module docstring).
    Never raises, except for outcome ``crash``, whose point is to raise."""

    async def run(self, ctx: RunContext) -> RunOutcome:
        try:
            spec = parse_sim(ctx.payload.get("sim", {}), where="sim")
        except SimPayloadError as exc:
            return RunOutcome.failed(str(exc), retryable=False)
        ctx.progress("simulated goal started")
        if not await _run_step(ctx, spec, label="goal", artifact_name="output.bin"):
            return RunOutcome.cancelled()
        return _ending(
            spec,
            {"simulated": True, "log_lines": spec.log_lines, "artifact_bytes": spec.artifact_bytes},
        )


class SimulatedWorkflowRunner:
    """A ``WorkflowRunner`` running ``payload["steps"]`` in order, each a sim
    dict like the goal runner's. It stops at the first step that does not end
    ``done`` and returns that step's outcome; the result always carries
    ``steps_completed``. Every step is validated before the first one runs.
    Step ``i`` (1-based) emits its artifact as ``step-<i>-output.bin``."""

    async def run(self, ctx: RunContext) -> RunOutcome:
        raw_steps = ctx.payload.get("steps", [])
        if not isinstance(raw_steps, list):
            return RunOutcome.failed(
                f"invalid payload field 'steps': must be a list, got {type(raw_steps).__name__}"
            )
        try:
            specs = [parse_sim(s, where=f"steps[{i}]") for i, s in enumerate(raw_steps)]
        except SimPayloadError as exc:
            return RunOutcome.failed(str(exc), retryable=False)
        completed = 0
        for index, spec in enumerate(specs, start=1):
            ctx.progress(f"step {index}/{len(specs)}")
            label = f"step {index}"
            finished = await _run_step(
                ctx, spec, label=label, artifact_name=f"step-{index}-output.bin"
            )
            result: dict[str, Any] = {"steps_completed": completed, "steps_total": len(specs)}
            if not finished:
                return RunOutcome.cancelled(result=result)
            if spec.outcome != "done":
                return _ending(spec, result)
            completed += 1
        return RunOutcome.done({"steps_completed": completed, "steps_total": len(specs)})
