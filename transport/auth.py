"""Host session security: server secret, session keys, message signatures, replay window.

Design:

* A host registers with its long-lived credential (only its SHA-256 is stored) and
  gets a session ``(host_id, generation)``; every registration bumps the
  generation and so kills the previous session.
* The session key is ``HMAC-SHA256(server_secret, "fleetlease-session\\0" || host_id
  || "\\0" || generation as 8 bytes big-endian)``. It is derived, never stored: a
  restarted control plane verifies the current session from the server secret
  (a file under the state dir, mode 0600, never in the database) and the
  generation in PostgreSQL.
* Every host message after Register is signed: the envelope's "b" field holds
  the msgpack body bytes exactly as the sender produced them (see
  ``transport/wire/``) and "a" holds ``{h, g, ts, n, s}``. The signature ``s`` is
  ``HMAC-SHA256(session_key, "fleetlease-sig-v1" || lp(subject) || lp(type) ||
  lp(body) || ts_ms as 8 bytes || lp(nonce))`` where ``lp(x)`` is x's length as 8
  bytes big-endian followed by x. Length prefixes make the encoding unambiguous;
  the subject binds the message to its host and verb, the type binds the body's
  interpretation (Ack and Renew bodies are identical), the timestamp and nonce
  make each signature single-use.
* :class:`Verifier` accepts a message only if the subject names the signing host,
  the generation is the current one (passed in by the caller: the verifier never
  reads the database), the timestamp is within ``window_s`` of now, the HMAC
  matches (constant-time compare) and the ``(host, nonce)`` pair was not seen
  within the window by this process. That replay cache lives in process
  memory and is the fast first check; the server then records the nonce in
  PostgreSQL, shared by every control-plane process of the fleet
  (``transport/replay.py``), so a message replayed to another process, or to
  this one after a restart, is refused too. The fencing in the repository
  (lease tokens, attempt numbers, result fingerprints) still bounds what any
  message can do.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
import secrets
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from fleetlease.persistence.clock import Clock, SystemClock
from fleetlease.persistence.secrets import hash_secret, new_token, secrets_equal
from fleetlease.transport.subjects import Subjects, validate_token
from fleetlease.transport.wire import (
    MESSAGE_TYPES,
    NONCE_LEN,
    SESSION_KEY_LEN,
    SIGNATURE_LEN,
    VERSION,
    Auth,
    Envelope,
    Message,
    encode_body,
)

__all__ = [
    "SERVER_SECRET_LEN",
    "AuthError",
    "ServerSecret",
    "Signer",
    "Verifier",
    "hash_secret",
    "new_token",
    "secrets_equal",
    "session_key",
    "sign",
]

SERVER_SECRET_LEN = 32
DEFAULT_WINDOW_S = 30.0
DEFAULT_REPLAY_CACHE_SIZE = 200_000
#: Session keys remembered by a verifier (one per live host session; cleared
#: when full).
_KEY_CACHE_SIZE = 100_000

_SESSION_DOMAIN = b"fleetlease-session\0"
_SIG_DOMAIN = b"fleetlease-sig-v1"
_U64 = struct.Struct(">Q")


class AuthError(Exception):
    """The message's session signature was refused."""

    def __init__(self, message: str, *, reason: str, code: str = "unauthorized") -> None:
        self.code = code
        self.reason = reason
        self.message = message
        super().__init__(message)

    @property
    def retryable(self) -> bool:
        return self.code == "unavailable"

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class ServerSecretError(Exception):
    """The server secret file exists but cannot be used."""


@dataclass(frozen=True, kw_only=True)
class ServerSecret:
    """The control plane's root key for session keys: 32 random bytes in a file
    under the state dir. Losing it kills every session (hosts re-register)."""

    value: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.value, bytes) or len(self.value) != SERVER_SECRET_LEN:
            raise ValueError(f"value must be {SERVER_SECRET_LEN} bytes")

    @classmethod
    def generate(cls) -> ServerSecret:
        return cls(value=secrets.token_bytes(SERVER_SECRET_LEN))

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> ServerSecret:
        """Read the secret at ``path``, creating it (mode 0600) if absent. Safe
        against a concurrent first start: the file appears atomically, complete."""
        path = Path(path)
        try:
            return cls._load(path)
        except FileNotFoundError:
            pass
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fresh = cls.generate()
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(fresh.value)
                f.flush()
                os.fsync(f.fileno())
            try:
                # link() fails if the target exists, unlike rename(): the first
                # writer wins and everyone reads the same secret.
                os.link(tmp, path)
            except FileExistsError:
                return cls._load(path)
        finally:
            tmp.unlink(missing_ok=True)
        return fresh

    @classmethod
    def _load(cls, path: Path) -> ServerSecret:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read(SERVER_SECRET_LEN + 1)
        if stat.S_IMODE(mode) & 0o077:
            raise ServerSecretError(f"{path} is accessible to other users; chmod 600 it")
        if len(data) != SERVER_SECRET_LEN:
            raise ServerSecretError(f"{path} holds {len(data)} bytes, expected {SERVER_SECRET_LEN}")
        return cls(value=data)


