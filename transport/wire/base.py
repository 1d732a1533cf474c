"""The ground the wire format stands on: its limits, its two errors, wire time,
and the strict reader every field is decoded through (each error names its field).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from fleetlease.persistence.model import canonical_uuid
from fleetlease.transport.subjects import is_valid_token

VERSION = 1
MAX_MESSAGE_SIZE = 1024 * 1024
MAX_DEVICES = 1024
MAX_LOG_LINES = 1000
MAX_LOG_LINE_BYTES = 8 * 1024
MAX_CHUNK_BYTES = 256 * 1024
#: Artifact chunks start at multiples of this and hold at most this many bytes.
ARTIFACT_CHUNK_BYTES = 128 * 1024
MAX_NAME_LEN = 128
MAX_TEXT_LEN = 4096
MAX_WAIT_S = 60.0
NONCE_LEN = 16
SIGNATURE_LEN = 32
SESSION_KEY_LEN = 32
#: A register proof masks the 64-character credential (``broker_auth.CLIENT_KEY_LEN``).
REGISTER_PROOF_LEN = 64
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

#: Nesting bound for free-form maps (payload, result, args); msgpack itself
#: bounds the depth too, but a JSONB column and a readable CLI want far less.
MAX_DEPTH = 32

ERROR_CODES: frozenset[str] = frozenset(
    {
        "bad_request",
        "unauthorized",
        "forbidden",
        "not_found",
        "conflict",
        "gone",
        "unavailable",
        "internal",
        #: Over a staging quota (artifact uploads): retry once uploads drain.
        "quota",
        #: Over a budget of the sender (requests or long-polls in flight) or of
        #: the control plane: refused unserved, retry after a backoff.
        "busy",
    }
)

_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_UUID_RE = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")


class DecodeError(Exception):
    """The bytes are not a valid message."""

    code = "bad_request"
    retryable = False

    def __init__(self, reason: str, message: str | None = None, *, field: str | None = None):
        self.reason = reason
        self.field = field
        where = f" ({field})" if field else ""
        self.message = message or f"{reason.replace('_', ' ')}{where}"
        super().__init__(self.message)

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}


class RemoteError(Exception):
    """The peer answered with an Error reply."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")

    @property
    def retryable(self) -> bool:
        return self.code in ("unavailable", "busy")


# -- time ---------------------------------------------------------------------


def to_unix(when: datetime) -> float:
    """A timezone-aware datetime as wire seconds."""
    if when.tzinfo is None:
        raise ValueError("when must be timezone-aware")
    return when.timestamp()


