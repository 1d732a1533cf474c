from __future__ import annotations

import asyncio
import tomllib
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from fleetlease.hostagent.runners import (
    RunContext,
    RunOutcome,
    TaskRunner,
    WorkflowRunner,
    builtin_runners,
    guard,
    load_runners,
    run_safely,
)
from fleetlease.hostagent.runners import base as runners_base
from fleetlease.hostagent.runners.simulated import SimulatedGoalRunner, SimulatedWorkflowRunner
from fleetlease.persistence.model import Outcome, TaskKind

# A guard against a hung test, not a timing assertion.
GUARD_S = 10.0


@dataclass
class Sink:
    lines: list[str] = field(default_factory=list)
    artifacts: list[tuple[str, bytes]] = field(default_factory=list)
    progress: list[str] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)

    def on_progress(self, message: str) -> None:
        self.progress.append(message)
        self.started.set()


def make_ctx(payload: dict[str, Any], *, kind: TaskKind = TaskKind.GOAL) -> tuple[RunContext, Sink]:
    sink = Sink()
    ctx = RunContext(
        task_id="task-1",
        attempt=1,
        device_id="sim-0",
        kind=kind,
        goal="do it" if kind is TaskKind.GOAL else None,
        workflow="flow" if kind is TaskKind.WORKFLOW else None,
        payload=payload,
        log=sink.lines.append,
        artifact=lambda name, data: sink.artifacts.append((name, data)),
        progress=sink.on_progress,
    )
    return ctx, sink


def sim(**fields: Any) -> dict[str, Any]:
    return {"sim": {"duration_s": 0, **fields}}


async def run_goal(payload: dict[str, Any]) -> tuple[RunOutcome, Sink]:
    ctx, sink = make_ctx(payload)
    outcome = await asyncio.wait_for(SimulatedGoalRunner().run(ctx), GUARD_S)
    return outcome, sink


async def run_workflow(payload: dict[str, Any]) -> tuple[RunOutcome, Sink]:
    ctx, sink = make_ctx(payload, kind=TaskKind.WORKFLOW)
    outcome = await asyncio.wait_for(SimulatedWorkflowRunner().run(ctx), GUARD_S)
    return outcome, sink


# -- RunOutcome ----------------------------------------------------------------------


def test_run_outcome_coerces_a_plain_string_outcome() -> None:
    outcome = RunOutcome(outcome="done")  # type: ignore[arg-type]

    assert outcome.outcome is Outcome.DONE


@pytest.mark.parametrize(
    "kwargs",
    [
        {"outcome": "finished"},
        {"outcome": Outcome.DONE, "retryable": True},
        {"outcome": Outcome.CANCELLED, "retryable": True},
    ],
)
def test_run_outcome_rejects_inconsistent_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RunOutcome(**kwargs)


# -- simulated goal ----------------------------------------------------------------------


async def test_goal_without_sim_payload_is_done() -> None:
    outcome, sink = await run_goal({})

    assert outcome.outcome is Outcome.DONE
    assert outcome.retryable is False
    assert sink.progress


async def test_goal_done_emits_its_log_lines_and_artifact() -> None:
    outcome, sink = await run_goal(sim(outcome="done", log_lines=3, artifact_bytes=100))

    assert outcome == RunOutcome.done({"simulated": True, "log_lines": 3, "artifact_bytes": 100})
    assert len(sink.lines) == 3
    assert [(name, len(data)) for name, data in sink.artifacts] == [("output.bin", 100)]


async def test_goal_emits_many_log_lines() -> None:
    outcome, sink = await run_goal(sim(log_lines=1234))

    assert outcome.outcome is Outcome.DONE
    assert len(sink.lines) == 1234


async def test_goal_artifact_is_deterministic() -> None:
    _, first = await run_goal(sim(artifact_bytes=1000))
    _, second = await run_goal(sim(artifact_bytes=1000))

    assert first.artifacts == second.artifacts


async def test_goal_failed_is_not_retryable() -> None:
    outcome, _ = await run_goal(sim(outcome="failed"))

    assert (outcome.outcome, outcome.retryable, outcome.reason) == (
        Outcome.FAILED,
        False,
        "simulated failure",
    )


async def test_goal_retryable_is_a_retryable_failure() -> None:
    outcome, _ = await run_goal(sim(outcome="retryable"))

    assert (outcome.outcome, outcome.retryable, outcome.reason) == (
        Outcome.FAILED,
        True,
        "simulated retryable failure",
    )


async def test_goal_crash_raises_runtime_error() -> None:
    ctx, _ = make_ctx(sim(outcome="crash"))

    with pytest.raises(RuntimeError):
        await SimulatedGoalRunner().run(ctx)


async def test_run_safely_turns_a_crash_into_a_non_retryable_failure() -> None:
    ctx, _ = make_ctx(sim(outcome="crash"))

    with capture_logs() as logs:
        outcome = await run_safely(SimulatedGoalRunner(), ctx)

    assert outcome == RunOutcome.failed("runner crashed: RuntimeError", retryable=False)
    assert [e["event"] for e in logs] == ["runner_crashed"]
    assert logs[0]["task_id"] == "task-1" and logs[0]["error_type"] == "RuntimeError"


