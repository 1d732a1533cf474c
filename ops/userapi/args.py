"""Argument checking for the user API: typed, named access to a request's
``args``, where every error is an ``Invalid`` naming the field."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fleetlease.ops.limits import MAX_DOC, MAX_TEXT, oversized_map, size_of, too_large
from fleetlease.persistence.errors import Invalid
from fleetlease.persistence.model import TaskState
from fleetlease.transport.clip import clip, clip_repr
from fleetlease.transport.subjects import is_valid_token

#: Every task state's name, the choices of a ``states`` argument.
STATES = frozenset(s.value for s in TaskState)


class Args:
    """Typed, named access to a request's ``args``; every error names the field."""

    def __init__(self, args: Any, allowed: Sequence[str]) -> None:
        if not isinstance(args, Mapping):
            raise Invalid("args must be a map", field="args")
        known = set(allowed)
        unknown = sorted((k for k in args if k not in known), key=str)
        if unknown:
            # The name is the sender's: clipped, as it goes into the log as well.
            raise Invalid(f"unknown argument {clip_repr(unknown[0])}", field=clip(unknown[0]))
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
        if not value:
            raise Invalid(f"{name} must not be empty", field=name)
        if size_of(value) > max_len:
            raise Invalid(too_large(name, max_len), field=name)
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
                raise Invalid(
                    f"{name}: {clip_repr(item)} is not one of {sorted(choices)}", field=name
                )
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
            if not k:
                raise Invalid(f"{name} has an empty key", field=name)
            message = oversized_map(name, {k: v})
            if message is not None:
                raise Invalid(message, field=name)
        return dict(value)

    def doc(self, name: str) -> dict[str, Any]:
        value = self._args.get(name)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise Invalid(f"{name} must be a JSON object", field=name)
        if size_of(value) > MAX_DOC:
            raise Invalid(too_large(name, MAX_DOC), field=name)
        return dict(value)