def from_unix(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


# -- field readers --------------------------------------------------------------


class _Missing:
    """The marker of an absent field."""


MISSING: Any = _Missing()


def wrong_type(name: str, expected: str) -> DecodeError:
    return DecodeError("wrong_type", f"{name} must be {expected}", field=name)


def out_of_range(name: str, what: str) -> DecodeError:
    return DecodeError("out_of_range", f"{name} {what}", field=name)


class Reader:
    """Typed access to one decoded map; every error names the field (with a
    ``devices[3].state`` style path for nested records)."""

    def __init__(self, data: object, path: str = "") -> None:
        if not isinstance(data, Mapping):
            raise wrong_type(path.rstrip(".") or "b", "a map")
        self._data = data
        self._path = path

    @property
    def path(self) -> str:
        """The prefix of this map's field names in errors (``devices[3].``)."""
        return self._path

    def raw(self, name: str) -> Any:
        """The undecoded value of ``name``, ``MISSING`` when absent."""
        return self._data.get(name, MISSING)

    def _get(self, name: str, default: Any) -> tuple[str, Any]:
        full = self._path + name
        if name in self._data:
            return full, self._data[name]
        if default is MISSING:
            raise DecodeError("missing_field", f"missing field {full}", field=full)
        return full, default

    def text(
        self,
        name: str,
        default: Any = MISSING,
        *,
        min_len: int = 0,
        max_len: int = MAX_TEXT_LEN,
        choices: frozenset[str] | None = None,
    ) -> Any:
        full, value = self._get(name, default)
        if value is None and default is None:
            return None
        if not isinstance(value, str):
            raise wrong_type(full, "a string")
        if not min_len <= len(value) <= max_len:
            raise out_of_range(full, f"must be {min_len}..{max_len} characters")
        if choices is not None and value not in choices:
            raise out_of_range(full, f"must be one of {sorted(choices)}")
        return value

    def name(self, name: str, default: Any = MISSING) -> Any:
        """A non-empty identifier or name, without control characters."""
        value = self.text(name, default, min_len=1, max_len=MAX_NAME_LEN)
        if value is not None and not value.isprintable():
            raise out_of_range(self._path + name, "must not contain control characters")
        return value

    def token(self, name: str) -> str:
        """A value that may become a subject token (host ids)."""
        full, value = self._get(name, MISSING)
        if not isinstance(value, str):
            raise wrong_type(full, "a string")
        if not is_valid_token(value):
            raise out_of_range(full, "must be 1..64 characters of [A-Za-z0-9_-]")
        return value

    def uuid(self, name: str) -> str:
        full, value = self._get(name, MISSING)
        if not isinstance(value, str):
            raise wrong_type(full, "a string")
        if _UUID_RE.fullmatch(value) is None:
            raise out_of_range(full, "must be a UUID")
        return canonical_uuid(value)

    def hex64(self, name: str) -> str:
        full, value = self._get(name, MISSING)
        if not isinstance(value, str):
            raise wrong_type(full, "a string")
        if _HEX64_RE.fullmatch(value) is None:
            raise out_of_range(full, "must be 64 lowercase hex characters")
        return value

    def integer(
        self, name: str, default: Any = MISSING, *, lo: int = 0, hi: int = INT64_MAX
    ) -> Any:
        full, value = self._get(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong_type(full, "an integer")
        if not lo <= value <= hi:
            raise out_of_range(full, f"must be in {lo}..{hi}")
        return value

    def number(
        self,
        name: str,
        default: Any = MISSING,
        *,
        lo: float = 0.0,
        hi: float = float(INT64_MAX),
    ) -> Any:
        full, value = self._get(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong_type(full, "a number")
        value = float(value)
        if not math.isfinite(value) or not lo <= value <= hi:
            raise out_of_range(full, f"must be in {lo}..{hi}")
        return value

    def flag(self, name: str, default: Any = MISSING) -> bool:
        full, value = self._get(name, default)
        if not isinstance(value, bool):
            raise wrong_type(full, "a boolean")
        return value

    def blob(self, name: str, *, min_len: int = 0, max_len: int) -> bytes:
        full, value = self._get(name, MISSING)
        if not isinstance(value, bytes):
            raise wrong_type(full, "bytes")
        if not min_len <= len(value) <= max_len:
            raise out_of_range(full, f"must be {min_len}..{max_len} bytes")
        return value

    def seq(self, name: str, default: Any = MISSING, *, max_items: int) -> list[Any]:
        full, value = self._get(name, default)
        if not isinstance(value, list):
            raise wrong_type(full, "a list")
        if len(value) > max_items:
            raise out_of_range(full, f"must have at most {max_items} items")
        return value

    def str_list(
        self, name: str, default: Any = MISSING, *, max_items: int, max_len: int = MAX_NAME_LEN
    ) -> list[str]:
        full = self._path + name
        items = self.seq(name, default, max_items=max_items)
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise wrong_type(f"{full}[{i}]", "a string")
            if len(item) > max_len:
                raise out_of_range(f"{full}[{i}]", f"must be at most {max_len} characters")
        return items

    def str_map(self, name: str, default: Any = MISSING) -> dict[str, str]:
        full, value = self._get(name, default)
        if not isinstance(value, dict):
            raise wrong_type(full, "a map")
        for k, v in value.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise wrong_type(full, "a map of strings to strings")
            if len(k) > MAX_NAME_LEN or len(v) > MAX_TEXT_LEN:
                raise out_of_range(full, "has an over-long key or value")
        return dict(value)

    def any(self, name: str) -> Any:
        """Any msgpack value; an absent field reads as None."""
        return self._get(name, None)[1]

    def doc(self, name: str, default: Any = MISSING) -> dict[str, Any]:
        """A free-form JSON-compatible map (payload, result, args)."""
        full, value = self._get(name, default)
        if not isinstance(value, dict):
            raise wrong_type(full, "a map")
        check_json_like(value, full)
        return value


def check_json_like(root: object, name: str) -> None:
    """Refuse values a JSONB column cannot hold (bytes, non-str keys, NaN) and
    nesting beyond MAX_DEPTH. Iterative: a recursive walk could hit Python's
    recursion limit on hostile input."""
    stack: list[tuple[object, int]] = [(root, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise out_of_range(name, f"is nested deeper than {MAX_DEPTH}")
        if value is None or isinstance(value, bool | int | str):
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                raise out_of_range(name, "contains a non-finite number")
            continue
        if isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise wrong_type(name, "a map with string keys")
                stack.append((v, depth + 1))
        else:
            raise wrong_type(name, "JSON-compatible (no bytes)")
