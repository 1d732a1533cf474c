"""The sizes the user API accepts, in bytes, shared by the API (``ops/userapi``,
which enforces them for every client) and the ops client (``ops/client.py``,
which checks a request before publishing it). Either way an oversized argument
is the same typed error, ``bad request: goal is larger than 4096 bytes``,
whatever its size: a request past the broker's payload limit never reaches the
control plane to be refused, and would otherwise fail as a NATS error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fleetlease.transport import wire

#: A free text (a goal, a selector value), UTF-8 encoded.
MAX_TEXT = 4096
#: A name (a workflow, an artifact).
MAX_NAME = 128
#: A JSON document argument (a task's payload), as compact JSON; the
#: repository holds a payload to the same (``MAX_PAYLOAD_BYTES``).
MAX_DOC = 256 * 1024
#: A whole request, whatever its arguments (the wire's largest message).
MAX_REQUEST = wire.MAX_MESSAGE_SIZE

#: The largest size of each argument the client knows; the API may hold one
#: to less (a user name), and says so in the same words.
ARG_LIMITS: Mapping[str, int] = {
    "goal": MAX_TEXT,
    "workflow": MAX_NAME,
    "payload": MAX_DOC,
    "request_id": 100,
    "name": MAX_NAME,
    "project": 64,
    "owner": 64,
    "host": 64,
    "host_id": 64,
    "id": 64,
}


def too_large(name: str, limit: int) -> str:
    """The message of an oversized argument (or request)."""
    return f"{name} is larger than {limit} bytes"


def size_of(value: Any) -> int:
    """The bytes an argument takes: a text's UTF-8, anything else as JSON (as
    the repository measures a payload)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, bytes | bytearray):
        return len(value)
    try:
        return len(json.dumps(value, allow_nan=False).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError, OverflowError):
        return 0  # not JSON: the API's own checks say so


def oversized(args: Mapping[str, Any]) -> str | None:
    """The message for the first argument larger than its limit, else None."""
    for name, value in args.items():
        limit = ARG_LIMITS.get(name)
        if limit is not None and value is not None and size_of(value) > limit:
            return too_large(name, limit)
        if limit is None and isinstance(value, Mapping):
            message = oversized_map(name, value)
            if message is not None:
                return message
    return None


def oversized_map(name: str, value: Mapping[Any, Any]) -> str | None:
    """The message for an over-long key or value of a string map (a selector)."""
    for k, v in value.items():
        if isinstance(k, str) and size_of(k) > MAX_NAME:
            return too_large(f"{name} key", MAX_NAME)
        if isinstance(v, str) and size_of(v) > MAX_TEXT:
            return too_large(f"{name} value", MAX_TEXT)
    return None


__all__ = [
    "ARG_LIMITS",
    "MAX_DOC",
    "MAX_NAME",
    "MAX_REQUEST",
    "MAX_TEXT",
    "oversized",
    "oversized_map",
    "size_of",
    "too_large",
]
