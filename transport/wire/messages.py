"""The closed set of wire messages, each declared once: its fields, their
kinds and defaults. Encoding and decoding both follow from these declarations
(``codec.py``); the envelope around a body is ``envelope.py``."""

from __future__ import annotations

from typing import Any, ClassVar

from fleetlease.persistence.model import Outcome, TaskKind, TaskState
from fleetlease.transport.wire.base import (
    ERROR_CODES,
    INT32_MAX,
    MAX_CHUNK_BYTES,
    MAX_DEVICES,
    MAX_LOG_LINE_BYTES,
    MAX_LOG_LINES,
    MAX_NAME_LEN,
    MAX_WAIT_S,
    NONCE_LEN,
    REGISTER_PROOF_LEN,
    SESSION_KEY_LEN,
    DecodeError,
    out_of_range,
)
from fleetlease.transport.wire.codec import (
    AnyValue,
    Blob,
    Choice,
    Doc,
    Flag,
    Hex64,
    Integer,
    Message,
    Name,
    Number,
    Record,
    Records,
    StrList,
    StrMap,
    Text,
    Token,
    Uuid,
    record,
    wired,
)

#: Workflows one host may advertise.
MAX_WORKFLOWS = 1000
_DEVICE_STATES = frozenset({"idle", "busy", "offline"})
_VERDICTS = frozenset({"confirmed", "discard"})


# The kinds of the fields most messages share.
_TASK_ID = Uuid()
_ATTEMPT = Integer(lo=1, hi=INT32_MAX)
#: The raw lease token (declared ``repr=False`` wherever it appears).
_LEASE_TOKEN = Text(min_len=1, max_len=MAX_NAME_LEN)
_FINGERPRINT = Text(min_len=1, max_len=MAX_NAME_LEN)


def _missing(path: str, name: str) -> DecodeError:
    return DecodeError("missing_field", f"missing field {path}{name}", field=path + name)


# host -> server, control channel


@record
class Register(Message):
    """Opens a session; never signed. Carries exactly one of ``proof`` (with
    ``ts_ms`` and ``nonce``: the agent's default, a proof of possession of the
    host credential bound to the host, a timestamp and a fresh nonce, see
    ``transport.broker_auth.register_proof``) or ``credential`` (the credential
    itself, as older agents send it)."""

    TYPE: ClassVar[str] = "register"
    host_id: str = wired(Token())
    credential: str | None = wired(Hex64(), omit_none=True, default=None, repr=False)
    proof: bytes | None = wired(
        Blob(min_len=REGISTER_PROOF_LEN, max_len=REGISTER_PROOF_LEN),
        omit_none=True,
        default=None,
        repr=False,
    )
    ts_ms: int | None = wired(Integer(), omit_none=True, default=None)
    nonce: bytes | None = wired(
        Blob(min_len=NONCE_LEN, max_len=NONCE_LEN), omit_none=True, default=None
    )
    agent_version: str = wired(Text(max_len=MAX_NAME_LEN), default="")

    def __post_init__(self) -> None:
        if (self.credential is None) == (self.proof is None):
            raise ValueError("a Register carries exactly one of credential or proof")
        if self.proof is not None and (self.ts_ms is None or self.nonce is None):
            raise ValueError("a Register proof needs ts_ms and nonce")

    @classmethod
    def check_decoded(cls, values: dict[str, Any], path: str) -> None:
        if values["proof"] is None:
            if values["credential"] is None:
                raise _missing(path, "credential")
            # A proof's companions mean nothing beside a credential.
            values["ts_ms"] = values["nonce"] = None
            return
        if values["credential"] is not None:
            raise out_of_range(path + "credential", "must be absent when proof is given")
        for name in ("ts_ms", "nonce"):
            if values[name] is None:
                raise _missing(path, name)


@record
class RegisterOk(Message):
    TYPE: ClassVar[str] = "register_ok"
    host_id: str = wired(Token())
    generation: int = wired(Integer(hi=INT32_MAX))
    session_key: bytes = wired(Blob(min_len=SESSION_KEY_LEN, max_len=SESSION_KEY_LEN), repr=False)
    lease_s: float = wired(Number())
    heartbeat_s: float = wired(Number())


@record
class Device(Record):
    """One device in a heartbeat snapshot (a record inside a message, not a message)."""

    device_id: str = wired(Name())
    state: str = wired(Text(choices=_DEVICE_STATES), required=True, default="idle")
    capabilities: dict[str, str] = wired(StrMap(), default_factory=dict)