async def test_guarded_runner_never_raises() -> None:
    ctx, _ = make_ctx(sim(outcome="crash"))
    guarded = guard(SimulatedGoalRunner())

    outcome = await guarded.run(ctx)

    assert outcome.outcome is Outcome.FAILED
    assert guard(guarded) is guarded
    assert isinstance(guarded, TaskRunner)


async def test_goal_hang_waits_until_cancelled_then_returns_cancelled() -> None:
    ctx, sink = make_ctx(sim(outcome="hang", duration_s=0))
    task = asyncio.create_task(SimulatedGoalRunner().run(ctx))
    await asyncio.wait_for(sink.started.wait(), GUARD_S)
    for _ in range(20):
        await asyncio.sleep(0)
    assert not task.done()

    ctx.cancelled.set()
    outcome = await asyncio.wait_for(task, GUARD_S)

    assert outcome.outcome is Outcome.CANCELLED
    assert outcome.retryable is False


async def test_goal_with_a_long_duration_stops_when_cancelled() -> None:
    ctx, sink = make_ctx(sim(duration_s=3600))
    task = asyncio.create_task(SimulatedGoalRunner().run(ctx))
    await asyncio.wait_for(sink.started.wait(), GUARD_S)

    ctx.cancelled.set()

    outcome = await asyncio.wait_for(task, GUARD_S)
    assert outcome.outcome is Outcome.CANCELLED


async def test_goal_already_cancelled_does_not_run() -> None:
    ctx, _ = make_ctx(sim(duration_s=3600))
    ctx.cancelled.set()

    outcome = await asyncio.wait_for(SimulatedGoalRunner().run(ctx), GUARD_S)

    assert outcome.outcome is Outcome.CANCELLED


async def test_task_cancellation_propagates_through_run_safely() -> None:
    ctx, sink = make_ctx(sim(outcome="hang"))
    task = asyncio.create_task(run_safely(SimulatedGoalRunner(), ctx))
    await asyncio.wait_for(sink.started.wait(), GUARD_S)

    task.cancel()

    with pytest.raises(asyncio.CancelledError):
        await task


class LeaksCancelledError:
    async def run(self, ctx: RunContext) -> RunOutcome:
        raise asyncio.CancelledError


class ReturnsGarbage:
    async def run(self, ctx: RunContext) -> RunOutcome:
        return "done"  # type: ignore[return-value]


async def test_a_cancelled_error_leaked_by_a_runner_is_a_crash() -> None:
    ctx, _ = make_ctx({})

    outcome = await run_safely(LeaksCancelledError(), ctx)

    assert outcome == RunOutcome.failed("runner crashed: CancelledError")


async def test_a_leaked_cancelled_error_after_a_cancel_request_is_cancelled() -> None:
    ctx, _ = make_ctx({})
    ctx.cancelled.set()

    outcome = await run_safely(LeaksCancelledError(), ctx)

    assert outcome.outcome is Outcome.CANCELLED


async def test_a_runner_returning_something_else_is_a_failure() -> None:
    ctx, _ = make_ctx({})

    with capture_logs() as logs:
        outcome = await run_safely(ReturnsGarbage(), ctx)

    assert outcome.outcome is Outcome.FAILED and "str" in outcome.reason
    assert [e["event"] for e in logs] == ["runner_bad_outcome"]


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"sim": "fast"}, "'sim'"),
        ({"sim": {"duration_s": "1"}}, "sim.duration_s"),
        ({"sim": {"duration_s": True}}, "sim.duration_s"),
        ({"sim": {"duration_s": -1}}, "sim.duration_s"),
        ({"sim": {"duration_s": float("nan")}}, "sim.duration_s"),
        ({"sim": {"outcome": 1}}, "sim.outcome"),
        ({"sim": {"outcome": "explode"}}, "sim.outcome"),
        ({"sim": {"log_lines": 2.5}}, "sim.log_lines"),
        ({"sim": {"log_lines": -1}}, "sim.log_lines"),
        ({"sim": {"artifact_bytes": "10"}}, "sim.artifact_bytes"),
        ({"sim": {"artifact_bytes": 10**12}}, "sim.artifact_bytes"),
    ],
)
async def test_goal_with_a_bad_payload_fails_naming_the_field(
    payload: dict[str, Any], field: str
) -> None:
    outcome, sink = await run_goal(payload)

    assert outcome.outcome is Outcome.FAILED
    assert outcome.retryable is False
    assert field in outcome.reason
    assert sink.lines == [] and sink.artifacts == []


# -- simulated workflow ------------------------------------------------------------------


