"""The runner contract: what the host agent hands a runner, what it gets back,
and the guard that keeps a misbehaving runner from taking the agent down.

Runners are plugins found through the ``fleetlease.runners`` entry point group;
each entry names a class constructed with no arguments.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

import structlog

from fleetlease.persistence.model import Outcome, TaskKind

__all__ = [
    "RUNNER_GROUP",
    "GuardedRunner",
    "RunContext",
    "RunOutcome",
    "RunnerFactory",
    "TaskRunner",
    "WorkflowRunner",
    "builtin_runners",
    "guard",
    "load_runners",
    "run_safely",
]

log = structlog.get_logger(__name__)

RUNNER_GROUP = "fleetlease.runners"


def _discard_line(line: str) -> None:
    pass


def _discard_artifact(name: str, data: bytes) -> None:
    pass


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """Everything a runner gets for one attempt.

    ``log``, ``artifact`` and ``progress`` only enqueue (logs and artifacts go
    out on their own channels, never in the way of a lease renewal), so a runner
    may call them freely from the event loop. ``cancelled`` is set when the
    control plane asked to cancel or the lease was lost. The lease token is
    deliberately not here: runners never need it.
    """

    task_id: str
    attempt: int
    device_id: str
    kind: TaskKind
    goal: str | None = None
    workflow: str | None = None
    payload: Mapping[str, Any] = field(default_factory=dict)
    log: Callable[[str], None] = _discard_line
    artifact: Callable[[str, bytes], None] = _discard_artifact
    progress: Callable[[str], None] = _discard_line
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """How an attempt ended. ``retryable`` applies to ``failed`` only: the
    control plane may schedule another attempt. ``result`` must be plain JSON
    data and deterministic for a given run (it is fingerprinted)."""

    outcome: Outcome
    retryable: bool = False
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Coerce plain strings so untyped runners passing "done" still produce
        # the enum everything downstream compares against.
        try:
            outcome = Outcome(self.outcome)
        except ValueError:
            raise ValueError(
                f"outcome must be one of {[o.value for o in Outcome]}, got {self.outcome!r}"
            ) from None
        object.__setattr__(self, "outcome", outcome)
        if self.retryable and outcome is not Outcome.FAILED:
            raise ValueError("retryable applies only to a 'failed' outcome")

    @classmethod
    def done(cls, result: Mapping[str, Any] | None = None, reason: str = "") -> RunOutcome:
        return cls(outcome=Outcome.DONE, reason=reason, result=dict(result or {}))

    @classmethod
    def failed(
        cls,
        reason: str,
        *,
        retryable: bool = False,
        result: Mapping[str, Any] | None = None,
    ) -> RunOutcome:
        return cls(
            outcome=Outcome.FAILED, retryable=retryable, reason=reason, result=dict(result or {})
        )

    @classmethod
    def cancelled(
        cls, reason: str = "cancel requested", result: Mapping[str, Any] | None = None
    ) -> RunOutcome:
        return cls(outcome=Outcome.CANCELLED, reason=reason, result=dict(result or {}))


@runtime_checkable
class TaskRunner(Protocol):
    """Runs a goal task on one device.

    Contract:

    - ``run`` returns a ``RunOutcome`` and never raises: failures are
      ``RunOutcome.failed(...)``, with ``retryable=True`` when another attempt
      may succeed.
    - It is cooperatively cancellable: once ``ctx.cancelled`` is set it stops
      promptly and returns outcome ``cancelled``.
    - It may also be cancelled with asyncio task cancellation, and must then
      release what it holds and let ``CancelledError`` propagate.
    - It never blocks the event loop: blocking work goes to an executor.
    - The class is constructed with no arguments; one instance may run several
      attempts concurrently, so per-attempt state lives in ``run``.
    """

    async def run(self, ctx: RunContext) -> RunOutcome: ...


@runtime_checkable
class WorkflowRunner(Protocol):
    """Runs a workflow task (``ctx.workflow`` names it) on one device. Same
    contract as ``TaskRunner``: returns an outcome and never raises, stops
    promptly with outcome ``cancelled`` once ``ctx.cancelled`` is set, may be
    cancelled with asyncio task cancellation, never blocks the event loop."""

    async def run(self, ctx: RunContext) -> RunOutcome: ...


#: What ``load_runners`` returns per name: a class (or any zero-argument
#: callable) producing a runner.
RunnerFactory = Callable[[], TaskRunner | WorkflowRunner]


def _crash_outcome(exc: BaseException) -> RunOutcome:
    return RunOutcome.failed(f"runner crashed: {type(exc).__name__}", retryable=False)


async def run_safely(runner: TaskRunner | WorkflowRunner, ctx: RunContext) -> RunOutcome:
    """Run ``runner`` and always return an outcome, whatever it does.

    An exception becomes ``failed`` (not retryable, ``reason="runner crashed:
    <ExceptionType>"``) and is logged as ``runner_crashed``; a return value that
    is not a ``RunOutcome`` becomes ``failed`` too. Cancellation of the calling
    task still propagates: that is the agent stopping the runner, not a crash.
    """
    try:
        outcome = await runner.run(ctx)
    except asyncio.CancelledError as exc:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
        # A CancelledError nobody asked this task for leaked out of the runner
        # (e.g. it awaited something that was cancelled elsewhere).
        if ctx.cancelled.is_set():
            return RunOutcome.cancelled()
        log.warning(
            "runner_crashed",
            task_id=ctx.task_id,
            attempt=ctx.attempt,
            runner=type(runner).__name__,
            error_type=type(exc).__name__,
        )
        return _crash_outcome(exc)
    except Exception as exc:
        log.warning(
            "runner_crashed",
            task_id=ctx.task_id,
            attempt=ctx.attempt,
            runner=type(runner).__name__,
            error_type=type(exc).__name__,
            error=str(exc)[:500],
            exc_info=exc,
        )
        return _crash_outcome(exc)
    if not isinstance(outcome, RunOutcome):
        log.warning(
            "runner_bad_outcome",
            task_id=ctx.task_id,
            attempt=ctx.attempt,
            runner=type(runner).__name__,
            returned=type(outcome).__name__,
        )
        return RunOutcome.failed(
            f"runner returned {type(outcome).__name__}, not a RunOutcome", retryable=False
        )
    return outcome


class GuardedRunner:
    """A runner wrapped by ``guard``: its ``run`` is ``run_safely``."""

    def __init__(self, inner: TaskRunner | WorkflowRunner) -> None:
        self.inner = inner

    async def run(self, ctx: RunContext) -> RunOutcome:
        return await run_safely(self.inner, ctx)

    def __repr__(self) -> str:
        return f"GuardedRunner({self.inner!r})"


def guard(runner: TaskRunner | WorkflowRunner) -> GuardedRunner:
    """Wrap ``runner`` so that its ``run`` never raises (see ``run_safely``).
    Guarding twice does not nest."""
    if isinstance(runner, GuardedRunner):
        return runner
    return GuardedRunner(runner)


def builtin_runners() -> dict[str, RunnerFactory]:
    """The runners shipped with fleetlease, available even when the package is
    run from a checkout without its entry points installed."""
    # Imported here: simulated imports this module.
    from fleetlease.hostagent.runners.simulated import SimulatedGoalRunner, SimulatedWorkflowRunner

    return {"sim-goal": SimulatedGoalRunner, "sim-workflow": SimulatedWorkflowRunner}


def load_runners(
    group: str = RUNNER_GROUP, *, include_builtin: bool = True
) -> dict[str, RunnerFactory]:
    """Runner classes by name, from the entry points of ``group``.

    With ``include_builtin`` the built-in runners come first and entry points
    may replace them; of two entry points with one name the later wins, with a
    ``runner_name_duplicated`` warning. An entry point that fails to import, or names something
    that is not callable, is logged (``runner_load_failed``) and skipped, so
    one broken plugin never stops the agent.
    """
    found: dict[str, RunnerFactory] = {}
    from_entry_points: set[str] = set()
    if include_builtin and group == RUNNER_GROUP:
        found.update(builtin_runners())
    for ep in entry_points(group=group):
        try:
            loaded: Any = ep.load()
        except Exception as exc:
            log.warning(
                "runner_load_failed",
                name=ep.name,
                value=ep.value,
                error_type=type(exc).__name__,
                error=str(exc)[:500],
            )
            continue
        if not callable(loaded):
            log.warning(
                "runner_load_failed",
                name=ep.name,
                value=ep.value,
                error_type="NotCallable",
                error=f"{type(loaded).__name__} is not callable",
            )
            continue
        # The same distribution visible twice on sys.path yields the same
        # object; only a different one under a taken name is worth a warning.
        if ep.name in from_entry_points and found[ep.name] is not loaded:
            log.warning("runner_name_duplicated", name=ep.name, value=ep.value)
        found[ep.name] = loaded
        from_entry_points.add(ep.name)
    return found
