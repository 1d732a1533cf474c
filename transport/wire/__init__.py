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

The package: ``messages`` declares every message once (its fields, their kinds
and defaults); ``codec`` derives each message's body map, in both directions,
from those declarations; ``envelope`` wraps and unwraps body bytes; ``base``
holds the limits, the errors and the strict field reader. Everything public is
re-exported here: import from ``fleetlease.transport.wire``.
"""

from fleetlease.persistence.model import Outcome, TaskKind, TaskState
from fleetlease.transport.wire.base import (
    ARTIFACT_CHUNK_BYTES,
    ERROR_CODES,
    INT32_MAX,
    INT64_MAX,
    MAX_CHUNK_BYTES,
    MAX_DEPTH,
    MAX_DEVICES,
    MAX_LOG_LINE_BYTES,
    MAX_LOG_LINES,
    MAX_MESSAGE_SIZE,
    MAX_NAME_LEN,
    MAX_TEXT_LEN,
    MAX_WAIT_S,
    NONCE_LEN,
    REGISTER_PROOF_LEN,
    SESSION_KEY_LEN,
    SIGNATURE_LEN,
    VERSION,
    DecodeError,
    RemoteError,
    from_unix,
    to_unix,
)
from fleetlease.transport.wire.codec import Message, Record
from fleetlease.transport.wire.envelope import (
    Auth,
    Envelope,
    decode,
    decode_reply,
    encode,
    encode_body,
    encode_envelope,
    encode_reply,
    error_reply,
)
from fleetlease.transport.wire.messages import (
    MESSAGE_TYPES,
    SIGNED_TYPES,
    Ack,
    ArtifactChunk,
    ArtifactCommit,
    Assignment,
    CancelPoll,
    CancelStatus,
    Claim,
    Device,
    Error,
    Heartbeat,
    LeaseReply,
    LogAppend,
    NoWork,
    Ok,
    OpsReply,
    OpsRequest,
    Progress,
    Reconcile,
    ReconcileEntry,
    ReconcileResult,
    Register,
    RegisterOk,
    Renew,
    Result,
    ResultReply,
    Verdict,
)

__all__ = [
    "ARTIFACT_CHUNK_BYTES",
    "ERROR_CODES",
    "INT32_MAX",
    "INT64_MAX",
    "MAX_CHUNK_BYTES",
    "MAX_DEPTH",
    "MAX_DEVICES",
    "MAX_LOG_LINES",
    "MAX_LOG_LINE_BYTES",
    "MAX_MESSAGE_SIZE",
    "MAX_NAME_LEN",
    "MAX_TEXT_LEN",
    "MAX_WAIT_S",
    "MESSAGE_TYPES",
    "NONCE_LEN",
    "REGISTER_PROOF_LEN",
    "SESSION_KEY_LEN",
    "SIGNATURE_LEN",
    "SIGNED_TYPES",
    "VERSION",
    "Ack",
    "ArtifactChunk",
    "ArtifactCommit",
    "Assignment",
    "Auth",
    "CancelPoll",
    "CancelStatus",
    "Claim",
    "DecodeError",
    "Device",
    "Envelope",
    "Error",
    "Heartbeat",
    "LeaseReply",
    "LogAppend",
    "Message",
    "NoWork",
    "Ok",
    "OpsReply",
    "OpsRequest",
    "Outcome",
    "Progress",
    "Reconcile",
    "ReconcileEntry",
    "ReconcileResult",
    "Record",
    "Register",
    "RegisterOk",
    "RemoteError",
    "Renew",
    "Result",
    "ResultReply",
    "TaskKind",
    "TaskState",
    "Verdict",
    "decode",
    "decode_reply",
    "encode",
    "encode_body",
    "encode_envelope",
    "encode_reply",
    "error_reply",
    "from_unix",
    "to_unix",
]
