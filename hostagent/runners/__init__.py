"""Runners: the contract (``base``) and the built-in simulated runners."""

from __future__ import annotations

from fleetlease.hostagent.runners.base import (
    RUNNER_GROUP,
    GuardedRunner,
    RunContext,
    RunnerFactory,
    RunOutcome,
    TaskRunner,
    WorkflowRunner,
    builtin_runners,
    guard,
    load_runners,
    run_safely,
)

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