async def test_workflow_runs_every_step_in_order() -> None:
    steps = [{"duration_s": 0, "log_lines": 1}, {"duration_s": 0, "artifact_bytes": 5}, {}]

    outcome, sink = await run_workflow({"steps": steps})

    assert outcome == RunOutcome.done({"steps_completed": 3, "steps_total": 3})
    assert sink.progress == ["step 1/3", "step 2/3", "step 3/3"]
    assert sink.lines[0].startswith("step 1:")
    assert [name for name, _ in sink.artifacts] == ["step-2-output.bin"]


async def test_workflow_with_no_steps_is_done() -> None:
    outcome, _ = await run_workflow({})

    assert outcome == RunOutcome.done({"steps_completed": 0, "steps_total": 0})


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ("failed", RunOutcome.failed("simulated failure", result={})),
        ("retryable", RunOutcome.failed("simulated retryable failure", retryable=True)),
    ],
)
async def test_workflow_stops_at_the_first_step_that_is_not_done(
    bad: str, expected: RunOutcome
) -> None:
    steps = [{"duration_s": 0}, {"duration_s": 0, "outcome": bad}, {"log_lines": 7}]

    outcome, sink = await run_workflow({"steps": steps})

    assert (outcome.outcome, outcome.retryable, outcome.reason) == (
        expected.outcome,
        expected.retryable,
        expected.reason,
    )
    assert outcome.result == {"steps_completed": 1, "steps_total": 3}
    assert sink.progress == ["step 1/3", "step 2/3"]
    assert sink.lines == []


async def test_workflow_hang_step_is_cancelled_with_the_steps_completed_so_far() -> None:
    ctx, sink = make_ctx(
        {"steps": [{"duration_s": 0}, {"outcome": "hang"}]}, kind=TaskKind.WORKFLOW
    )
    task = asyncio.create_task(SimulatedWorkflowRunner().run(ctx))
    while "step 2/2" not in sink.progress:
        await asyncio.wait_for(sink.started.wait(), GUARD_S)
        sink.started.clear()

    ctx.cancelled.set()

    outcome = await asyncio.wait_for(task, GUARD_S)
    assert outcome.outcome is Outcome.CANCELLED
    assert outcome.result == {"steps_completed": 1, "steps_total": 2}


async def test_workflow_crash_step_becomes_a_failure_under_run_safely() -> None:
    ctx, _ = make_ctx({"steps": [{"duration_s": 0, "outcome": "crash"}]}, kind=TaskKind.WORKFLOW)

    outcome = await run_safely(SimulatedWorkflowRunner(), ctx)

    assert outcome == RunOutcome.failed("runner crashed: RuntimeError")


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"steps": {"duration_s": 0}}, "'steps'"),
        ({"steps": [{}, "step"]}, "steps[1]"),
        ({"steps": [{}, {}, {"log_lines": "many"}]}, "steps[2].log_lines"),
    ],
)
async def test_workflow_with_a_bad_payload_fails_before_running_any_step(
    payload: dict[str, Any], field: str
) -> None:
    outcome, sink = await run_workflow(payload)

    assert outcome.outcome is Outcome.FAILED and outcome.retryable is False
    assert field in outcome.reason
    assert sink.progress == []


def test_simulated_runners_satisfy_their_protocols() -> None:
    assert isinstance(SimulatedGoalRunner(), TaskRunner)
    assert isinstance(SimulatedWorkflowRunner(), WorkflowRunner)


# -- loading ----------------------------------------------------------------------------


def _ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=runners_base.RUNNER_GROUP)


def test_builtin_runners_match_the_entry_points_declared_in_pyproject() -> None:
    pyproject = tomllib.loads(
        (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text("utf-8")
    )
    declared = pyproject["project"]["entry-points"]["fleetlease.runners"]
    builtin = builtin_runners()

    assert set(builtin) == set(declared)
    for name, value in declared.items():
        factory = builtin[name]
        assert f"{factory.__module__}:{getattr(factory, '__qualname__', '')}" == value


def test_load_runners_merges_entry_points_and_skips_broken_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eps = [
        _ep("sim-goal", "fleetlease.hostagent.runners.simulated:SimulatedGoalRunner"),
        _ep("custom", "fleetlease.hostagent.runners.simulated:SimulatedWorkflowRunner"),
        _ep("missing", "fleetlease.hostagent.no_such_module:Runner"),
        _ep("not-callable", "fleetlease.hostagent.runners.simulated:MAX_ARTIFACT_BYTES"),
    ]
    monkeypatch.setattr(runners_base, "entry_points", lambda group: eps)

    with capture_logs() as logs:
        runners = load_runners()

    assert runners == {
        "sim-goal": SimulatedGoalRunner,
        "sim-workflow": SimulatedWorkflowRunner,
        "custom": SimulatedWorkflowRunner,
    }
    failed = [e for e in logs if e["event"] == "runner_load_failed"]
    assert sorted(e["name"] for e in failed) == ["missing", "not-callable"]


def test_load_runners_without_builtins_returns_only_entry_points(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runners_base, "entry_points", lambda group: [])

    assert load_runners(include_builtin=False) == {}
    assert set(load_runners()) == {"sim-goal", "sim-workflow"}
