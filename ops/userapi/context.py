"""What every verb handler of the user API holds: the repository and its reads,
the control plane, the event feed and the service around them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from fleetlease.ops.userapi.events import EventFeed
from fleetlease.persistence.bulk import BulkCancel
from fleetlease.persistence.model import TaskSpec, User
from fleetlease.persistence.reads import Reads
from fleetlease.persistence.repository import Repository


class ControlPlaneLike(Protocol):
    """What the API needs of ``actors.runtime.ControlPlane``."""

    async def submit(self, spec: TaskSpec) -> str: ...

    async def submit_many(self, specs: Sequence[TaskSpec]) -> list[str]: ...

    async def cancel(self, task_id: str, user: User) -> Any: ...


class ApiContext:
    """The base of the verb groups (``TaskVerbs``, ``FleetVerbs``,
    ``AdminVerbs``); ``OpsApi`` sets these attributes."""

    repo: Repository
    reads: Reads
    bulk: BulkCancel
    cp: ControlPlaneLike
    service: Any
    feed: EventFeed
