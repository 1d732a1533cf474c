"""The safe projection: every record that leaves the user API is rebuilt field by
field from an allow-list (``project_task``, ``project_attempt``, ``project_host``
...), so a column the repository happens to select (a lease token hash, a
credential hash, a session generation key) can never reach a user. The shapes
are documented in docs/cli.md, "JSON output"."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from enum import Enum
from typing import Any

from fleetlease.persistence.model import TaskState


def plain(value: Any) -> Any:
    """A value as msgpack/JSON can carry it: datetimes as ISO 8601 strings,
    enums and UUIDs as their strings, containers converted recursively."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, Enum):
        return plain(value.value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
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
        "number": plain(_first(raw, "number", "attempt")),
        "host_id": plain(raw.get("host_id")),
        "device_id": plain(raw.get("device_id")),
        "lease_id": plain(raw.get("lease_id")),
        "assigned_at": plain(raw.get("assigned_at")),
        # When the attempt started running: its host's acknowledgement.
        "started_at": plain(raw["started_at"] if "started_at" in raw else raw.get("acked_at")),
        "ended_at": plain(raw.get("ended_at")),
        "end_reason": plain(raw.get("end_reason")),
        "lease_expires_at": plain(raw.get("lease_expires_at")),
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
    return {"requested": requested, "by": plain(by), "at": plain(at)}


def _reconcile_of(raw: Mapping[str, Any]) -> dict[str, Any] | None:
    rec = raw.get("reconcile")
    if isinstance(rec, Mapping):
        outcome, at = _first(rec, "outcome"), _first(rec, "at", "reconciled_at")
    else:
        outcome, at = raw.get("reconcile_outcome"), raw.get("reconciled_at")
    if outcome is None and at is None:
        return None
    return {"outcome": plain(outcome), "at": plain(at)}


def project_task(raw: Mapping[str, Any], *, with_attempts: bool = True) -> dict[str, Any]:
    """The documented task shape (docs/cli.md, "JSON output"), from whatever
    the repository returned, by allow-list."""
    state = plain(_first(raw, "state", "status"))
    retry_at = raw.get("retry_at")
    if retry_at is None and state == TaskState.RETRYING.value:
        retry_at = raw.get("eligible_at")
    out: dict[str, Any] = {
        "id": plain(_first(raw, "id", "task_id")),
        "state": state,
        "kind": plain(raw.get("kind")),
        "goal": plain(raw.get("goal")),
        "workflow": plain(raw.get("workflow")),
        "project": plain(raw.get("project")),
        "owner": plain(raw.get("owner")),
        "priority": plain(raw.get("priority")),
        "attempt": plain(raw.get("attempt")),
        "max_attempts": plain(raw.get("max_attempts")),
        "retry_at": plain(retry_at),
        "cancel": _cancel_of(raw),
        "result": plain(raw.get("result")),
        "terminal_reason": plain(_first(raw, "terminal_reason", "reason")),
        "reconcile": _reconcile_of(raw),
        "created_at": plain(raw.get("created_at")),
        "updated_at": plain(raw.get("updated_at")),
        "finished_at": plain(raw.get("finished_at")),
        "request_id": plain(raw.get("request_id")),
    }
    if with_attempts:
        # Why a waiting task is not assigned, when it is known (null otherwise).
        out["waiting_reason"] = plain(raw.get("waiting_reason"))
    attempts = raw.get("attempts")
    if not with_attempts:
        # A list's page cursor: the tasks listed after this one.
        out["cursor"] = plain(raw.get("cursor"))
    if with_attempts:
        out["payload"] = plain(raw.get("payload"))
        out["selector"] = plain(raw.get("selector"))
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
        "host_id": plain(raw.get("host_id")),
        "live": bool(raw.get("live")),
        "last_seen": plain(raw.get("last_seen")),
        "session_generation": plain(raw.get("session_generation")),
        "devices": plain(devices) if devices is not None else 0,
        "revoked": bool(raw.get("revoked") or raw.get("revoked_at")),
        # Null: the host takes any workflow (it does not say which it serves).
        "workflows": plain(raw.get("workflows")),
        "goal_runner": plain(raw.get("goal_runner")),
        # Null: not drained; else when the drain was asked for and its deadline.
        "drain": _drain_of(raw.get("drain")),
    }


def _drain_of(drain: Any) -> dict[str, Any] | None:
    if not isinstance(drain, Mapping) or drain.get("requested_at") is None:
        return None
    return {"requested_at": plain(drain["requested_at"]), "deadline": plain(drain.get("deadline"))}


def project_device(raw: Mapping[str, Any]) -> dict[str, Any]:
    caps = raw.get("capabilities")
    return {
        "host_id": plain(raw.get("host_id")),
        "device_id": plain(raw.get("device_id")),
        "state": plain(raw.get("state")),
        "capabilities": plain(caps) if isinstance(caps, Mapping) else {},
        "task_id": plain(raw.get("task_id")),
        "reported": plain(raw.get("reported", raw.get("state"))),
        "disagreement": plain(raw.get("disagreement")),
        # The device, or its host, is drained: it takes no new assignment.
        "drained": bool(raw.get("drained")),
    }


def project_log_line(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": plain(raw.get("id")),
        "attempt": plain(raw.get("attempt")),
        "seq": plain(raw.get("seq")),
        "ts": plain(raw.get("ts")),
        "line": plain(raw.get("line")),
    }


def project_artifact(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "task_id": plain(raw.get("task_id")),
        "attempt": plain(raw.get("attempt")),
        "name": plain(raw.get("name")),
        "size": plain(raw.get("size")),
        "sha256": plain(raw.get("sha256")),
        "created_at": plain(raw.get("created_at")),
    }


def project_cancel(record: Any) -> dict[str, Any]:
    """A ``CancelRecord`` (or an equivalent mapping) as the ``cancel`` reply."""
    if isinstance(record, Mapping):
        get: Callable[[str], Any] = record.get
    else:

        def get(name: str) -> Any:
            return getattr(record, name, None)

    return {
        "id": plain(_first_of(get, "task_id", "id")),
        "state": plain(get("state")),
        "cancel": {
            "requested": get("requested_at") is not None,
            "by": plain(get("requested_by")),
            "at": plain(get("requested_at")),
        },
        "completed": bool(get("completed")),
        "already_ended": bool(get("ended_before")),
    }


def _first_of(get: Callable[[str], Any], *names: str) -> Any:
    for name in names:
        value = get(name)
        if value is not None:
            return value
    return None
