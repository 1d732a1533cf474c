"""The user API behind the ops subjects: authentication, authorization and the
dispatch of each verb to its handler.

``OpsApi.handle(verb, token, args, user=...)`` is what ``transport.server.Server``
calls for every request on ``{prefix}.ops.{user}.{verb}``. It authenticates the
user token (which must be the subject's user's), checks the arguments
(``Invalid(field=...)`` naming the culprit, ``args.py``), asks the repository or
the actor system, and returns plain msgpack-able data through the safe
projection (``projection.py``). The handlers are grouped by area: ``tasks.py``,
``fleet.py`` and ``admin.py``.

Roles: a task can be read and cancelled by its owner, an admin (or the owner) of
its project, or a platform admin; anyone else gets ``forbidden`` and nothing is
written (the repository enforces this in the same transaction). Submitting into
a project needs one of those roles on the project. Administrative verbs
(``ADMIN_VERBS``: ``user_add``, ``project_add``, ``project_set_retention``,
``gc``, ``host_add``, ``host_revoke``, ``host_list``; ``DRAIN_VERBS``:
``host_drain``, ``host_undrain``, ``device_drain``, ``device_undrain``) need a
platform admin.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from fleetlease.ops.userapi.admin import ADMIN_VERBS, AdminVerbs
from fleetlease.ops.userapi.args import Args
from fleetlease.ops.userapi.context import ControlPlaneLike
from fleetlease.ops.userapi.drain import DRAIN_VERBS, DrainVerbs
from fleetlease.ops.userapi.events import EventFeed
from fleetlease.ops.userapi.fleet import FleetVerbs
from fleetlease.ops.userapi.tasks import TaskVerbs
from fleetlease.persistence.bulk import BulkCancel
from fleetlease.persistence.errors import Forbidden, Invalid, Unauthorized
from fleetlease.persistence.model import User
from fleetlease.persistence.reads import Reads
from fleetlease.persistence.repository import Repository
from fleetlease.persistence.taskevents import TaskEventStream
from fleetlease.transport.clip import clip, clip_repr

log = structlog.get_logger("fleetlease.ops")


class OpsApi(TaskVerbs, FleetVerbs, AdminVerbs, DrainVerbs):
    """Serves the ops verbs for one control plane."""

    def __init__(
        self, *, repo: Repository, control_plane: ControlPlaneLike, service: Any = None
    ) -> None:
        if repo is None:
            raise ValueError("repo is required")
        if control_plane is None:
            raise ValueError("control_plane is required")
        self.repo = repo
        self.reads = Reads(repo)
        self.bulk = BulkCancel(repo)
        self.cp = control_plane
        self.service = service
        self.feed = EventFeed()
        self.stream: TaskEventStream | None = None
        self._verbs: dict[str, Callable[[User, Any], Any]] = {
            "whoami": self.whoami,
            "events": self.events,
            "submit": self.submit,
            "tasks": self.tasks,
            "task_show": self.task_show,
            "cancel": self.cancel,
            "cancel_many": self.cancel_many,
            "logs": self.logs,
            "artifacts": self.artifacts,
            "artifact_get": self.artifact_get,
            "hosts": self.hosts,
            "devices": self.devices,
            "fleet_counts": self.fleet_counts,
            "fleet_history": self.fleet_history,
            "host_add": self.host_add,
            "host_revoke": self.host_revoke,
            "host_list": self.host_list,
            "user_add": self.user_add,
            "project_add": self.project_add,
            "host_drain": self.host_drain,
            "host_undrain": self.host_undrain,
            "device_drain": self.device_drain,
            "device_undrain": self.device_undrain,
            "project_set_retention": self.project_set_retention,
            "gc": self.gc,
        }

    @property
    def verbs(self) -> frozenset[str]:
        return frozenset(self._verbs)

    async def authenticate(self, token: str) -> User:
        if not isinstance(token, str) or not token:
            raise Unauthorized("a user token is required")
        return await self.repo.authenticate_user(token)

    async def handle(self, verb: str, token: str, args: Any, *, user: str | None = None) -> Any:
        """Run ``verb`` for the token's user. ``user`` is the user the request's
        subject names: the token must be that user's (else ``unauthorized``,
        nothing done). The server passes None only for the identify request
        (``whoami`` on ``Subjects.ops_identify``); in-process callers pass None."""
        principal = await self.authenticate(token)
        if user is not None and principal.name != user:
            log.warning("ops_token_of_other_user", subject_user=clip(user))
            raise Unauthorized(f"the token is not user {clip_repr(user)}'s")
        method = self._verbs.get(verb)
        if method is None:
            raise Invalid(f"unknown verb {clip_repr(verb)}", field="verb")
        if (verb in ADMIN_VERBS or verb in DRAIN_VERBS) and not principal.platform_admin:
            raise Forbidden(f"{verb.replace('_', ' ')} needs a platform admin")
        result = await method(principal, args if args is not None else {})
        log.debug("ops_request", verb=verb, user=principal.name)
        return result

    def start(self) -> None:
        """Start listening for the committed task events that the ``events`` verb
        serves (on the loop)."""
        if self.stream is None:
            self.stream = TaskEventStream(self.repo.engine, self.feed).start()

    def close(self) -> None:
        """Release the parked ``events`` long-polls (called when stopping)."""
        self.feed.close()

    async def stop(self) -> None:
        """Release the parked long-polls and stop listening."""
        self.close()
        stream, self.stream = self.stream, None
        if stream is not None:
            await stream.stop()

    async def whoami(self, user: User, args: Any) -> dict[str, Any]:
        Args(args, ())
        return {"name": user.name, "platform_admin": user.platform_admin}
