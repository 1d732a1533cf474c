"""Checks of the arguments of every repository method, before the database is
touched: a bad value is ``Invalid`` (or ``NotFound`` for a task id that is no
UUID) and changes nothing."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from fleetlease.persistence.errors import Invalid, NotFound
from fleetlease.persistence.model import (
    DeviceSnapshot,
    RetryPolicy,
    Session,
    TaskKind,
    TaskSpec,
    User,
    canonical_uuid,
)

MAX_PAYLOAD_BYTES = 256 * 1024


MAX_INT32 = 2**31 - 1


MAX_BACKOFF_S = 7 * 24 * 3600.0


HOST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def _check_int(value: object, field: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise Invalid(f"{field} must be an integer in {lo}..{hi}", field=field)
    return value


def _check_number(value: object, field: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Invalid(f"{field} must be a number", field=field)
    f = float(value)
    if not math.isfinite(f) or not lo <= f <= hi:
        raise Invalid(f"{field} must be in {lo}..{hi}", field=field)
    return f


def _check_str(value: object, field: str, *, max_len: int = 256, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty) or len(value) > max_len:
        raise Invalid(f"{field} must be a string of at most {max_len} characters", field=field)
    if "\x00" in value:
        raise Invalid(f"{field} must not contain NUL", field=field)
    return value


def _check_json_value(value: object, field: str, depth: int = 0) -> None:
    if depth > 64:
        raise Invalid(f"{field} is nested too deeply", field=field)
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Invalid(f"{field} must not contain NaN or infinity", field=field)
        return
    if isinstance(value, str):
        if "\x00" in value:
            raise Invalid(f"{field} must not contain NUL", field=field)
        return
    if isinstance(value, list | tuple):
        for item in value:
            _check_json_value(item, field, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or "\x00" in key:
                raise Invalid(f"{field} keys must be strings", field=field)
            _check_json_value(item, field, depth + 1)
        return
    raise Invalid(f"{field} must be JSON-serialisable", field=field)


def _check_json_dict(value: object, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Invalid(f"{field} must be an object", field=field)
    _check_json_value(value, field)
    if len(json.dumps(value, allow_nan=False).encode("utf-8")) > MAX_PAYLOAD_BYTES:
        raise Invalid(f"{field} is larger than {MAX_PAYLOAD_BYTES} bytes", field=field)
    return value


def _check_selector(value: object, field: str = "selector") -> dict[str, str]:
    if not isinstance(value, dict) or len(value) > 64:
        raise Invalid(f"{field} must be a mapping of at most 64 string pairs", field=field)
    for k, v in value.items():
        if not isinstance(k, str) or not k or not isinstance(v, str):
            raise Invalid(f"{field} must map strings to strings", field=field)
        if "\x00" in k or "\x00" in v or len(k) > 256 or len(v) > 1024:
            raise Invalid(f"{field} has an invalid entry", field=field)
    return dict(value)


def _check_task_id(value: object) -> str:
    """A task id: wrong type is ``Invalid``; a string that is no UUID names no task."""
    if not isinstance(value, str):
        raise Invalid("task_id must be a string", field="task_id")
    try:
        return canonical_uuid(value)
    except ValueError:
        raise NotFound("no such task", task_id=value) from None


def _check_host_id(value: object, field: str = "host_id") -> str:
    if not isinstance(value, str) or not HOST_ID_RE.match(value):
        raise Invalid(f"{field} must match {HOST_ID_RE.pattern}", field=field)
    return value


def _check_session(session: object) -> Session:
    if not isinstance(session, Session):
        raise Invalid("session must be a Session", field="session")
    _check_host_id(session.host_id, "session.host_id")
    _check_int(session.generation, "session.generation", 0, MAX_INT32)
    return session


def _check_user(user: object) -> User:
    if not isinstance(user, User):
        raise Invalid("user must be a User", field="user")
    return user


def _check_spec(spec: object) -> dict[str, Any]:
    """Validate a TaskSpec into the column values of a new task (no id/times)."""
    if not isinstance(spec, TaskSpec):
        raise Invalid("spec must be a TaskSpec", field="spec")
    try:
        kind = TaskKind(spec.kind)
    except ValueError:
        raise Invalid("kind must be 'goal' or 'workflow'", field="kind") from None
    retry = spec.retry
    if not isinstance(retry, RetryPolicy):
        raise Invalid("retry must be a RetryPolicy", field="retry")
    base = _check_number(retry.backoff_base_s, "backoff_base_s", 0.0, MAX_BACKOFF_S)
    cap = _check_number(retry.backoff_cap_s, "backoff_cap_s", 0.0, MAX_BACKOFF_S)
    if cap < base:
        raise Invalid("backoff_cap_s must be >= backoff_base_s", field="backoff_cap_s")
    return {
        "kind": kind.value,
        "payload": _check_json_dict(spec.payload, "payload"),
        "selector": _check_selector(spec.selector),
        "priority": _check_int(spec.priority, "priority", -1000, 1000),
        "project": _check_str(spec.project, "project", max_len=128),
        "owner": _check_str(spec.owner, "owner", max_len=128),
        "max_attempts": _check_int(retry.max_attempts, "max_attempts", 1, 100),
        "backoff_base_s": base,
        "backoff_cap_s": cap,
        "goal": None if spec.goal is None else _check_str(spec.goal, "goal", max_len=65536),
        "workflow": (
            None if spec.workflow is None else _check_str(spec.workflow, "workflow", max_len=1024)
        ),
        "request_id": _check_request_id(spec.request_id),
    }


_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@#/+=-]{0,127}")


def _check_request_id(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _REQUEST_ID.fullmatch(value):
        raise Invalid(
            "request_id must be 1-128 characters: letters, digits and . _ : @ # / + = - "
            "(starting with a letter or digit)",
            field="request_id",
        )
    return value


def _check_devices(snapshot: object) -> list[DeviceSnapshot]:
    if isinstance(snapshot, str | bytes) or not isinstance(snapshot, Sequence):
        raise Invalid("devices must be a sequence of DeviceSnapshot", field="devices")
    seen: set[str] = set()
    out: list[DeviceSnapshot] = []
    for dev in snapshot:
        if not isinstance(dev, DeviceSnapshot):
            raise Invalid("devices must be a sequence of DeviceSnapshot", field="devices")
        _check_str(dev.device_id, "devices.device_id", max_len=256)
        if dev.device_id in seen:
            raise Invalid("duplicate device_id", field="devices.device_id")
        seen.add(dev.device_id)
        if dev.state not in ("idle", "busy", "offline"):
            raise Invalid("device state must be idle, busy or offline", field="devices.state")
        _check_selector(dev.capabilities, "devices.capabilities")
        out.append(dev)
    if len(out) > 10_000:
        raise Invalid("too many devices", field="devices")
    return out