def _secret_bytes(server_secret: bytes | ServerSecret) -> bytes:
    raw = server_secret.value if isinstance(server_secret, ServerSecret) else server_secret
    if not isinstance(raw, bytes) or len(raw) != SERVER_SECRET_LEN:
        raise ValueError(f"server_secret must be {SERVER_SECRET_LEN} bytes")
    return raw


def session_key(server_secret: bytes | ServerSecret, host_id: str, generation: int) -> bytes:
    """The session key of ``(host_id, generation)``; deterministic, so never stored."""
    secret = _secret_bytes(server_secret)
    validate_token(host_id, "host_id")
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise ValueError(f"generation must be a non-negative int, got {generation!r}")
    msg = _SESSION_DOMAIN + host_id.encode("ascii") + b"\0" + _U64.pack(generation)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _lp(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def sign(
    key: bytes, subject: str, body: bytes, ts_ms: int, nonce: bytes, *, msg_type: str
) -> bytes:
    """HMAC-SHA256 over the length-prefixed (subject, type, body, ts, nonce)."""
    if len(key) != SESSION_KEY_LEN:
        raise ValueError(f"key must be {SESSION_KEY_LEN} bytes")
    if not 0 <= ts_ms < 2**64:
        raise ValueError(f"ts_ms out of range: {ts_ms}")
    msg = b"".join(
        (
            _SIG_DOMAIN,
            _lp(subject.encode("utf-8")),
            _lp(msg_type.encode("utf-8")),
            _lp(body),
            _U64.pack(ts_ms),
            _lp(nonce),
        )
    )
    return hmac.new(key, msg, hashlib.sha256).digest()


def _now_ms(clock: Clock) -> int:
    return int(clock.now().timestamp() * 1000)


def _pack(value: object) -> bytes:
    return bytes(msgpack.packb(value, use_bin_type=True))


# Constant pieces of a signature and of a sealed envelope (see Signer): the
# nonce's length prefix in the signed bytes, and the "n" and "s" keys with the
# msgpack bin headers of their fixed-length values.
_NONCE_LP = _U64.pack(NONCE_LEN)
_NONCE_FIELD = _pack("n") + _pack(bytes(NONCE_LEN))[:-NONCE_LEN]
_SIGNATURE_FIELD = _pack("s") + _pack(bytes(SIGNATURE_LEN))[:-SIGNATURE_LEN]


class Signer:
    """The host side: signs messages for one session.

    The hot path (:meth:`seal`, a few times per task) does no more per message
    than it must: the signed bytes' constant parts (domain, subject, type) and
    the envelope's (version, type, host, generation) are built once per subject
    and type, the HMAC is one C call (``hmac.digest``), the system clock is
    read without a datetime, and the envelope is assembled from msgpack pieces
    instead of an ``Auth`` record and a map. The bytes are exactly those of
    :func:`sign` and :func:`transport.wire.encode_envelope` (the tests compare
    them)."""

    #: Cached signing/envelope prefixes; a session signs on a handful of
    #: subjects, the bound only guards against a caller inventing subjects.
    _MAX_CACHED = 256

    def __init__(
        self, host_id: str, generation: int, key: bytes, *, clock: Clock | None = None
    ) -> None:
        self.host_id = validate_token(host_id, "host_id")
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
            raise ValueError(f"generation must be a non-negative int, got {generation!r}")
        if not isinstance(key, bytes) or len(key) != SESSION_KEY_LEN:
            raise ValueError(f"key must be {SESSION_KEY_LEN} bytes")
        self.generation = generation
        self._key = key
        self._clock: Clock = clock or SystemClock()
        self._system_clock = type(self._clock) is SystemClock
        # (subject, type) -> the signed bytes' prefix: domain, lp(subject), lp(type).
        self._sig_heads: dict[tuple[str, str], bytes] = {}
        # type -> the envelope's bytes up to the body: {"v": 1, "t": type, "b": ...
        self._env_heads: dict[str, bytes] = {}
        # The auth map up to the timestamp: "a": {"h": host, "g": generation, "ts": ...
        self._auth_head = (
            _pack("a")
            + b"\x85"  # a map of 5: h, g, ts, n, s (Auth.to_map's order)
            + _pack("h")
            + _pack(self.host_id)
            + _pack("g")
            + _pack(generation)
            + _pack("ts")
        )

    def __repr__(self) -> str:
        return f"Signer(host_id={self.host_id!r}, generation={self.generation})"

    def _now_ms(self) -> int:
        if self._system_clock:
            return int(time.time() * 1000)
        return _now_ms(self._clock)

    def _sign(self, subject: str, msg_type: str, body: bytes) -> tuple[int, bytes, bytes]:
        """``(ts_ms, nonce, signature)`` for ``body``: :func:`sign`'s bytes."""
        ts_ms = self._now_ms()
        nonce = os.urandom(NONCE_LEN)
        head = self._sig_heads.get((subject, msg_type))
        if head is None:
            head = b"".join(
                (_SIG_DOMAIN, _lp(subject.encode("utf-8")), _lp(msg_type.encode("utf-8")))
            )
            if len(self._sig_heads) >= self._MAX_CACHED:
                self._sig_heads.clear()
            self._sig_heads[(subject, msg_type)] = head
        signed = b"".join((head, _U64.pack(len(body)), body, _U64.pack(ts_ms), _NONCE_LP, nonce))
        return ts_ms, nonce, hmac.digest(self._key, signed, "sha256")

    def auth(self, subject: str, msg_type: str, body: bytes) -> Auth:
        """The auth map for ``body`` (the exact bytes that go into the envelope)."""
        ts_ms, nonce, signature = self._sign(subject, msg_type, body)
        return Auth(
            host_id=self.host_id,
            generation=self.generation,
            ts_ms=ts_ms,
            nonce=nonce,
            signature=signature,
        )

    def seal(self, subject: str, msg: Message) -> bytes:
        """Encode and sign ``msg`` for ``subject`` in one step: the bytes of
        ``encode_envelope(msg.TYPE, body, self.auth(subject, msg.TYPE, body))``."""
        msg_type = msg.TYPE
        env_head = self._env_heads.get(msg_type)
        if env_head is None:
            if msg_type not in MESSAGE_TYPES:
                raise ValueError(f"msg_type must be a known message type, got {msg_type!r}")
            env_head = (
                b"\x84"  # a map of 4: v, t, b, a (encode_envelope's order)
                + _pack("v")
                + _pack(VERSION)
                + _pack("t")
                + _pack(msg_type)
                + _pack("b")
            )
            self._env_heads[msg_type] = env_head
        body = encode_body(msg)
        ts_ms, nonce, signature = self._sign(subject, msg_type, body)
        return b"".join(
            (
                env_head,
                _pack(body),
                self._auth_head,
                _pack(ts_ms),
                _NONCE_FIELD,
                nonce,
                _SIGNATURE_FIELD,
                signature,
            )
        )


class Verifier:
    """The server side: checks signatures, freshness and replays. Never reads the
    database: the caller passes the host's current generation (None for an
    unknown or revoked host). Thread-safe."""

    def __init__(
        self,
        server_secret: bytes | ServerSecret,
        clock: Clock,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        max_entries: int = DEFAULT_REPLAY_CACHE_SIZE,
        subjects: Subjects | None = None,
    ) -> None:
        self._secret = _secret_bytes(server_secret)
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries!r}")
        self._clock = clock
        self._window_ms = int(window_s * 1000)
        self._max_entries = max_entries
        self._subjects = subjects or Subjects()
        self._lock = threading.Lock()
        # (host_id, nonce) -> expiry in ms, and a heap of the same for pruning.
        self._seen: dict[tuple[str, bytes], int] = {}
        self._keys: dict[tuple[str, int], bytes] = {}
        self._expiry: list[tuple[int, str, bytes]] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)

    @property
    def window_s(self) -> float:
        """How far a message's timestamp may be from now, seconds."""
        return self._window_ms / 1000

    def verify_envelope(
        self,
        subject: str,
        env: Envelope,
        current_generation: int | None,
        *,
        subject_host: str | None = None,
    ) -> None:
        self.verify(
            subject,
            env.auth,
            env.body,
            current_generation,
            msg_type=env.msg.TYPE,
            subject_host=subject_host,
        )

    def verify(
        self,
        subject: str,
        auth: Auth | None,
        body: bytes,
        current_generation: int | None,
        *,
        msg_type: str,
        subject_host: str | None = None,
    ) -> None:
        """Raise AuthError unless ``auth`` is a fresh, unreplayed signature by the
        current session of the host named in ``subject`` (``subject_host``: that
        host, when the caller has parsed the subject already)."""
        if auth is None:
            raise AuthError("message is not signed", reason="missing")
        if subject_host is None:
            try:
                subject_host = self._subjects.parse_host_subject(subject).host_id
            except ValueError:
                raise AuthError(
                    "not a host subject", reason="host_mismatch", code="forbidden"
                ) from None
        if auth.host_id != subject_host:
            raise AuthError(
                f"host {auth.host_id!r} may not send on {subject_host!r}'s subjects",
                reason="host_mismatch",
                code="forbidden",
            )
        if current_generation is None:
            raise AuthError("unknown or revoked host", reason="no_session")
        if auth.generation != current_generation:
            raise AuthError("session superseded; register again", reason="generation")
        now_ms = _now_ms(self._clock)
        if auth.ts_ms < now_ms - self._window_ms:
            raise AuthError("message timestamp too old", reason="stale")
        if auth.ts_ms > now_ms + self._window_ms:
            raise AuthError("message timestamp in the future", reason="future")
        key = self._session_key(auth.host_id, auth.generation)
        expected = sign(key, subject, body, auth.ts_ms, auth.nonce, msg_type=msg_type)
        if not secrets_equal(expected, auth.signature):
            raise AuthError("bad signature", reason="bad_signature")
        # Recorded only after the signature checks out, so unauthenticated
        # traffic cannot fill the cache.
        self._remember(auth.host_id, auth.nonce, auth.ts_ms + self._window_ms, now_ms)

    def _session_key(self, host_id: str, generation: int) -> bytes:
        """``session_key``, remembered: it is a pure function of its arguments
        and the secret, and deriving it for every message was an HMAC each."""
        k = (host_id, generation)
        key = self._keys.get(k)
        if key is None:
            key = session_key(self._secret, host_id, generation)
            if len(self._keys) >= _KEY_CACHE_SIZE:
                self._keys.clear()
            self._keys[k] = key
        return key

    def check_register_fresh(self, ts_ms: int) -> None:
        """Raise AuthError unless a Register proof's timestamp is within the window
        (checked before the proof, which costs a database read)."""
        now_ms = _now_ms(self._clock)
        if ts_ms < now_ms - self._window_ms:
            raise AuthError("register timestamp too old", reason="stale")
        if ts_ms > now_ms + self._window_ms:
            raise AuthError("register timestamp in the future", reason="future")

    def remember_register(self, host_id: str, nonce: bytes, ts_ms: int) -> None:
        """Record the nonce of a Register proof that verified; AuthError for a
        replay. Kept apart from message nonces (a host id never holds a colon)."""
        self._remember(f"register:{host_id}", nonce, ts_ms + self._window_ms, _now_ms(self._clock))

    def _remember(self, host_id: str, nonce: bytes, expires_ms: int, now_ms: int) -> None:
        entry = (host_id, nonce)
        with self._lock:
            while self._expiry and self._expiry[0][0] < now_ms:
                _, h, n = heapq.heappop(self._expiry)
                self._seen.pop((h, n), None)
            if entry in self._seen:
                raise AuthError("replayed message", reason="replay")
            if len(self._seen) >= self._max_entries:
                # Evicting a live entry would reopen a replay window; refuse
                # instead and let the host retry once entries age out.
                raise AuthError("replay cache full", reason="cache_full", code="unavailable")
            self._seen[entry] = expires_ms
            heapq.heappush(self._expiry, (expires_ms, host_id, nonce))


# Signature length is fixed by the wire format; keep the two honest.
assert hashlib.sha256().digest_size == SIGNATURE_LEN
