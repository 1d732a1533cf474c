"""The msgpack wire format: one versioned envelope, a closed set of message types.

Envelope (a msgpack map)::

    {"v": 1, "t": <type tag>, "b": <body: msgpack BYTES of a map>, "a": <auth map, optional>}

The body travels as the msgpack encoding of the body map, wrapped in a bin
field, for every message (signed or not). A signature is then computed over the
exact bytes the sender produced and the receiver verifies those same bytes before
interpreting them; nobody has to re-encode anything canonically, and a
verifier never depends on two msgpack implementations agreeing on map order or
integer widths. See ``transport/auth.py`` for what the signature covers.

Auth (host messages only)::

    {"h": host_id, "g": generation, "ts": unix ms, "n": nonce (16 bytes), "s": HMAC (32 bytes)}

:func:`decode` is the only way in: it refuses anything that is not exactly an
envelope of a known type with well-typed fields, raising :class:`DecodeError`
(code ``bad_request``) and nothing else. Unknown fields are ignored so that a
newer peer can add optional fields. Only msgpack is used: never pickle, no ext
types. Timestamps are float unix seconds; ``bool`` is never accepted for ``int``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, Self, TypeVar, overload

import msgpack

from fleetlease.persistence.model import Outcome, TaskKind, TaskState, canonical_uuid
from fleetlease.transport.subjects import is_valid_token

VERSION = 1
MAX_MESSAGE_SIZE = 1024 * 1024
MAX_DEVICES = 1024
MAX_LOG_LINES = 1000
MAX_LOG_LINE_BYTES = 8 * 1024
MAX_CHUNK_BYTES = 256 * 1024
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
        #: Over a budget of the sender (requests or long-polls in flight) or of
        #: the control plane: refused unserved, retry after a backoff.
        "busy",
        "internal",
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
    pass


_MISSING: Any = _Missing()


def _wrong_type(name: str, expected: str) -> DecodeError:
    return DecodeError("wrong_type", f"{name} must be {expected}", field=name)


def _out_of_range(name: str, what: str) -> DecodeError:
    return DecodeError("out_of_range", f"{name} {what}", field=name)


class _Reader:
    """Typed access to one decoded map; every error names the field (with a
    ``devices[3].state`` style path for nested records)."""

    def __init__(self, data: object, path: str = "") -> None:
        if not isinstance(data, Mapping):
            raise _wrong_type(path.rstrip(".") or "b", "a map")
        self._data = data
        self._path = path

    def _get(self, name: str, default: Any) -> tuple[str, Any]:
        full = self._path + name
        if name in self._data:
            return full, self._data[name]
        if default is _MISSING:
            raise DecodeError("missing_field", f"missing field {full}", field=full)
        return full, default

    def text(
        self,
        name: str,
        default: Any = _MISSING,
        *,
        min_len: int = 0,
        max_len: int = MAX_TEXT_LEN,
        choices: frozenset[str] | None = None,
    ) -> Any:
        full, value = self._get(name, default)
        if value is None and default is None:
            return None
        if not isinstance(value, str):
            raise _wrong_type(full, "a string")
        if not min_len <= len(value) <= max_len:
            raise _out_of_range(full, f"must be {min_len}..{max_len} characters")
        if choices is not None and value not in choices:
            raise _out_of_range(full, f"must be one of {sorted(choices)}")
        return value

    def name(self, name: str, default: Any = _MISSING) -> Any:
        """A non-empty identifier or name, without control characters."""
        value = self.text(name, default, min_len=1, max_len=MAX_NAME_LEN)
        if value is not None and not value.isprintable():
            raise _out_of_range(self._path + name, "must not contain control characters")
        return value

    def token(self, name: str) -> str:
        """A value that may become a subject token (host ids)."""
        full, value = self._get(name, _MISSING)
        if not isinstance(value, str):
            raise _wrong_type(full, "a string")
        if not is_valid_token(value):
            raise _out_of_range(full, "must be 1..64 characters of [A-Za-z0-9_-]")
        return value

    def uuid(self, name: str) -> str:
        full, value = self._get(name, _MISSING)
        if not isinstance(value, str):
            raise _wrong_type(full, "a string")
        if _UUID_RE.fullmatch(value) is None:
            raise _out_of_range(full, "must be a UUID")
        return canonical_uuid(value)

    def hex64(self, name: str) -> str:
        full, value = self._get(name, _MISSING)
        if not isinstance(value, str):
            raise _wrong_type(full, "a string")
        if _HEX64_RE.fullmatch(value) is None:
            raise _out_of_range(full, "must be 64 lowercase hex characters")
        return value

    def integer(
        self, name: str, default: Any = _MISSING, *, lo: int = 0, hi: int = INT64_MAX
    ) -> Any:
        full, value = self._get(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise _wrong_type(full, "an integer")
        if not lo <= value <= hi:
            raise _out_of_range(full, f"must be in {lo}..{hi}")
        return value

    def number(
        self,
        name: str,
        default: Any = _MISSING,
        *,
        lo: float = 0.0,
        hi: float = float(INT64_MAX),
    ) -> Any:
        full, value = self._get(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _wrong_type(full, "a number")
        value = float(value)
        if not math.isfinite(value) or not lo <= value <= hi:
            raise _out_of_range(full, f"must be in {lo}..{hi}")
        return value

    def flag(self, name: str, default: Any = _MISSING) -> bool:
        full, value = self._get(name, default)
        if not isinstance(value, bool):
            raise _wrong_type(full, "a boolean")
        return value

    def blob(self, name: str, *, min_len: int = 0, max_len: int) -> bytes:
        full, value = self._get(name, _MISSING)
        if not isinstance(value, bytes):
            raise _wrong_type(full, "bytes")
        if not min_len <= len(value) <= max_len:
            raise _out_of_range(full, f"must be {min_len}..{max_len} bytes")
        return value

    def seq(self, name: str, default: Any = _MISSING, *, max_items: int) -> list[Any]:
        full, value = self._get(name, default)
        if not isinstance(value, list):
            raise _wrong_type(full, "a list")
        if len(value) > max_items:
            raise _out_of_range(full, f"must have at most {max_items} items")
        return value

    def str_list(
        self, name: str, default: Any = _MISSING, *, max_items: int, max_len: int = MAX_NAME_LEN
    ) -> list[str]:
        full = self._path + name
        items = self.seq(name, default, max_items=max_items)
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise _wrong_type(f"{full}[{i}]", "a string")
            if len(item) > max_len:
                raise _out_of_range(f"{full}[{i}]", f"must be at most {max_len} characters")
        return items

    def str_map(self, name: str, default: Any = _MISSING) -> dict[str, str]:
        full, value = self._get(name, default)
        if not isinstance(value, dict):
            raise _wrong_type(full, "a map")
        for k, v in value.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise _wrong_type(full, "a map of strings to strings")
            if len(k) > MAX_NAME_LEN or len(v) > MAX_TEXT_LEN:
                raise _out_of_range(full, "has an over-long key or value")
        return dict(value)

    def any(self, name: str) -> Any:
        """Any msgpack value; an absent field reads as None."""
        return self._get(name, None)[1]

    def doc(self, name: str, default: Any = _MISSING) -> dict[str, Any]:
        """A free-form JSON-compatible map (payload, result, args)."""
        full, value = self._get(name, default)
        if not isinstance(value, dict):
            raise _wrong_type(full, "a map")
        _check_json_like(value, full)
        return value


def _check_json_like(root: object, name: str) -> None:
    """Refuse values a JSONB column cannot hold (bytes, non-str keys, NaN) and
    nesting beyond MAX_DEPTH. Iterative: a recursive walk could hit Python's
    recursion limit on hostile input."""
    stack: list[tuple[object, int]] = [(root, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _out_of_range(name, f"is nested deeper than {MAX_DEPTH}")
        if value is None or isinstance(value, bool | int | str):
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                raise _out_of_range(name, "contains a non-finite number")
            continue
        if isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise _wrong_type(name, "a map with string keys")
                stack.append((v, depth + 1))
        else:
            raise _wrong_type(name, "JSON-compatible (no bytes)")


# -- messages -----------------------------------------------------------------


class Message:
    """A wire message: a frozen dataclass with a ``TYPE`` tag, ``to_body()`` and a
    strict ``from_body()`` that raises DecodeError naming the bad field."""

    TYPE: ClassVar[str]

    def to_body(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        raise NotImplementedError


def _fields(obj: object, *names: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in names:
        v = getattr(obj, n)
        # StrEnum members are str subclasses; send the plain value.
        out[n] = v.value if isinstance(v, TaskState | TaskKind | Outcome) else v
    return out


_TASK_STATES = frozenset(s.value for s in TaskState)
_OUTCOMES = frozenset(o.value for o in Outcome)
_KINDS = frozenset(k.value for k in TaskKind)
_DEVICE_STATES = frozenset({"idle", "busy", "offline"})
_VERDICTS = frozenset({"confirmed", "discard"})
_LEASE_FIELDS = ("task_id", "attempt", "lease_token")


def _lease_ref(r: _Reader) -> dict[str, Any]:
    return {
        "task_id": r.uuid("task_id"),
        "attempt": r.integer("attempt", lo=1, hi=INT32_MAX),
        "lease_token": r.text("lease_token", min_len=1, max_len=MAX_NAME_LEN),
    }


def _attempt_ref(r: _Reader) -> dict[str, Any]:
    return {"task_id": r.uuid("task_id"), "attempt": r.integer("attempt", lo=1, hi=INT32_MAX)}


# host -> server, control channel


@dataclass(frozen=True, kw_only=True)
class Register(Message):
    """Opens a session; never signed. Carries exactly one of ``proof`` (with
    ``ts_ms`` and ``nonce``: the agent's default, a proof of possession of the
    host credential bound to the host, a timestamp and a fresh nonce, see
    ``transport.broker_auth.register_proof``) or ``credential`` (the credential
    itself, as older agents send it)."""

    TYPE: ClassVar[str] = "register"
    host_id: str
    credential: str | None = field(default=None, repr=False)
    agent_version: str = ""
    proof: bytes | None = field(default=None, repr=False)
    ts_ms: int | None = None
    nonce: bytes | None = None

    def __post_init__(self) -> None:
        if (self.credential is None) == (self.proof is None):
            raise ValueError("a Register carries exactly one of credential or proof")
        if self.proof is not None and (self.ts_ms is None or self.nonce is None):
            raise ValueError("a Register proof needs ts_ms and nonce")

    def to_body(self) -> dict[str, Any]:
        if self.proof is None:
            return _fields(self, "host_id", "credential", "agent_version")
        return _fields(self, "host_id", "proof", "ts_ms", "nonce", "agent_version")

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        host_id = r.token("host_id")
        agent_version = r.text("agent_version", "", max_len=MAX_NAME_LEN)
        if body.get("proof") is None:
            return cls(
                host_id=host_id, credential=r.hex64("credential"), agent_version=agent_version
            )
        if body.get("credential") is not None:
            raise _out_of_range("credential", "must be absent when proof is given")
        return cls(
            host_id=host_id,
            agent_version=agent_version,
            proof=r.blob("proof", min_len=REGISTER_PROOF_LEN, max_len=REGISTER_PROOF_LEN),
            ts_ms=r.integer("ts_ms", lo=0, hi=INT64_MAX),
            nonce=r.blob("nonce", min_len=NONCE_LEN, max_len=NONCE_LEN),
        )


@dataclass(frozen=True, kw_only=True)
class RegisterOk(Message):
    TYPE: ClassVar[str] = "register_ok"
    host_id: str
    generation: int
    session_key: bytes = field(repr=False)
    lease_s: float
    heartbeat_s: float

    def to_body(self) -> dict[str, Any]:
        return _fields(self, "host_id", "generation", "session_key", "lease_s", "heartbeat_s")

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        return cls(
            host_id=r.token("host_id"),
            generation=r.integer("generation", lo=0, hi=INT32_MAX),
            session_key=r.blob("session_key", min_len=SESSION_KEY_LEN, max_len=SESSION_KEY_LEN),
            lease_s=r.number("lease_s"),
            heartbeat_s=r.number("heartbeat_s"),
        )


@dataclass(frozen=True, kw_only=True)
class Device:
    """One device in a heartbeat snapshot (a record inside a message, not a message)."""

    device_id: str
    state: str = "idle"
    capabilities: dict[str, str] = field(default_factory=dict)

    def to_body(self) -> dict[str, Any]:
        return _fields(self, "device_id", "state", "capabilities")

    @classmethod
    def from_body(cls, body: object, path: str = "") -> Self:
        r = _Reader(body, path)
        return cls(
            device_id=r.name("device_id"),
            state=r.text("state", choices=_DEVICE_STATES),
            capabilities=r.str_map("capabilities", {}),
        )


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    """The host's complete device snapshot."""

    TYPE: ClassVar[str] = "heartbeat"
    devices: list[Device] = field(default_factory=list)

    def to_body(self) -> dict[str, Any]:
        return {"devices": [d.to_body() for d in self.devices]}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        items = r.seq("devices", [], max_items=MAX_DEVICES)
        return cls(devices=[Device.from_body(d, f"devices[{i}].") for i, d in enumerate(items)])