@record
class Heartbeat(Message):
    """The host's complete device snapshot, and what it runs: the workflows it
    serves (absent: any workflow, as a simulated runner) and its goal runner.

    ``digest`` is the host's tag of that snapshot (devices and what it runs).
    With ``unchanged`` the message carries no snapshot: the host's is still the
    one tagged ``digest``; the control plane answers ``conflict`` when that is
    not the snapshot it holds, and the host then sends the complete one."""

    TYPE: ClassVar[str] = "heartbeat"
    devices: list[Device] = wired(Records(Device, MAX_DEVICES), default_factory=list)
    workflows: list[str] | None = wired(StrList(MAX_WORKFLOWS), omit_none=True, default=None)
    goal_runner: str = wired(Text(max_len=MAX_NAME_LEN), default="")
    digest: str | None = wired(Text(min_len=1, max_len=MAX_NAME_LEN), omit_none=True, default=None)
    unchanged: bool = wired(Flag(), default=False)

    def __post_init__(self) -> None:
        if self.unchanged and (self.digest is None or self.devices):
            raise ValueError("an unchanged heartbeat carries a digest and no devices")

    @classmethod
    def check_decoded(cls, values: dict[str, Any], path: str) -> None:
        if values["unchanged"] and (values["digest"] is None or values["devices"]):
            raise DecodeError(
                "bad_unchanged",
                "an unchanged heartbeat carries a digest and no devices",
                field=path + "unchanged",
            )


@record
class ReconcileEntry(Record):
    task_id: str = wired(_TASK_ID)
    attempt: int = wired(_ATTEMPT)
    lease_token: str = wired(_LEASE_TOKEN, repr=False)


@record
class Reconcile(Message):
    """Every attempt the host's journal says it holds."""

    TYPE: ClassVar[str] = "reconcile"
    entries: list[ReconcileEntry] = wired(
        Records(ReconcileEntry, MAX_DEVICES), default_factory=list
    )


@record
class Verdict(Record):
    task_id: str = wired(_TASK_ID)
    attempt: int = wired(_ATTEMPT)
    verdict: str = wired(Text(choices=_VERDICTS))
    reason: str = wired(Text(), default="")
    cancel_requested: bool = wired(Flag(), default=False)
    lease_expires_at: float | None = wired(Number(), default=None)


@record
class ReconcileResult(Message):
    TYPE: ClassVar[str] = "reconcile_result"
    generation: int = wired(Integer(hi=INT32_MAX))
    verdicts: list[Verdict] = wired(Records(Verdict, MAX_DEVICES), default_factory=list)


@record
class Ok(Message):
    TYPE: ClassVar[str] = "ok"


# host -> server, jobs channel


@record
class Claim(Message):
    """Long-poll for an assignment on one of ``devices`` (empty: any device)."""

    TYPE: ClassVar[str] = "claim"
    wait_s: float = wired(Number(hi=MAX_WAIT_S), default=0.0)
    devices: list[str] = wired(StrList(MAX_DEVICES), default_factory=list)


@record
class Assignment(Message):
    """A claimed attempt; the only message that carries the raw lease token."""

    TYPE: ClassVar[str] = "assignment"
    task_id: str = wired(_TASK_ID)
    attempt: int = wired(_ATTEMPT)
    device_id: str = wired(Name())
    lease_id: str = wired(Uuid())
    lease_token: str = wired(_LEASE_TOKEN, repr=False)
    kind: TaskKind = wired(Choice(TaskKind))
    goal: str | None = wired(Text(), default=None)
    workflow: str | None = wired(Text(), default=None)
    payload: dict[str, Any] = wired(Doc(), default_factory=dict)
    ack_deadline: float = wired(Number())
    lease_s: float = wired(Number())


@record
class NoWork(Message):
    TYPE: ClassVar[str] = "no_work"


@record
class Ack(Message):
    TYPE: ClassVar[str] = "ack"
    task_id: str = wired(_TASK_ID)
    attempt: int = wired(_ATTEMPT)
    lease_token: str = wired(_LEASE_TOKEN, repr=False)


@record
class Renew(Message):
    TYPE: ClassVar[str] = "renew"
    task_id: str = wired(_TASK_ID)
    attempt: int = wired(_ATTEMPT)
    lease_token: str = wired(_LEASE_TOKEN, repr=False)


