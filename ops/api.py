"""The user API behind the ops subjects: authentication, authorization, argument
validation and the safe projection.

``OpsApi.handle(verb, token, args, user=...)`` is what ``transport.server.Server``
calls for every request on ``{prefix}.ops.{user}.{verb}``. It authenticates the
user token (which must be the subject's user's), checks the arguments
(``Invalid(field=...)`` naming the culprit), asks the repository or the actor
system, and returns plain msgpack-able data.

Safe projection: every record that leaves here is rebuilt field by field from an
allow-list (``project_task``, ``project_attempt``, ``project_host`` ...), so a
column the repository happens to select (a lease token hash, a credential hash,
a session generation key) can never reach a user. The only secrets ever
returned are the one-time token of ``user_add`` and the one-time credential of
``host_add``, which is what those verbs are for.

Roles: a task can be read and cancelled by its owner, an admin (or the owner) of
its project, or a platform admin; anyone else gets ``forbidden`` and nothing is
written (the repository enforces this in the same transaction). Submitting into
a project needs one of those roles on the project. Administrative verbs
(``user_add``, ``project_add``, ``host_add``, ``host_revoke``, ``host_list``) need
a platform admin.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from enum import Enum
from typing import Any, Protocol

import msgpack
import structlog

from fleetlease.persistence.bulk import MAX_CANCEL_BATCH, BulkCancel, CancelFilter
from fleetlease.persistence.errors import Forbidden, Invalid, NotFound, Unauthorized
from fleetlease.persistence.model import RetryPolicy, TaskKind, TaskSpec, TaskState, User
from fleetlease.persistence.reads import MAX_PAGE, Reads
from fleetlease.persistence.repository import Repository
from fleetlease.transport.subjects import is_valid_token

log = structlog.get_logger("fleetlease.ops")

MAX_BATCH = 1000
#: The longest page of ``tasks`` (and of ``events``): README, "JSON output".
MAX_LIST = MAX_PAGE
#: The most bytes of tasks one ``tasks`` reply carries (a reply must fit in one
#: NATS message, 1 MiB by default; long goals or large results would not).
MAX_LIST_BYTES = 768 * 1024
MAX_LOG_PAGE = 1000
MAX_TEXT = 4096
MAX_NAME = 128
#: An artifact travels in slices well under NATS's default 1 MiB payload limit.
MAX_ARTIFACT_SLICE = 512 * 1024

ADMIN_VERBS = frozenset({"user_add", "project_add", "host_add", "host_revoke", "host_list"})
#: Recent task events kept for the ``events`` verb, and its longest long-poll.
EVENT_RING = 10_000
MAX_EVENTS_WAIT_S = 30.0


class ControlPlaneLike(Protocol):
    """What the API needs of ``actors.runtime.ControlPlane``."""

    async def submit(self, spec: TaskSpec) -> str: ...

    async def submit_many(self, specs: Sequence[TaskSpec]) -> list[str]: ...

    async def cancel(self, task_id: str, user: User) -> Any: ...


# --- the safe projection ------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A value as msgpack/JSON can carry it: datetimes as ISO 8601 strings,
    enums and UUIDs as their strings, containers converted recursively."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, Enum):
        return _plain(value.value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, bytes | bytearray | memoryview):
        # Bytes are never part of a projection (hashes are bytes): drop them.
        return None
    return str(value)


def _first(raw: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        if name in raw and raw[name] is not None:
            return raw[name]
    return None


def project_attempt(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "number": _plain(_first(raw, "number", "attempt")),
        "host_id": _plain(raw.get("host_id")),
        "device_id": _plain(raw.get("device_id")),
        "lease_id": _plain(raw.get("lease_id")),
        "assigned_at": _plain(raw.get("assigned_at")),
        # When the attempt started running: its host's acknowledgement.
        "started_at": _plain(raw["started_at"] if "started_at" in raw else raw.get("acked_at")),
        "ended_at": _plain(raw.get("ended_at")),
        "end_reason": _plain(raw.get("end_reason")),
        "lease_expires_at": _plain(raw.get("lease_expires_at")),
    }


def _cancel_of(raw: Mapping[str, Any]) -> dict[str, Any]:
    cancel = raw.get("cancel")
    if isinstance(cancel, Mapping):
        at = _first(cancel, "at", "requested_at")
        by = _first(cancel, "by", "requested_by")
        requested = bool(cancel.get("requested", at is not None))
    else:
        at = raw.get("cancel_requested_at")
        by = raw.get("cancel_requested_by")
        requested = at is not None
    return {"requested": requested, "by": _plain(by), "at": _plain(at)}


def _reconcile_of(raw: Mapping[str, Any]) -> dict[str, Any] | None:
    rec = raw.get("reconcile")
    if isinstance(rec, Mapping):
        outcome, at = _first(rec, "outcome"), _first(rec, "at", "reconciled_at")
    else:
        outcome, at = raw.get("reconcile_outcome"), raw.get("reconciled_at")
    if outcome is None and at is None:
        return None
    return {"outcome": _plain(outcome), "at": _plain(at)}


def project_task(raw: Mapping[str, Any], *, with_attempts: bool = True) -> dict[str, Any]:
    """The documented task shape (README, "JSON output"), from whatever the
    repository returned, by allow-list."""
    state = _plain(_first(raw, "state", "status"))
    retry_at = raw.get("retry_at")
    if retry_at is None and state == TaskState.RETRYING.value:
        retry_at = raw.get("eligible_at")
    out: dict[str, Any] = {
        "id": _plain(_first(raw, "id", "task_id")),
        "state": state,
        "kind": _plain(raw.get("kind")),
        "goal": _plain(raw.get("goal")),
        "workflow": _plain(raw.get("workflow")),
        "project": _plain(raw.get("project")),
        "owner": _plain(raw.get("owner")),
        "priority": _plain(raw.get("priority")),
        "attempt": _plain(raw.get("attempt")),
        "max_attempts": _plain(raw.get("max_attempts")),
        "retry_at": _plain(retry_at),
        "cancel": _cancel_of(raw),
        "result": _plain(raw.get("result")),
        "terminal_reason": _plain(_first(raw, "terminal_reason", "reason")),
        "reconcile": _reconcile_of(raw),
        "created_at": _plain(raw.get("created_at")),
        "updated_at": _plain(raw.get("updated_at")),
        "finished_at": _plain(raw.get("finished_at")),
        "request_id": _plain(raw.get("request_id")),
    }
    if with_attempts:
        # Why a waiting task is not assigned, when it is known (null otherwise).
        out["waiting_reason"] = _plain(raw.get("waiting_reason"))
    attempts = raw.get("attempts")
    if not with_attempts:
        # A list's page cursor: the tasks listed after this one.
        out["cursor"] = _plain(raw.get("cursor"))
    if with_attempts:
        out["payload"] = _plain(raw.get("payload"))
        out["selector"] = _plain(raw.get("selector"))
        out["attempts"] = [project_attempt(a) for a in (attempts or []) if isinstance(a, Mapping)]
        last = out["attempts"][-1] if out["attempts"] else {}
        out["host_id"] = last.get("host_id")
        out["device_id"] = last.get("device_id")
    return out


def project_host(raw: Mapping[str, Any]) -> dict[str, Any]:
    devices = raw.get("devices")
    if isinstance(devices, list | tuple):
        devices = len(devices)
    return {
        "host_id": _plain(raw.get("host_id")),
        "live": bool(raw.get("live")),
        "last_seen": _plain(raw.get("last_seen")),
        "session_generation": _plain(raw.get("session_generation")),
        "devices": _plain(devices) if devices is not None else 0,
        "revoked": bool(raw.get("revoked") or raw.get("revoked_at")),
        # Null: the host takes any workflow (it does not say which it serves).
        "workflows": _plain(raw.get("workflows")),
        "goal_runner": _plain(raw.get("goal_runner")),
    }


def project_device(raw: Mapping[str, Any]) -> dict[str, Any]:
    caps = raw.get("capabilities")
    return {
        "host_id": _plain(raw.get("host_id")),
        "device_id": _plain(raw.get("device_id")),
        "state": _plain(raw.get("state")),
        "capabilities": _plain(caps) if isinstance(caps, Mapping) else {},
        "task_id": _plain(raw.get("task_id")),
    }


def project_log_line(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": _plain(raw.get("id")),
        "attempt": _plain(raw.get("attempt")),
        "seq": _plain(raw.get("seq")),
        "ts": _plain(raw.get("ts")),
        "line": _plain(raw.get("line")),
    }


def project_artifact(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "task_id": _plain(raw.get("task_id")),
        "attempt": _plain(raw.get("attempt")),
        "name": _plain(raw.get("name")),
        "size": _plain(raw.get("size")),
        "sha256": _plain(raw.get("sha256")),
        "created_at": _plain(raw.get("created_at")),
    }


def project_cancel(record: Any) -> dict[str, Any]:
    """A ``CancelRecord`` (or an equivalent mapping) as the ``cancel`` reply."""
    if isinstance(record, Mapping):
        get: Callable[[str], Any] = record.get
    else:

        def get(name: str) -> Any:
            return getattr(record, name, None)

    return {
        "id": _plain(_first_of(get, "task_id", "id")),
        "state": _plain(get("state")),
        "cancel": {
            "requested": True,
            "by": _plain(get("requested_by")),
            "at": _plain(get("requested_at")),
        },
        "completed": bool(get("completed")),
    }


def _first_of(get: Callable[[str], Any], *names: str) -> Any:
    for name in names:
        value = get(name)
        if value is not None:
            return value
    return None


# --- argument validation ------------------------------------------------------------


class Args:
    """Typed, named access to a request's ``args``; every error names the field."""

    def __init__(self, args: Any, allowed: Sequence[str]) -> None:
        if not isinstance(args, Mapping):
            raise Invalid("args must be a map", field="args")
        unknown = sorted(set(args) - set(allowed))
        if unknown:
            raise Invalid(f"unknown argument {unknown[0]!r}", field=str(unknown[0]))
        self._args = args

    def present(self, name: str) -> bool:
        return self._args.get(name) is not None

    def text(
        self, name: str, *, required: bool = False, max_len: int = MAX_TEXT, default: Any = None
    ) -> Any:
        value = self._args.get(name)
        if value is None:
            if required:
                raise Invalid(f"{name} is required", field=name)
            return default
        if not isinstance(value, str):
            raise Invalid(f"{name} must be a string", field=name)
        if not 1 <= len(value) <= max_len:
            raise Invalid(f"{name} must be 1..{max_len} characters", field=name)
        if not value.isprintable():
            raise Invalid(f"{name} must not contain control characters", field=name)
        return value

    def name(self, name: str, *, required: bool = False, default: Any = None) -> Any:
        """A user, project or host name: a subject-safe token."""
        value = self.text(name, required=required, max_len=64, default=default)
        if value is not None and not is_valid_token(value):
            raise Invalid(f"{name} must be 1..64 characters of [A-Za-z0-9_-]", field=name)
        return value

    def task_id(self, name: str = "id") -> str:
        value = self.text(name, required=True, max_len=64)
        try:
            return str(uuid.UUID(value))
        except ValueError:
            raise Invalid(f"{name} must be a task id (a UUID)", field=name) from None

    def integer(self, name: str, *, lo: int, hi: int, default: Any = None) -> Any:
        value = self._args.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise Invalid(f"{name} must be an integer", field=name)
        if not lo <= value <= hi:
            raise Invalid(f"{name} must be in {lo}..{hi}", field=name)
        return value

    def number(self, name: str, *, lo: float, hi: float, default: Any = None) -> Any:
        value = self._args.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Invalid(f"{name} must be a number", field=name)
        if not lo <= float(value) <= hi:
            raise Invalid(f"{name} must be in {lo}..{hi}", field=name)
        return float(value)

    def flag(self, name: str) -> bool:
        value = self._args.get(name, False)
        if not isinstance(value, bool):
            raise Invalid(f"{name} must be true or false", field=name)
        return value

    def names(self, name: str, *, choices: frozenset[str] | None = None) -> list[str]:
        value = self._args.get(name)
        if value is None:
            return []
        if not isinstance(value, list) or len(value) > 64:
            raise Invalid(f"{name} must be a list of at most 64 names", field=name)
        out: list[str] = []
        for item in value:
            if not isinstance(item, str) or not is_valid_token(item):
                raise Invalid(f"{name} must hold names of [A-Za-z0-9_-]", field=name)
            if choices is not None and item not in choices:
                raise Invalid(f"{name}: {item!r} is not one of {sorted(choices)}", field=name)
            out.append(item)
        return out

    def str_map(self, name: str) -> dict[str, str]:
        value = self._args.get(name)
        if value is None:
            return {}
        if not isinstance(value, Mapping) or len(value) > 64:
            raise Invalid(f"{name} must be a map of at most 64 entries", field=name)
        for k, v in value.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise Invalid(f"{name} must map strings to strings", field=name)
            if not 1 <= len(k) <= MAX_NAME or len(v) > MAX_TEXT:
                raise Invalid(f"{name} has an empty or over-long key or value", field=name)
        return dict(value)

    def doc(self, name: str) -> dict[str, Any]:
        value = self._args.get(name)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise Invalid(f"{name} must be a JSON object", field=name)
        return dict(value)


