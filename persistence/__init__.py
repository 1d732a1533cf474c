"""PostgreSQL, the single source of truth: the schema (``tables``, ``migrations``
applied by ``migrate``), the domain records (``model``), the typed errors
(``errors``) and the :class:`Repository`, whose every transition is a fenced
compare-and-set (its package holds one module per role). Read models beside it:
``reads`` (task lists), ``fleet_view``, ``bulk``, ``matching``, ``credentials``;
``taskevents`` (``TaskEventStream``: the task events the database announces
at each commit).

The names are imported on first use, so that importing the model does not load
SQLAlchemy's engine machinery."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetlease.persistence.clock import Clock, ManualClock, SystemClock
    from fleetlease.persistence.db import create_engine
    from fleetlease.persistence.errors import (
        Busy,
        Conflict,
        Forbidden,
        Gone,
        Invalid,
        NotFound,
        QuotaExceeded,
        RepositoryError,
        Unauthorized,
        Unavailable,
    )
    from fleetlease.persistence.migrate import upgrade
    from fleetlease.persistence.model import (
        EndReason,
        LeaseTimings,
        Outcome,
        RetryPolicy,
        Session,
        TaskKind,
        TaskSpec,
        TaskState,
        User,
    )
    from fleetlease.persistence.repository import Repository
    from fleetlease.persistence.taskevents import TaskEventStream

#: Public name -> the module that defines it.
_SOURCES = {
    "Busy": "errors",
    "Clock": "clock",
    "Conflict": "errors",
    "EndReason": "model",
    "Forbidden": "errors",
    "Gone": "errors",
    "Invalid": "errors",
    "LeaseTimings": "model",
    "ManualClock": "clock",
    "NotFound": "errors",
    "Outcome": "model",
    "QuotaExceeded": "errors",
    "Repository": "repository",
    "RepositoryError": "errors",
    "RetryPolicy": "model",
    "Session": "model",
    "SystemClock": "clock",
    "TaskEventStream": "taskevents",
    "TaskKind": "model",
    "TaskSpec": "model",
    "TaskState": "model",
    "Unauthorized": "errors",
    "Unavailable": "errors",
    "User": "model",
    "create_engine": "db",
    "upgrade": "migrate",
}

__all__ = [
    "Busy",
    "Clock",
    "Conflict",
    "EndReason",
    "Forbidden",
    "Gone",
    "Invalid",
    "LeaseTimings",
    "ManualClock",
    "NotFound",
    "Outcome",
    "QuotaExceeded",
    "Repository",
    "RepositoryError",
    "RetryPolicy",
    "Session",
    "SystemClock",
    "TaskEventStream",
    "TaskKind",
    "TaskSpec",
    "TaskState",
    "Unauthorized",
    "Unavailable",
    "User",
    "create_engine",
    "upgrade",
]


def __getattr__(name: str) -> Any:
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