@record
class Progress(Message):
    TYPE: ClassVar[str] = "progress"
    task_id: str = wired(_TASK_ID)
    attempt: int = wired(_ATTEMPT)
    lease_token: str = wired(_LEASE_TOKEN, repr=False)
    seq: int = wired(Integer())
    message: str = wired(Text(), default="")


@record
class LeaseReply(Message):
    """Reply to Ack, Renew and Progress."""

    TYPE: ClassVar[str] = "lease_reply"
    task_id: str = wired(_TASK_ID)
    attempt: int = wired(_ATTEMPT)
    state: TaskState = wired(Choice(TaskState))
    lease_expires_at: float = wired(Number())
    cancel_requested: bool = wired(Flag(), default=False)


@record
class Result(Message):
    TYPE: ClassVar[str] = "result"
    task_id: str = wired(_TASK_ID)
    attempt: int = wired(_ATTEMPT)
    lease_token: str = wired(_LEASE_TOKEN, repr=False)
    outcome: Outcome = wired(Choice(Outcome))
    retryable: bool = wired(Flag(), default=False)
    reason: str = wired(Text(), default="")
    result: dict[str, Any] = wired(Doc(), default_factory=dict)
    fingerprint: str = wired(_FINGERPRINT)


@record
class ResultReply(Message):
    TYPE: ClassVar[str] = "result_reply"
    task_id: str = wired(_TASK_ID)
    attempt: int = wired(_ATTEMPT)
    state: TaskState = wired(Choice(TaskState))
    outcome: Outcome = wired(Choice(Outcome))
    fingerprint: str = wired(_FINGERPRINT)
    replayed: bool = wired(Flag(), default=False)
    retry_at: float | None = wired(Number(), default=None)


@record
class CancelPoll(Message):
    TYPE: ClassVar[str] = "cancel_poll"
    task_id: str = wired(_TASK_ID)
    attempt: int = wired(_ATTEMPT)
    lease_token: str = wired(_LEASE_TOKEN, repr=False)


@record
class CancelStatus(Message):
    TYPE: ClassVar[str] = "cancel_status"
    task_id: str = wired(_TASK_ID)
    attempt: int = wired(_ATTEMPT)
    cancel_requested: bool = wired(Flag())


# host -> server, logs and artifacts channels


@record
class LogAppend(Message):
    """Lines ``first_seq, first_seq + 1, ...`` of an attempt's log."""

    TYPE: ClassVar[str] = "log_append"
    task_id: str = wired(_TASK_ID)
    attempt: int = wired(_ATTEMPT)
    first_seq: int = wired(Integer())
    lines: list[str] = wired(
        StrList(MAX_LOG_LINES, max_len=MAX_LOG_LINE_BYTES, max_bytes=MAX_LOG_LINE_BYTES),
        default_factory=list,
    )


@record
class ArtifactChunk(Message):
    TYPE: ClassVar[str] = "artifact_chunk"
    task_id: str = wired(_TASK_ID)
    attempt: int = wired(_ATTEMPT)
    lease_token: str = wired(_LEASE_TOKEN, repr=False)
    name: str = wired(Name())
    offset: int = wired(Integer())
    data: bytes = wired(Blob(max_len=MAX_CHUNK_BYTES), repr=False)


@record
class ArtifactCommit(Message):
    TYPE: ClassVar[str] = "artifact_commit"
    task_id: str = wired(_TASK_ID)
    attempt: int = wired(_ATTEMPT)
    lease_token: str = wired(_LEASE_TOKEN, repr=False)
    name: str = wired(Name())
    size: int = wired(Integer())
    sha256: str = wired(Hex64())


# user API


@record
class OpsRequest(Message):
    TYPE: ClassVar[str] = "ops_request"
    token: str = wired(Text(max_len=MAX_NAME_LEN), repr=False)
    verb: str = wired(Token())
    args: dict[str, Any] = wired(Doc(), default_factory=dict)


@record
class OpsReply(Message):
    """Any msgpack value; the user API defines its shape per verb."""

    TYPE: ClassVar[str] = "ops_reply"
    data: Any = wired(AnyValue(), default=None)


@record
class Error(Message):
    TYPE: ClassVar[str] = "error"
    code: str = wired(Text(choices=ERROR_CODES))
    message: str = wired(Text(), default="")

    def __post_init__(self) -> None:
        if self.code not in ERROR_CODES:
            raise ValueError(f"code must be one of {sorted(ERROR_CODES)}, got {self.code!r}")


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