_STATES = frozenset(s.value for s in TaskState)


# --- live events ------------------------------------------------------------------------


class EventFeed:
    """The recent task events of this control-plane process, numbered from 1, in a
    bounded ring, with long-poll waits: what the ``events`` verb serves. Fed by
    ``ControlPlane.add_listener`` (on the loop; a call from another thread is
    handed to the loop). Each event is stored as ``ops.client.normalize_event``
    shapes it (allow-listed fields only).

    The ring holds only this process's transitions and its numbering starts
    again at each start (``epoch`` names the run): with several ``serve``
    processes behind one NATS, a poll answered by another process reports a
    ``gap`` and starts from that process's present."""

    def __init__(self, capacity: int = EVENT_RING) -> None:
        self.epoch = uuid.uuid4().hex
        self._ring: deque[tuple[int, dict[str, Any]]] = deque(maxlen=capacity)
        self._seq = 0
        self._waiters: set[asyncio.Future[None]] = set()
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()

    @property
    def last(self) -> int:
        """The number of the newest event (0: none yet)."""
        return self._seq

    def add(self, event: Any) -> None:
        loop = self._loop
        if loop is not None:
            try:
                running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                with contextlib.suppress(RuntimeError):  # loop closed: shutting down
                    loop.call_soon_threadsafe(self.add, event)
                return
        from fleetlease.ops.client import normalize_event

        for raw in event if isinstance(event, list) else [event]:
            shaped = normalize_event(raw)
            if shaped is not None:
                self._seq += 1
                self._ring.append((self._seq, shaped))
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def page(self, after: int, limit: int) -> tuple[list[tuple[int, dict[str, Any]]], bool]:
        """Up to ``limit`` events numbered above ``after``, and whether some after
        it already left the ring."""
        if not self._ring:
            return [], False
        first = self._ring[0][0]
        start = max(after + 1, first) - first
        return list(itertools.islice(self._ring, start, start + limit)), after < first - 1

    async def wait(self, after: int, timeout_s: float) -> None:
        """Until an event numbered above ``after`` exists, the feed closes or
        ``timeout_s`` passes."""
        if self._seq > after or self.closed or timeout_s <= 0:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._waiters.discard(waiter)

    def close(self) -> None:
        """Release every long-poll (the control plane is stopping)."""
        self.closed = True
        self._wake()


