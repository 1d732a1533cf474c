"""The envelope around a message's body bytes, the session signature it may
carry, and the only ways in and out: :func:`encode` and :func:`decode`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self, TypeVar, overload

import msgpack

from fleetlease.transport.wire.base import (
    INT32_MAX,
    INT64_MAX,
    MAX_MESSAGE_SIZE,
    MAX_NAME_LEN,
    NONCE_LEN,
    SIGNATURE_LEN,
    VERSION,
    DecodeError,
    Reader,
    RemoteError,
)
from fleetlease.transport.wire.codec import Blob, Integer, Message, Record, Token, record, wired
from fleetlease.transport.wire.messages import MESSAGE_TYPES, Error


@record
class Auth(Record):
    """A host message's session signature (see transport/auth.py), under the
    envelope's "a" as a map of short keys."""

    host_id: str = wired(Token(), key="h")
    generation: int = wired(Integer(hi=INT32_MAX), key="g")
    ts_ms: int = wired(Integer(), key="ts")
    nonce: bytes = wired(Blob(min_len=NONCE_LEN, max_len=NONCE_LEN), key="n")
    signature: bytes = wired(
        Blob(min_len=SIGNATURE_LEN, max_len=SIGNATURE_LEN), key="s", repr=False
    )

    def to_map(self) -> dict[str, Any]:
        return self.to_body()

    @classmethod
    def from_map(cls, data: object) -> Self:
        return cls.from_body(data, "a.")


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
    r = Reader(env)
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