@dataclass(frozen=True, kw_only=True)
class ReconcileEntry:
    task_id: str
    attempt: int
    lease_token: str = field(repr=False)

    def to_body(self) -> dict[str, Any]:
        return _fields(self, *_LEASE_FIELDS)

    @classmethod
    def from_body(cls, body: object, path: str = "") -> Self:
        return cls(**_lease_ref(_Reader(body, path)))


@dataclass(frozen=True, kw_only=True)
class Reconcile(Message):
    """Every attempt the host's journal says it holds."""

    TYPE: ClassVar[str] = "reconcile"
    entries: list[ReconcileEntry] = field(default_factory=list)

    def to_body(self) -> dict[str, Any]:
        return {"entries": [e.to_body() for e in self.entries]}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        items = r.seq("entries", [], max_items=MAX_DEVICES)
        return cls(
            entries=[ReconcileEntry.from_body(e, f"entries[{i}].") for i, e in enumerate(items)]
        )


@dataclass(frozen=True, kw_only=True)
class Verdict:
    task_id: str
    attempt: int
    verdict: str
    reason: str = ""
    cancel_requested: bool = False
    lease_expires_at: float | None = None

    def to_body(self) -> dict[str, Any]:
        return _fields(
            self, "task_id", "attempt", "verdict", "reason", "cancel_requested", "lease_expires_at"
        )

    @classmethod
    def from_body(cls, body: object, path: str = "") -> Self:
        r = _Reader(body, path)
        return cls(
            **_attempt_ref(r),
            verdict=r.text("verdict", choices=_VERDICTS),
            reason=r.text("reason", ""),
            cancel_requested=r.flag("cancel_requested", False),
            lease_expires_at=r.number("lease_expires_at", None),
        )