# --- the API ------------------------------------------------------------------------


class OpsApi:
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
        add_listener = getattr(control_plane, "add_listener", None)
        if callable(add_listener):
            add_listener(self.feed.add)
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
            "host_add": self.host_add,
            "host_revoke": self.host_revoke,
            "host_list": self.host_list,
            "user_add": self.user_add,
            "project_add": self.project_add,
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
            log.warning("ops_token_of_other_user", subject_user=user)
            raise Unauthorized(f"the token is not user {user!r}'s")
        method = self._verbs.get(verb)
        if method is None:
            raise Invalid(f"unknown verb {verb!r}", field="verb")
        if verb in ADMIN_VERBS and not principal.platform_admin:
            raise Forbidden(f"{verb.replace('_', ' ')} needs a platform admin")
        result = await method(principal, args if args is not None else {})
        log.debug("ops_request", verb=verb, user=principal.name)
        return result

    def close(self) -> None:
        """Release the parked ``events`` long-polls (called when stopping)."""
        self.feed.close()

    # --- identity ---------------------------------------------------------------
    async def whoami(self, user: User, args: Any) -> dict[str, Any]:
        Args(args, ())
        return {"name": user.name, "platform_admin": user.platform_admin}

    # --- tasks ------------------------------------------------------------------
    async def submit(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(
            args,
            (
                "goal",
                "workflow",
                "payload",
                "selector",
                "priority",
                "max_attempts",
                "backoff_base_s",
                "backoff_cap_s",
                "project",
                "count",
                "request_id",
            ),
        )
        goal = a.text("goal")
        workflow = a.text("workflow", max_len=MAX_NAME)
        if (goal is None) == (workflow is None):
            raise Invalid("exactly one of goal or workflow is required", field="goal")
        defaults = RetryPolicy()
        retry = RetryPolicy(
            max_attempts=a.integer("max_attempts", lo=1, hi=100, default=defaults.max_attempts),
            backoff_base_s=a.number(
                "backoff_base_s", lo=0.0, hi=86400.0, default=defaults.backoff_base_s
            ),
            backoff_cap_s=a.number(
                "backoff_cap_s", lo=0.0, hi=86400.0, default=defaults.backoff_cap_s
            ),
        )
        project = a.name("project", default="default")
        count = a.integer("count", lo=1, hi=MAX_BATCH)
        spec = TaskSpec(
            kind=TaskKind.GOAL if goal is not None else TaskKind.WORKFLOW,
            goal=goal,
            workflow=workflow,
            payload=a.doc("payload"),
            selector=a.str_map("selector"),
            priority=a.integer("priority", lo=-1000, hi=1000, default=0),
            project=project,
            owner=user.name,
            retry=retry,
        )
        # The idempotency key: a submit repeated with it returns the first task(s).
        # With a count, task i of the request gets the key "{request_id}#{i}".
        request_id = a.text("request_id", max_len=100)
        if request_id is not None and "#" in request_id:
            raise Invalid("request_id must not contain '#'", field="request_id")
        await self.repo.check_submit_role(user, project)
        if count is None:
            return {"id": await self.cp.submit(replace(spec, request_id=request_id))}
        specs = [
            replace(spec, request_id=None if request_id is None else f"{request_id}#{i}")
            for i in range(count)
        ]
        ids = await self.cp.submit_many(specs)
        return {"ids": list(ids)}

    async def tasks(self, user: User, args: Any) -> list[dict[str, Any]]:
        """One page of the tasks the user may read, newest first, without
        payloads or selectors. Each carries its ``cursor``: passed back as
        ``cursor``, the next page starts after that task. A page holds fewer
        than ``limit`` tasks at the end of the list, or when its tasks fill
        ``MAX_LIST_BYTES``: the end of the list is an empty page."""
        a = Args(args, ("states", "host", "limit", "cursor", "project", "request_id"))
        rows = await self.reads.list_tasks(
            user,
            states=a.names("states", choices=_STATES),
            host_id=a.name("host"),
            project=a.name("project"),
            request_id=a.text("request_id", max_len=100),
            limit=a.integer("limit", lo=1, hi=MAX_LIST, default=100),
            cursor=a.text("cursor", max_len=32),
            max_bytes=MAX_LIST_BYTES,
        )
        page: list[dict[str, Any]] = []
        size = 0
        for row in rows:
            task = project_task(row, with_attempts=False)
            size += len(msgpack.packb(task))
            if page and size > MAX_LIST_BYTES:
                break  # the rest on the next page (after the last cursor)
            page.append(task)
        return page

    async def task_show(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("id",))
        return project_task(await self.reads.task_view(a.task_id(), user))

    async def cancel(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("id",))
        record = await self.cp.cancel(a.task_id(), user)
        return project_cancel(record)

    async def cancel_many(self, user: User, args: Any) -> dict[str, Any]:
        """One batch (one transaction) of a bulk cancel of waiting tasks of a
        project, oldest first: ``cancelled`` tasks (``ids``), how many
        ``matched`` before it, and the ``bound`` to pass on (tasks submitted
        after the first batch are never taken). ``dry_run``: only count."""
        a = Args(args, ("project", "states", "host", "older_than_s", "bound", "limit", "dry_run"))
        f = CancelFilter(
            project=a.name("project", required=True),
            states=a.names("states", choices=_STATES) or [TaskState.QUEUED.value],
            host_id=a.name("host"),
            older_than_s=a.number("older_than_s", lo=0.0, hi=10 * 365 * 86400.0),
            bound=a.integer("bound", lo=0, hi=2**63 - 1),
        )
        limit = a.integer("limit", lo=1, hi=MAX_CANCEL_BATCH, default=MAX_CANCEL_BATCH)
        dry_run = a.flag("dry_run")
        batch = await self.bulk.batch(user, f, limit=limit, dry_run=dry_run)
        if batch.cancelled:
            at = self.repo.clock.now().isoformat()
            self.feed.add(
                [
                    {"task_id": tid, "state": "cancelled", "attempt": n, "host_id": None, "at": at}
                    for tid, n in batch.cancelled
                ]
            )
            log.info("tasks_cancelled", count=len(batch.cancelled), project=f.project, by=user.name)
        return {
            "cancelled": len(batch.cancelled),
            "ids": [tid for tid, _ in batch.cancelled],
            "matched": batch.matched,
            "bound": batch.bound,
            "more": batch.matched > len(batch.cancelled) and not dry_run,
        }

    async def events(self, user: User, args: Any) -> dict[str, Any]:
        """Long-poll of the task events this user may read. Without ``after``: the
        cursor of the present, at once (a live view is live from there). With it:
        the readable events numbered above ``after`` (waiting up to ``wait_s`` for
        one), and ``next``, the cursor to pass next time. ``gap``: events may
        have been missed (the ring overflowed, or the cursor belongs to another
        process or run, named by ``epoch``): re-read what you show."""
        a = Args(args, ("after", "wait_s", "limit", "epoch"))
        after = a.integer("after", lo=0, hi=2**63 - 1)
        wait_s = a.number("wait_s", lo=0.0, hi=MAX_EVENTS_WAIT_S, default=0.0)
        limit = a.integer("limit", lo=1, hi=MAX_LIST, default=500)
        epoch = a.text("epoch", max_len=64)
        feed = self.feed

        def reply(events: list[dict[str, Any]], cursor: int, gap: bool) -> dict[str, Any]:
            return {"events": events, "next": cursor, "epoch": feed.epoch, "gap": gap}

        if after is None:
            return reply([], feed.last, False)
        if (epoch is not None and epoch != feed.epoch) or after > feed.last:
            return reply([], feed.last, True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        cursor, gap = after, False
        while True:
            page, dropped = feed.page(cursor, limit)
            gap = gap or dropped
            if page:
                cursor = page[-1][0]
                readable = await self.repo.readable_task_ids(user, [e["task_id"] for _, e in page])
                visible = [dict(e, seq=n) for n, e in page if e["task_id"] in readable]
                if visible:
                    await self._with_devices(visible)
                    return reply(visible, cursor, gap)
                continue
            remaining = deadline - loop.time()
            if remaining <= 0 or feed.closed:
                return reply([], cursor, gap)
            await feed.wait(cursor, remaining)

    async def _with_devices(self, events: list[dict[str, Any]]) -> None:
        """Fill in the device of each event's attempt (the actors' events name
        the host and the attempt number; the attempt's row names its device)."""
        missing = [
            (e["task_id"], e["attempt"])
            for e in events
            if e.get("device_id") is None and isinstance(e.get("attempt"), int)
        ]
        if not missing:
            return
        found = await self.reads.attempt_devices(missing)
        for e in events:
            if e.get("device_id") is None and isinstance(e.get("attempt"), int):
                e["device_id"] = found.get((e["task_id"], e["attempt"]))

    async def logs(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("id", "after_id", "limit"))
        task_id = a.task_id()
        after_id = a.integer("after_id", lo=0, hi=2**63 - 1, default=0)
        limit = a.integer("limit", lo=1, hi=MAX_LOG_PAGE, default=MAX_LOG_PAGE)
        # The state is read first: a line written after it is then still returned
        # by this or the next page, so a follower that stops at a terminal state
        # with an empty page has seen every line.
        state = await self.reads.task_state(task_id, user)
        lines = [
            project_log_line(r)
            for r in await self.repo.read_logs(task_id, user, after_id=after_id, limit=limit)
        ]
        next_after = lines[-1]["id"] if lines else after_id
        return {
            "id": task_id,
            "state": state,
            "terminal": state in {s.value for s in TaskState if s.is_terminal},
            "lines": lines,
            "next_after_id": next_after,
        }

    async def artifacts(self, user: User, args: Any) -> list[dict[str, Any]]:
        a = Args(args, ("id",))
        return [project_artifact(r) for r in await self.reads.list_artifacts(a.task_id(), user)]

    async def artifact_get(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("id", "name", "attempt", "offset", "length"))
        task_id = a.task_id()
        name = a.text("name", required=True, max_len=MAX_NAME)
        attempt = a.integer("attempt", lo=1, hi=2**31 - 1)
        offset = a.integer("offset", lo=0, hi=2**62, default=0)
        length = a.integer("length", lo=1, hi=MAX_ARTIFACT_SLICE, default=MAX_ARTIFACT_SLICE)
        rows = [
            r
            for r in await self.reads.list_artifacts(task_id, user)
            if r.get("name") == name and (attempt is None or r.get("attempt") == attempt)
        ]
        if not rows:
            raise NotFound(f"task {task_id} has no artifact {name!r}", field="name")
        row = max(rows, key=lambda r: int(r.get("attempt") or 0))
        server = getattr(self.service, "server", None)
        if server is None:
            raise NotFound("artifacts are not served here", field="name")
        data = await server.read_artifact(str(row["object_name"]))
        meta = project_artifact(row)
        meta.update(offset=offset, data=bytes(data[offset : offset + length]))
        meta["eof"] = offset + length >= len(data)
        return meta

    # --- fleet ------------------------------------------------------------------
    async def hosts(self, user: User, args: Any) -> list[dict[str, Any]]:
        Args(args, ())
        return [h for h in map(project_host, await self.repo.list_hosts()) if not h["revoked"]]

    async def host_list(self, user: User, args: Any) -> list[dict[str, Any]]:
        Args(args, ())
        return [project_host(h) for h in await self.repo.list_hosts()]

    async def devices(self, user: User, args: Any) -> list[dict[str, Any]]:
        a = Args(args, ("host",))
        host = a.name("host")
        return [
            project_device(d)
            for d in await self.repo.list_devices()
            if host is None or d.get("host_id") == host
        ]

    async def host_add(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("host_id",))
        host_id = a.name("host_id", required=True)
        credential = await self.repo.add_host(host_id)
        log.info("host_added", host_id=host_id, by=user.name)
        return {"host_id": host_id, "token": credential}

    async def host_revoke(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("host_id",))
        host_id = a.name("host_id", required=True)
        ended = await self.repo.revoke_host(host_id)
        log.info("host_revoked", host_id=host_id, by=user.name, ended=len(ended))
        disconnected = await self._disconnect_host(host_id)
        return {
            "host_id": host_id,
            "revoked": True,
            "disconnected": disconnected,
            "ended": [
                {
                    "task_id": _plain(e.task_id),
                    "attempt": e.attempt,
                    "state": _plain(e.new_state),
                    "end_reason": _plain(e.reason),
                }
                for e in ended
            ],
        }

    async def _disconnect_host(self, host_id: str) -> int:
        """Kick the revoked host's live NATS connections (broker security on; the
        revocation is already durable, so the callout refuses the reconnects).
        A failure is logged, not raised: the revocation stands either way and
        the application layer already refuses the host's every request."""
        broker_auth = getattr(self.service, "broker_auth", None)
        if broker_auth is None:
            return 0
        try:
            return int(await broker_auth.disconnect_host(host_id))
        except Exception as exc:
            log.warning("host_disconnect_failed", host_id=host_id, error=repr(exc))
            return 0

    # --- users and projects -----------------------------------------------------------
    async def user_add(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("name", "platform_admin"))
        name = a.name("name", required=True)
        admin = a.flag("platform_admin")
        token = await self.repo.add_user(name, platform_admin=admin)
        log.info("user_added", user=name, platform_admin=admin, by=user.name)
        return {"name": name, "platform_admin": admin, "token": token}

    async def project_add(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("name", "owner", "admins"))
        name = a.name("name", required=True)
        owner = a.name("owner", required=True)
        admins = a.names("admins")
        await self.repo.add_project(name, owner=owner, admins=admins)
        log.info("project_added", project=name, owner=owner, by=user.name)
        return {"name": name, "owner": owner, "admins": admins}