@dataclass(frozen=True, kw_only=True)
class ReconcileResult(Message):
    TYPE: ClassVar[str] = "reconcile_result"
    generation: int
    verdicts: list[Verdict] = field(default_factory=list)

    def to_body(self) -> dict[str, Any]:
        return {"generation": self.generation, "verdicts": [v.to_body() for v in self.verdicts]}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        items = r.seq("verdicts", [], max_items=MAX_DEVICES)
        return cls(
            generation=r.integer("generation", lo=0, hi=INT32_MAX),
            verdicts=[Verdict.from_body(v, f"verdicts[{i}].") for i, v in enumerate(items)],
        )


@dataclass(frozen=True, kw_only=True)
class Ok(Message):
    TYPE: ClassVar[str] = "ok"

    def to_body(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        _Reader(body)
        return cls()


# host -> server, jobs channel


@dataclass(frozen=True, kw_only=True)
class Claim(Message):
    """Long-poll for an assignment on one of ``devices`` (empty: any device)."""

    TYPE: ClassVar[str] = "claim"
    wait_s: float = 0.0
    devices: list[str] = field(default_factory=list)

    def to_body(self) -> dict[str, Any]:
        return _fields(self, "wait_s", "devices")

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        return cls(
            wait_s=r.number("wait_s", 0.0, lo=0.0, hi=MAX_WAIT_S),
            devices=r.str_list("devices", [], max_items=MAX_DEVICES),
        )


@dataclass(frozen=True, kw_only=True)
class Assignment(Message):
    """A claimed attempt; the only message that carries the raw lease token."""

    TYPE: ClassVar[str] = "assignment"
    task_id: str
    attempt: int
    device_id: str
    lease_id: str
    lease_token: str = field(repr=False)
    kind: TaskKind
    goal: str | None = None
    workflow: str | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    ack_deadline: float
    lease_s: float

    def to_body(self) -> dict[str, Any]:
        return _fields(
            self,
            "task_id",
            "attempt",
            "device_id",
            "lease_id",
            "lease_token",
            "kind",
            "goal",
            "workflow",
            "payload",
            "ack_deadline",
            "lease_s",
        )

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        return cls(
            **_lease_ref(r),
            device_id=r.name("device_id"),
            lease_id=r.uuid("lease_id"),
            kind=TaskKind(r.text("kind", choices=_KINDS)),
            goal=r.text("goal", None),
            workflow=r.text("workflow", None),
            payload=r.doc("payload", {}),
            ack_deadline=r.number("ack_deadline"),
            lease_s=r.number("lease_s"),
        )


@dataclass(frozen=True, kw_only=True)
class NoWork(Message):
    TYPE: ClassVar[str] = "no_work"

    def to_body(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        _Reader(body)
        return cls()


@dataclass(frozen=True, kw_only=True)
class Ack(Message):
    TYPE: ClassVar[str] = "ack"
    task_id: str
    attempt: int
    lease_token: str = field(repr=False)

    def to_body(self) -> dict[str, Any]:
        return _fields(self, *_LEASE_FIELDS)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        return cls(**_lease_ref(_Reader(body)))


@dataclass(frozen=True, kw_only=True)
class Renew(Message):
    TYPE: ClassVar[str] = "renew"
    task_id: str
    attempt: int
    lease_token: str = field(repr=False)

    def to_body(self) -> dict[str, Any]:
        return _fields(self, *_LEASE_FIELDS)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        return cls(**_lease_ref(_Reader(body)))


@dataclass(frozen=True, kw_only=True)
class Progress(Message):
    TYPE: ClassVar[str] = "progress"
    task_id: str
    attempt: int
    lease_token: str = field(repr=False)
    seq: int
    message: str = ""

    def to_body(self) -> dict[str, Any]:
        return _fields(self, *_LEASE_FIELDS, "seq", "message")

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        return cls(**_lease_ref(r), seq=r.integer("seq"), message=r.text("message", ""))


@dataclass(frozen=True, kw_only=True)
class LeaseReply(Message):
    """Reply to Ack, Renew and Progress."""

    TYPE: ClassVar[str] = "lease_reply"
    task_id: str
    attempt: int
    state: TaskState
    lease_expires_at: float
    cancel_requested: bool = False

    def to_body(self) -> dict[str, Any]:
        return _fields(self, "task_id", "attempt", "state", "lease_expires_at", "cancel_requested")

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        return cls(
            **_attempt_ref(r),
            state=TaskState(r.text("state", choices=_TASK_STATES)),
            lease_expires_at=r.number("lease_expires_at"),
            cancel_requested=r.flag("cancel_requested", False),
        )


@dataclass(frozen=True, kw_only=True)
class Result(Message):
    TYPE: ClassVar[str] = "result"
    task_id: str
    attempt: int
    lease_token: str = field(repr=False)
    outcome: Outcome
    retryable: bool = False
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    fingerprint: str

    def to_body(self) -> dict[str, Any]:
        return _fields(
            self, *_LEASE_FIELDS, "outcome", "retryable", "reason", "result", "fingerprint"
        )

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        return cls(
            **_lease_ref(r),
            outcome=Outcome(r.text("outcome", choices=_OUTCOMES)),
            retryable=r.flag("retryable", False),
            reason=r.text("reason", ""),
            result=r.doc("result", {}),
            fingerprint=r.text("fingerprint", min_len=1, max_len=MAX_NAME_LEN),
        )


@dataclass(frozen=True, kw_only=True)
class ResultReply(Message):
    TYPE: ClassVar[str] = "result_reply"
    task_id: str
    attempt: int
    state: TaskState
    outcome: Outcome
    fingerprint: str
    replayed: bool = False
    retry_at: float | None = None

    def to_body(self) -> dict[str, Any]:
        return _fields(
            self, "task_id", "attempt", "state", "outcome", "fingerprint", "replayed", "retry_at"
        )

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        return cls(
            **_attempt_ref(r),
            state=TaskState(r.text("state", choices=_TASK_STATES)),
            outcome=Outcome(r.text("outcome", choices=_OUTCOMES)),
            fingerprint=r.text("fingerprint", min_len=1, max_len=MAX_NAME_LEN),
            replayed=r.flag("replayed", False),
            retry_at=r.number("retry_at", None),
        )


@dataclass(frozen=True, kw_only=True)
class CancelPoll(Message):
    TYPE: ClassVar[str] = "cancel_poll"
    task_id: str
    attempt: int
    lease_token: str = field(repr=False)

    def to_body(self) -> dict[str, Any]:
        return _fields(self, *_LEASE_FIELDS)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        return cls(**_lease_ref(_Reader(body)))


@dataclass(frozen=True, kw_only=True)
class CancelStatus(Message):
    TYPE: ClassVar[str] = "cancel_status"
    task_id: str
    attempt: int
    cancel_requested: bool

    def to_body(self) -> dict[str, Any]:
        return _fields(self, "task_id", "attempt", "cancel_requested")

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        return cls(**_attempt_ref(r), cancel_requested=r.flag("cancel_requested"))


# host -> server, logs and artifacts channels


@dataclass(frozen=True, kw_only=True)
class LogAppend(Message):
    """Lines ``first_seq, first_seq + 1, ...`` of an attempt's log."""

    TYPE: ClassVar[str] = "log_append"
    task_id: str
    attempt: int
    first_seq: int
    lines: list[str] = field(default_factory=list)

    def to_body(self) -> dict[str, Any]:
        return _fields(self, "task_id", "attempt", "first_seq", "lines")

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        ref = _attempt_ref(r)
        first_seq = r.integer("first_seq")
        lines = r.str_list("lines", [], max_items=MAX_LOG_LINES, max_len=MAX_LOG_LINE_BYTES)
        for i, line in enumerate(lines):
            # The limit is on encoded bytes; characters can be up to 4 bytes each.
            if (
                len(line) * 4 > MAX_LOG_LINE_BYTES
                and len(line.encode("utf-8", "surrogatepass")) > MAX_LOG_LINE_BYTES
            ):
                raise _out_of_range(f"lines[{i}]", f"must be at most {MAX_LOG_LINE_BYTES} bytes")
        return cls(**ref, first_seq=first_seq, lines=lines)


@dataclass(frozen=True, kw_only=True)
class ArtifactChunk(Message):
    TYPE: ClassVar[str] = "artifact_chunk"
    task_id: str
    attempt: int
    name: str
    offset: int
    data: bytes = field(repr=False)

    def to_body(self) -> dict[str, Any]:
        return _fields(self, "task_id", "attempt", "name", "offset", "data")

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        return cls(
            **_attempt_ref(r),
            name=r.name("name"),
            offset=r.integer("offset"),
            data=r.blob("data", max_len=MAX_CHUNK_BYTES),
        )


@dataclass(frozen=True, kw_only=True)
class ArtifactCommit(Message):
    TYPE: ClassVar[str] = "artifact_commit"
    task_id: str
    attempt: int
    name: str
    size: int
    sha256: str

    def to_body(self) -> dict[str, Any]:
        return _fields(self, "task_id", "attempt", "name", "size", "sha256")

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        return cls(
            **_attempt_ref(r),
            name=r.name("name"),
            size=r.integer("size"),
            sha256=r.hex64("sha256"),
        )


# user API


@dataclass(frozen=True, kw_only=True)
class OpsRequest(Message):
    TYPE: ClassVar[str] = "ops_request"
    token: str = field(repr=False)
    verb: str
    args: dict[str, Any] = field(default_factory=dict)

    def to_body(self) -> dict[str, Any]:
        return _fields(self, "token", "verb", "args")

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        return cls(
            token=r.text("token", max_len=MAX_NAME_LEN),
            verb=r.token("verb"),
            args=r.doc("args", {}),
        )


@dataclass(frozen=True, kw_only=True)
class OpsReply(Message):
    """Any msgpack value; the user API defines its shape per verb."""

    TYPE: ClassVar[str] = "ops_reply"
    data: Any = None

    def to_body(self) -> dict[str, Any]:
        return {"data": self.data}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        return cls(data=r.any("data"))


@dataclass(frozen=True, kw_only=True)
class Error(Message):
    TYPE: ClassVar[str] = "error"
    code: str
    message: str = ""

    def __post_init__(self) -> None:
        if self.code not in ERROR_CODES:
            raise ValueError(f"code must be one of {sorted(ERROR_CODES)}, got {self.code!r}")

    def to_body(self) -> dict[str, Any]:
        return _fields(self, "code", "message")

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Reader(body)
        return cls(code=r.text("code", choices=ERROR_CODES), message=r.text("message", ""))


MESSAGE_TYPES: dict[str, type[Message]] = {
    m.TYPE: m
    for m in (
        Register,
        RegisterOk,
        Heartbeat,
        Reconcile,
        ReconcileResult,
        Ok,
        Claim,
        Assignment,
        NoWork,
        Ack,
        Renew,
        Progress,
        LeaseReply,
        Result,
        ResultReply,
        CancelPoll,
        CancelStatus,
        LogAppend,
        ArtifactChunk,
        ArtifactCommit,
        OpsRequest,
        OpsReply,
        Error,
    )
}

#: Host requests that must carry a session signature. Register opens the session
#: (it carries the credential instead) and ops requests carry a user token.
SIGNED_TYPES: frozenset[str] = frozenset(
    {
        "heartbeat",
        "reconcile",
        "claim",
        "ack",
        "renew",
        "progress",
        "result",
        "cancel_poll",
        "log_append",
        "artifact_chunk",
        "artifact_commit",
    }
)
assert MESSAGE_TYPES.keys() >= SIGNED_TYPES


# -- envelope ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Auth:
    """A host message's session signature (see transport/auth.py)."""

    host_id: str
    generation: int
    ts_ms: int
    nonce: bytes
    signature: bytes = field(repr=False)

    def to_map(self) -> dict[str, Any]:
        return {
            "h": self.host_id,
            "g": self.generation,
            "ts": self.ts_ms,
            "n": self.nonce,
            "s": self.signature,
        }

    @classmethod
    def from_map(cls, data: object) -> Self:
        r = _Reader(data, "a.")
        return cls(
            host_id=r.token("h"),
            generation=r.integer("g", lo=0, hi=INT32_MAX),
            ts_ms=r.integer("ts"),
            nonce=r.blob("n", min_len=NONCE_LEN, max_len=NONCE_LEN),
            signature=r.blob("s", min_len=SIGNATURE_LEN, max_len=SIGNATURE_LEN),
        )


@dataclass(frozen=True, kw_only=True)
class Envelope:
    """A decoded message. ``body`` holds the exact body bytes that were signed."""

    version: int
    msg: Message
    auth: Auth | None
    body: bytes = field(repr=False)


def _reject_ext(code: int, data: bytes) -> object:
    raise ValueError("msgpack ext types are not accepted")


def _unpack(data: bytes, field_name: str | None) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_ext_len=0,
            ext_hook=_reject_ext,
        )
    except msgpack.ExtraData:
        raise DecodeError("trailing_data", field=field_name) from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # ValueError covers FormatError, StackError, bad UTF-8 and our ext
        # refusal; TypeError is an unhashable (list) map key.
        raise DecodeError(
            "not_msgpack", f"not msgpack: {type(exc).__name__}", field=field_name
        ) from exc


def encode_body(msg: Message) -> bytes:
    """The body bytes of ``msg``: what a signature covers and what goes into "b"."""
    return bytes(msgpack.packb(msg.to_body(), use_bin_type=True))


def encode_envelope(msg_type: str, body: bytes, auth: Auth | None = None) -> bytes:
    """An envelope around already-encoded body bytes (the signing path)."""
    if msg_type not in MESSAGE_TYPES:
        raise ValueError(f"msg_type must be a known message type, got {msg_type!r}")
    env: dict[str, Any] = {"v": VERSION, "t": msg_type, "b": body}
    if auth is not None:
        env["a"] = auth.to_map()
    return bytes(msgpack.packb(env, use_bin_type=True))


def encode(msg: Message, auth: Auth | None = None) -> bytes:
    """Encode ``msg``. With ``auth``, the signature must have been computed over
    ``encode_body(msg)``; ``transport.auth.Signer.seal`` does both in one step."""
    return encode_envelope(msg.TYPE, encode_body(msg), auth)


def encode_reply(msg: Message) -> bytes:
    return encode(msg)


def error_reply(code: str, message: str) -> bytes:
    return encode(Error(code=code, message=message))


def decode(data: bytes, *, max_size: int = MAX_MESSAGE_SIZE) -> Envelope:
    """Decode and validate one envelope; raises DecodeError and nothing else."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError("not_bytes", f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_size:
        raise DecodeError("too_big", f"message is {len(data)} bytes, limit {max_size}")
    env = _unpack(data, None)
    if not isinstance(env, dict):
        raise DecodeError("not_a_map", "envelope is not a map")
    r = _Reader(env)
    version = r.integer("v", lo=0, hi=INT64_MAX)
    if version != VERSION:
        raise DecodeError("wrong_version", f"unsupported version {version}", field="v")
    msg_type = r.text("t", max_len=MAX_NAME_LEN)
    cls = MESSAGE_TYPES.get(msg_type)
    if cls is None:
        raise DecodeError("unknown_type", f"unknown message type {msg_type!r}", field="t")
    body_bytes = r.blob("b", max_len=max_size)
    auth = Auth.from_map(env["a"]) if "a" in env else None
    body = _unpack(body_bytes, "b")
    if not isinstance(body, dict):
        raise DecodeError("not_a_map", "body is not a map", field="b")
    return Envelope(version=version, msg=cls.from_body(body), auth=auth, body=body_bytes)


M = TypeVar("M", bound=Message)


@overload
def decode_reply(data: bytes, expected: type[M]) -> M: ...
@overload
def decode_reply(data: bytes, expected: tuple[type[Message], ...]) -> Message: ...
def decode_reply(data: bytes, expected: type[Message] | tuple[type[Message], ...]) -> Message:
    """Decode a reply for a client: an Error becomes RemoteError, any type other
    than ``expected`` is a DecodeError."""
    msg = decode(data).msg
    if isinstance(msg, Error):
        raise RemoteError(msg.code, msg.message)
    if not isinstance(msg, expected):
        raise DecodeError("unexpected_type", f"unexpected reply type {msg.TYPE!r}", field="t")
    return msg
