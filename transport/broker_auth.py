"""Broker-level identities: the NATS auth callout served by the control plane.

Every client of the fleet's NATS connects as itself. The nats-server
(2.10 or newer) hands each connection attempt to this service as an
authorization request (a JWT signed by the server, published on
``$SYS.REQ.USER.AUTH`` in the ``AUTH`` account); the service checks the
principal and replies with an authorization response carrying a user JWT,
signed by the callout issuer account key, that binds the connection to the
``FLEET`` account with exactly that principal's permissions:

* a host ``X``: publish ``{p}.host.X.>``; subscribe ``_INBOX_{p}.host.X.>``.
* an ops user ``U``: publish ``{p}.ops.U.>``; subscribe ``_INBOX_{p}.ops.U.>``.
* nobody else may subscribe to a request subject or to another principal's
  inbox; only the control plane's own connections (static nkey users that
  bypass the callout, see ``transport/broker_config.py``) may.

No secret crosses the wire at connect. The client states who it is in the
CONNECT ``auth_token`` field (``host:X`` or ``user:U``, not a secret) and
answers the server's per-connection nonce (sent in INFO) in the ``sig`` field
with a SCRAM-style proof (RFC 5802's construction)::

    client_key = the raw credential or user token (64 hex characters, as bytes)
    stored_key = SHA-256(client_key)                    # what PostgreSQL holds
    mask       = HMAC-SHA512(stored_key, "fleetlease-connect-v1" 0 identity 0 nonce)
    proof      = client_key XOR mask                    # sent, base64url

The service recomputes ``mask`` from the stored hash, unmasks the proof and
compares SHA-256 of the result with the stored hash in constant time. An
eavesdropper sees only a proof bound to a nonce the server never reuses; the
database alone does not let anyone log in (the hash is not the credential).
Like SCRAM, someone holding both the database hash *and* a recorded exchange
could unmask that exchange's credential: production runs NATS over TLS (see
``broker_config``), which also stops a relay of the nonce.

The same construction, bound to a host-chosen timestamp and nonce instead of the
server's, lets ``Register`` prove possession of the credential without carrying
it (:func:`register_proof` / :func:`open_register_proof`), so the application
layer stays safe on a broker without these permissions.

Expiry: every user JWT the callout issues expires (:data:`DEFAULT_JWT_EXPIRES_S`,
less a random part of up to :data:`JWT_EXPIRY_JITTER` so that hosts connected
together do not all come back together). The server then ends the connection
("User Authentication Expired") and the client's reconnect goes through the
callout again, which re-reads the principal: a connection never outlives the
credential it proved by more than one expiry, whatever happened to the kick
below. Clients reconnect through an expiry with
:func:`fleetlease.transport.nats_connect.connect`.

Revocation: :meth:`BrokerAuthService.disconnect`, called once the revocation is
committed, asks every known server (``$SYS.REQ.SERVER.<id>.CONNZ``) for the
principal's connections and kicks them (``$SYS.REQ.SERVER.<id>.KICK``); their
reconnects come back through the callout, which refuses them. On a NATS
cluster the known servers are every member that sent an authorization request
and every member the system connection's server routes to (``ROUTEZ``), so a
connection is kicked whichever member it is on, also one authorized before
this process started; a member that no longer answers is skipped (its
connections died with it), one that is cut off but alive keeps them until
their JWT expires. A login racing
the revocation can have been approved from a read made just before the commit
while its connection still waits for the server to apply the approval: the
server lists such a connection without its name (2.15 shows a token user as
``[REDACTED]``) until the approval lands. Every connection that was waiting in
the snapshot is therefore watched (CONNZ by ``cid``) until the server has
decided it (it does within its authorization timeout: approved, refused or timed
out), and kicked if it turns out to be the principal's. A connection that was
not yet waiting in the snapshot sends its authorization request after the
commit, so the callout's read refuses it. No survivor is left to chance.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import nacl.exceptions
import nacl.signing
import nkeys
import structlog
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from fleetlease.persistence.credentials import SqlCredentialStore as SqlCredentialStore
from fleetlease.persistence.secrets import hash_secret
from fleetlease.transport.nats_connect import KEEPALIVE, server_list
from fleetlease.transport.subjects import Subjects, is_valid_token

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient
    from nats.aio.msg import Msg

log = structlog.get_logger("fleetlease.broker_auth")

AUTH_CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"
AUTH_QUEUE = "fleetlease-auth"
#: The account every fleet principal and the control plane live in.
FLEET_ACCOUNT = "FLEET"
AUTH_ACCOUNT = "AUTH"
SYS_ACCOUNT = "SYS"

CLIENT_KEY_LEN = 64
_CONNECT_DOMAIN = b"fleetlease-connect-v1\0"
_REGISTER_DOMAIN = b"fleetlease-register-v1\0"
_JWT_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
#: The one message every refusal gets: unknown, revoked and wrong proof look alike.
REFUSED = "authentication failed"
#: How long an issued user JWT lives by default (seconds): the longest a
#: connection can outlive its principal's revocation if the kick fails.
DEFAULT_JWT_EXPIRES_S = 300.0
#: Up to this fraction of the lifetime is taken off at random per JWT.
JWT_EXPIRY_JITTER = 0.2
#: The nats-server's ``authorization { timeout }`` (seconds) of the generated
#: config: how long the server waits for the callout's answer.
DEFAULT_CALLOUT_TIMEOUT_S = 5.0
#: Beyond the server's own callout timeout, how long a revocation keeps
#: watching a connection that was waiting for its authorization.
_UNDECIDED_GRACE_S = 2.0
_UNDECIDED_POLL_S = 0.02
#: How many connections the callout service subscribes through, each to a
#: different member of a NATS cluster when several are listed: with one on
#: each of three members, every member answers logins locally and the loss of
#: any one leaves the others theirs.
DEFAULT_CALLOUT_CONNECTIONS = 3
#: One CONNZ page large enough for every connection: one consistent snapshot
#: (offset paging would skip entries when earlier connections close between pages).
_CONNZ_LIMIT = 1 << 24

#: Per-role limits of one connection (``payload``: largest message it may
#: publish, bytes; ``subs``: subscriptions it may hold), written into the user
#: JWT the callout issues. nats-server 2.15 applies only the permissions of a
#: callout-issued user, not these limits, so the control plane enforces the
#: payload limit itself (``transport.server`` ``max_request_bytes``: a larger
#: request is refused undecoded). Hosts send heartbeats of up to 1,024 devices
#: and artifact chunks (``wire.MAX_MESSAGE_SIZE``); no ops request needs more
#: than a task payload (256 KiB of JSON) and its envelope.
ROLE_LIMITS: dict[str, dict[str, int]] = {
    "host": {"payload": 1024 * 1024, "subs": 256},
    "user": {"payload": 512 * 1024, "subs": 256},
}

Kind = Literal["host", "user"]


class BrokerAuthError(Exception):
    """A malformed key, JWT or proof."""


# -- nkeys ---------------------------------------------------------------------


def _b32decode(text: str) -> bytes:
    pad = "=" * (-len(text) % 8)
    try:
        return base64.b32decode(text + pad)
    except (ValueError, TypeError) as exc:
        raise BrokerAuthError("bad nkey encoding") from exc


def _b32encode(data: bytes) -> str:
    return base64.b32encode(data).decode("ascii").rstrip("=")


def _crc(data: bytes) -> bytes:
    crc = nkeys.crc16(bytearray(data))
    return bytes([crc & 0xFF, crc >> 8])


def public_key_raw(public: str) -> bytes:
    """The 32 raw Ed25519 bytes of an encoded public nkey (``U...``, ``A...``,
    ``N...``), checksum verified."""
    raw = _b32decode(public)
    if len(raw) != 35 or not nkeys.valid_public_prefix_byte(raw[0]):
        raise BrokerAuthError("not a public nkey")
    if _crc(raw[:-2]) != raw[-2:]:
        raise BrokerAuthError("bad nkey checksum")
    return raw[1:33]


def encode_public(prefix: int, raw: bytes) -> str:
    body = bytes([prefix]) + raw
    return _b32encode(body + _crc(body))


def seed_from_raw(prefix: int, raw: bytes) -> str:
    """An encoded nkey seed (``SU...``, ``SA...``) from 32 raw bytes."""
    if len(raw) != 32:
        raise BrokerAuthError("an nkey seed is 32 bytes")
    return bytes(nkeys.encode_seed(bytearray(raw), prefix)).decode("ascii")


def new_seed(prefix: int) -> str:
    """A fresh random nkey seed of the given kind (``nkeys.PREFIX_BYTE_*``)."""
    import secrets

    return seed_from_raw(prefix, secrets.token_bytes(32))


def public_key(seed: str) -> str:
    kp = nkeys.from_seed(bytearray(seed.encode("ascii")))
    return bytes(kp.public_key).decode("ascii")


def verify_signature(public: str, data: bytes, signature: bytes) -> bool:
    try:
        nacl.signing.VerifyKey(public_key_raw(public)).verify(data, signature)
    except (nacl.exceptions.BadSignatureError, BrokerAuthError, ValueError):
        return False
    return True


# -- JWTs ----------------------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64url(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as exc:
        raise BrokerAuthError("bad base64url") from exc


def encode_jwt(claims: dict[str, Any], seed: str) -> str:
    """A NATS JWT (``ed25519-nkey``) of ``claims`` signed with ``seed``; sets
    ``iss``, ``iat`` and ``jti``."""
    kp = nkeys.from_seed(bytearray(seed.encode("ascii")))
    body = dict(claims)
    body["iss"] = bytes(kp.public_key).decode("ascii")
    body.setdefault("iat", int(time.time()))
    body.pop("jti", None)
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()
    body["jti"] = _b32encode(digest)
    head = _b64url(json.dumps(_JWT_HEADER, separators=(",", ":")).encode())
    payload = _b64url(json.dumps(body, separators=(",", ":")).encode())
    signing_input = f"{head}.{payload}".encode("ascii")
    return f"{head}.{payload}.{_b64url(bytes(kp.sign(signing_input)))}"


def decode_jwt(token: str) -> dict[str, Any]:
    """The claims of a NATS JWT whose signature verifies against its own ``iss``
    (callers then check that ``iss`` is a key they trust)."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise BrokerAuthError("not a JWT")
    try:
        header = json.loads(_unb64url(parts[0]))
        claims = json.loads(_unb64url(parts[1]))
    except ValueError as exc:
        raise BrokerAuthError("bad JWT json") from exc
    if not isinstance(header, dict) or header.get("alg") not in ("ed25519-nkey", "ed25519"):
        raise BrokerAuthError("unsupported JWT algorithm")
    if not isinstance(claims, dict) or not isinstance(claims.get("iss"), str):
        raise BrokerAuthError("JWT without issuer")
    signing_input = f"{parts[0]}.{parts[1]}".encode("ascii")
    if not verify_signature(claims["iss"], signing_input, _unb64url(parts[2])):
        raise BrokerAuthError("bad JWT signature")
    return claims


# -- proofs of possession ---------------------------------------------------------


def _client_key(secret: str) -> bytes:
    raw = secret.encode("utf-8")
    if len(raw) != CLIENT_KEY_LEN:
        raise BrokerAuthError(f"a credential or token is {CLIENT_KEY_LEN} characters")
    return raw


def _mask(stored_hash: bytes, domain: bytes, *parts: bytes) -> bytes:
    return hmac.new(stored_hash, domain + b"\0".join(parts), hashlib.sha512).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def connect_proof(secret: str, identity: str, nonce: str) -> bytes:
    """The CONNECT ``sig`` (base64url bytes) proving possession of ``secret`` for
    ``identity`` (``host:X`` / ``user:U``) against the server's ``nonce``."""
    key = _client_key(secret)
    mask = _mask(hash_secret(secret), _CONNECT_DOMAIN, identity.encode(), nonce.encode())
    return _b64url(_xor(key, mask)).encode("ascii")


def check_connect_proof(stored_hash: bytes, identity: str, nonce: str, proof: str) -> bool:
    """Whether ``proof`` shows possession of the secret hashing to ``stored_hash``.
    Constant-time in the comparison that matters."""
    try:
        raw = _unb64url(proof)
    except BrokerAuthError:
        return False
    if len(raw) != CLIENT_KEY_LEN or len(stored_hash) != hashlib.sha256().digest_size:
        return False
    mask = _mask(stored_hash, _CONNECT_DOMAIN, identity.encode(), nonce.encode())
    candidate = hashlib.sha256(_xor(raw, mask)).digest()
    return hmac.compare_digest(candidate, stored_hash)


def register_proof(credential: str, host_id: str, ts_ms: int, nonce: bytes) -> bytes:
    """What a ``Register`` carries instead of the credential: the credential masked
    with a key only the holder of its hash can derive, bound to the host, a
    timestamp and a fresh nonce (64 bytes)."""
    key = _client_key(credential)
    mask = _mask(
        hash_secret(credential),
        _REGISTER_DOMAIN,
        host_id.encode(),
        str(ts_ms).encode(),
        nonce,
    )
    return _xor(key, mask)


def open_register_proof(
    stored_hash: bytes, host_id: str, ts_ms: int, nonce: bytes, proof: bytes
) -> str | None:
    """The credential inside a register proof, or None if it does not hash to
    ``stored_hash`` (compared in constant time). The caller checks ``ts_ms`` is
    fresh and the nonce unseen, then hands the credential to
    ``Repository.register_session`` unchanged."""
    if len(proof) != CLIENT_KEY_LEN or len(stored_hash) != hashlib.sha256().digest_size:
        return None
    mask = _mask(stored_hash, _REGISTER_DOMAIN, host_id.encode(), str(ts_ms).encode(), nonce)
    candidate = _xor(proof, mask)
    if not hmac.compare_digest(hashlib.sha256(candidate).digest(), stored_hash):
        return None
    try:
        return candidate.decode("ascii")
    except UnicodeDecodeError:
        return None


# -- client side ----------------------------------------------------------------------


def identity(kind: Kind, name: str) -> str:
    if kind not in ("host", "user"):
        raise ValueError(f"kind must be host or user, got {kind!r}")
    if not is_valid_token(name):
        raise ValueError(f"{kind} name must be a subject token, got {name!r}")
    return f"{kind}:{name}"


def _connect_options(ident: str, secret: str) -> dict[str, Any]:
    _client_key(secret)  # fail early on a malformed secret

    def sign(nonce: str) -> bytes:
        return connect_proof(secret, ident, nonce)

    # nats-py sends ``sig`` (from signature_cb over the INFO nonce) together with
    # ``auth_token`` when both are set; the token here is only the claimed identity.
    return {"token": ident, "signature_cb": sign}


def host_connect_options(host_id: str, credential: str) -> dict[str, Any]:
    """``connect_options`` for ``HostClient`` on a secured broker."""
    return _connect_options(identity("host", host_id), credential)


def user_connect_options(user: str, token: str, subjects: Subjects | None = None) -> dict[str, Any]:
    """``nats.connect`` options for an ops user on a secured broker (with the
    user's own inbox prefix, the only one it may subscribe to)."""
    opts = _connect_options(identity("user", user), token)
    opts["inbox_prefix"] = (subjects or Subjects()).ops_inbox_prefix(user).encode()
    return opts


# -- permissions ------------------------------------------------------------------------


def permissions(subjects: Subjects, kind: Kind, name: str) -> dict[str, Any]:
    """The pub/sub allow lists of a principal (everything else is denied)."""
    if kind == "host":
        pub = [f"{subjects.prefix}.host.{name}.>"]
        sub = [f"{subjects.host_inbox_prefix(name)}.>"]
    elif kind == "user":
        pub = [subjects.ops_user_wildcard(name)]
        sub = [f"{subjects.ops_inbox_prefix(name)}.>"]
    else:  # pragma: no cover - Kind is closed
        raise ValueError(kind)
    return {"pub": {"allow": pub}, "sub": {"allow": sub}}


def user_claims(
    subjects: Subjects, kind: Kind, name: str, user_nkey: str, *, expires_s: float | None
) -> dict[str, Any]:
    claims: dict[str, Any] = {
        "sub": user_nkey,
        "aud": FLEET_ACCOUNT,
        "name": identity(kind, name),
        "nats": {
            **permissions(subjects, kind, name),
            "subs": ROLE_LIMITS[kind]["subs"],
            "data": -1,
            "payload": ROLE_LIMITS[kind]["payload"],
            "type": "user",
            "version": 2,
        },
    }
    if expires_s is not None:
        # Rounded up: the lifetime is never shorter than asked.
        claims["exp"] = math.ceil(time.time() + expires_s)
    return claims


# -- credential lookup --------------------------------------------------------------------


class CredentialStore(Protocol):
    """Where the callout finds stored hashes. ``None``: unknown, or revoked."""

    async def host_hash(self, host_id: str) -> bytes | None: ...

    async def user_hash(self, user: str) -> bytes | None: ...


# -- the service ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    kind: Kind
    name: str


class BrokerAuthService:
    """The auth callout responder plus the revocation kicker.

    ``service_seed`` is the nkey of the callout service user (``AUTH`` account,
    exempt from the callout), ``issuer_seed`` the account nkey whose public key
    the server config names as the callout issuer, ``system_seed`` a ``SYS``
    account user for CONNZ/KICK (optional: without it :meth:`disconnect` is a
    no-op and revocation waits for the JWT expiry).

    ``jwt_expires_s``: lifetime of the issued user JWTs (``None``: they never
    expire; not advised, a missed kick would then last forever).
    ``callout_timeout_s``: the server's authorization timeout (the generated
    config's ``authorization { timeout }``), which bounds how long a revocation
    watches logins that were in flight.
    ``callout_connections``: on a NATS cluster (several URLs in ``nats_url``),
    how many members the callout subscribes through at once (each connection
    tries its own member first); the server hands each request to one of them.
    """

    def __init__(
        self,
        *,
        nats_url: str,
        store: CredentialStore,
        issuer_seed: str,
        service_seed: str,
        system_seed: str | None = None,
        subjects: Subjects | None = None,
        jwt_expires_s: float | None = DEFAULT_JWT_EXPIRES_S,
        callout_timeout_s: float = DEFAULT_CALLOUT_TIMEOUT_S,
        connect_options: dict[str, Any] | None = None,
        callout_connections: int = DEFAULT_CALLOUT_CONNECTIONS,
    ) -> None:
        if callout_connections < 1:
            raise ValueError(f"callout_connections must be >= 1, got {callout_connections!r}")
        if jwt_expires_s is not None and not (
            math.isfinite(jwt_expires_s) and jwt_expires_s >= 1.0
        ):
            raise ValueError(f"jwt_expires_s must be >= 1 second or None, got {jwt_expires_s!r}")
        if not (math.isfinite(callout_timeout_s) and callout_timeout_s > 0):
            raise ValueError(f"callout_timeout_s must be > 0, got {callout_timeout_s!r}")
        self.nats_url = nats_url
        self.store = store
        self.subjects = subjects or Subjects()
        self._issuer_seed = issuer_seed
        self.issuer = public_key(issuer_seed)
        self._service_seed = service_seed
        self._system_seed = system_seed
        self.jwt_expires_s = jwt_expires_s
        self.callout_timeout_s = callout_timeout_s
        self._connect_options = dict(connect_options or {})
        self.callout_connections = callout_connections
        self._callouts: list[NatsClient] = []
        self._sys: NatsClient | None = None
        self._server_ids: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.granted = 0
        self.refused = 0

    async def _connect(
        self, seed: str, name: str, servers: str | list[str], **extra: Any
    ) -> NatsClient:
        import nats

        async def on_error(exc: Exception) -> None:
            log.warning("broker_auth_nats_error", conn=name, error=str(exc) or type(exc).__name__)

        opts: dict[str, Any] = {
            "name": name,
            "nkeys_seed_str": seed,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "error_cb": on_error,
            **KEEPALIVE,
        }
        opts.update(extra)
        opts.update(self._connect_options)
        return await nats.connect(servers, **opts)

    def _callout_servers(self) -> list[str | list[str]]:
        """The server list of each callout connection: one per listed cluster
        member, up to :attr:`callout_connections`, each trying its own member
        first (the others after it, in order), so that the loss of one member
        leaves the callout subscribed through another."""
        servers = server_list(self.nats_url)
        if isinstance(servers, str):
            return [servers]
        count = max(1, min(self.callout_connections, len(servers)))
        return [servers[i:] + servers[:i] for i in range(count)]

    async def start(self) -> BrokerAuthService:
        try:
            lists = self._callout_servers()
            for i, servers in enumerate(lists):
                suffix = f"-{i + 1}" if len(lists) > 1 else ""
                opts = {"dont_randomize": True} if isinstance(servers, list) else {}
                nc = await self._connect(
                    self._service_seed, f"fleetlease-auth-callout{suffix}", servers, **opts
                )
                self._callouts.append(nc)
                await nc.subscribe(AUTH_CALLOUT_SUBJECT, queue=AUTH_QUEUE, cb=self._on_request)
                await nc.flush()
            if self._system_seed is not None:
                self._sys = await self._connect(
                    self._system_seed, "fleetlease-auth-system", server_list(self.nats_url)
                )
                server_id = self._sys._server_info.get("server_id")
                if isinstance(server_id, str):
                    self._server_ids.add(server_id)
        except BaseException:
            await self.stop()
            raise
        log.info("broker_auth_started", issuer=self.issuer, callout_connections=len(self._callouts))
        return self

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for nc in (*self._callouts, self._sys):
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.drain()
        self._callouts = []
        self._sys = None

    async def __aenter__(self) -> BrokerAuthService:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- callout ---------------------------------------------------------------
    async def _on_request(self, msg: Msg) -> None:
        # One task per request: a slow database lookup never holds up the others.
        task = asyncio.create_task(self._answer(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Msg) -> None:
        try:
            request = decode_jwt(msg.data.decode("ascii"))
        except (BrokerAuthError, UnicodeDecodeError):
            log.warning("broker_auth_bad_request")
            return  # not from a server: no reply, the connect times out
        nats_claims = request.get("nats")
        if not isinstance(nats_claims, dict):
            return
        server = nats_claims.get("server_id") or {}
        server_id = server.get("id") if isinstance(server, dict) else None
        user_nkey = nats_claims.get("user_nkey")
        if (
            not isinstance(server_id, str)
            or server_id != request.get("iss")
            or not isinstance(user_nkey, str)
        ):
            log.warning("broker_auth_bad_request")
            return
        self._server_ids.add(server_id)
        response: dict[str, Any] = {
            "sub": user_nkey,
            "aud": server_id,
            "nats": {"type": "authorization_response", "version": 2},
        }
        try:
            decision = await self.authorize(nats_claims)
        except Exception:
            log.exception("broker_auth_failed")
            decision = None
        if decision is None:
            self.refused += 1
            response["nats"]["error"] = REFUSED
        else:
            self.granted += 1
            response["nats"]["jwt"] = encode_jwt(
                user_claims(
                    self.subjects,
                    decision.kind,
                    decision.name,
                    user_nkey,
                    expires_s=self._jwt_lifetime(),
                ),
                self._issuer_seed,
            )
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(encode_jwt(response, self._issuer_seed).encode("ascii"))

    def _jwt_lifetime(self) -> float | None:
        if self.jwt_expires_s is None:
            return None
        return max(1.0, self.jwt_expires_s * (1.0 - JWT_EXPIRY_JITTER * random.random()))

    async def authorize(self, nats_claims: dict[str, Any]) -> Decision | None:
        """The principal a connect request proves, or None."""
        opts = nats_claims.get("connect_opts") or {}
        client = nats_claims.get("client_info") or {}
        if not isinstance(opts, dict) or not isinstance(client, dict):
            return None
        ident = opts.get("auth_token")
        proof = opts.get("sig")
        nonce = client.get("nonce")
        if not (isinstance(ident, str) and isinstance(proof, str) and isinstance(nonce, str)):
            return None
        if not nonce:
            return None
        kind, _, name = ident.partition(":")
        if kind not in ("host", "user") or not is_valid_token(name):
            return None
        if kind == "host":
            stored = await self.store.host_hash(name)
        else:
            stored = await self.store.user_hash(name)
        if stored is None:
            return None
        if not check_connect_proof(stored, ident, nonce, proof):
            return None
        return Decision(kind="host" if kind == "host" else "user", name=name)

    # -- revocation ------------------------------------------------------------------
    async def disconnect(self, kind: Kind, name: str, timeout_s: float = 5.0) -> int:
        """Kick every connection of a principal on every server this service
        knows (asked in parallel), including logins that were being approved
        while the revocation committed (see the module docstring); returns how
        many were kicked. Call it after the revocation is durable, so that the
        reconnects are refused. Returns once no connection of the principal can
        remain on a server that answers, at most the server's callout timeout
        plus a grace later (in practice milliseconds)."""
        if self._sys is None:
            return 0
        wanted = identity(kind, name)
        started = time.monotonic()
        servers = await self._known_servers(timeout_s)
        kicked = sum(
            await asyncio.gather(*(self._disconnect_from(s, wanted, timeout_s) for s in servers))
        )
        log.info(
            "broker_disconnected",
            principal=wanted,
            connections=kicked,
            ms=round((time.monotonic() - started) * 1000),
        )
        return kicked

    async def _disconnect_from(self, server_id: str, wanted: str, timeout_s: float) -> int:
        """:meth:`_disconnect_on` one server, which may have died or be cut off."""
        try:
            return await self._disconnect_on(server_id, wanted, timeout_s)
        except NoRespondersError:
            # The member is gone (nothing answers for it any more): so are its
            # connections. A member that comes back has a new id.
            self._server_ids.discard(server_id)
            log.info("broker_server_gone", server_id=server_id)
        except (TimeoutError, NatsError, BrokerAuthError) as exc:
            # Unreachable but maybe alive (a partition): its connections of the
            # principal end at their JWT's expiry at the latest.
            log.warning(
                "broker_disconnect_incomplete",
                server_id=server_id,
                principal=wanted,
                error=str(exc) or type(exc).__name__,
            )
        return 0

    async def _known_servers(self, timeout_s: float) -> list[str]:
        """Every server that may hold a connection of the fleet: those that
        asked the callout, the one the system connection is on now and, on a
        cluster, every member that one routes to (connections authorized
        before this process started live there too)."""
        assert self._sys is not None
        here = self._sys._server_info.get("server_id")
        if isinstance(here, str):
            self._server_ids.add(here)
            try:
                reply = await self._sys.request(
                    f"$SYS.REQ.SERVER.{here}.ROUTEZ", b"{}", timeout=timeout_s
                )
                routes = (json.loads(reply.data or b"{}").get("data") or {}).get("routes") or []
            except (TimeoutError, NatsError, ValueError) as exc:
                log.warning("broker_routez_failed", error=str(exc) or type(exc).__name__)
                routes = []
            for route in routes:
                remote = route.get("remote_id") if isinstance(route, dict) else None
                if isinstance(remote, str) and remote:
                    self._server_ids.add(remote)
        return sorted(self._server_ids)

    async def disconnect_host(self, host_id: str, timeout_s: float = 5.0) -> int:
        return await self.disconnect("host", host_id, timeout_s)

    async def _disconnect_on(self, server_id: str, wanted: str, timeout_s: float) -> int:
        named: list[int] = []
        undecided: set[int] = set()
        for conn in await self._connz(server_id, {"limit": _CONNZ_LIMIT}, timeout_s):
            cid = conn.get("cid")
            if not isinstance(cid, int):
                continue
            user = conn.get("authorized_user")
            if user == wanted:
                named.append(cid)
            elif _undecided(user):
                undecided.add(cid)
        kicked = sum(
            await asyncio.gather(*(self._kick(server_id, cid, timeout_s) for cid in named))
        )
        if undecided:
            log.info("broker_undecided_watched", principal=wanted, connections=len(undecided))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.callout_timeout_s + _UNDECIDED_GRACE_S
        while undecided:
            cids = sorted(undecided)
            found = await asyncio.gather(
                *(self._connz(server_id, {"cid": cid}, timeout_s) for cid in cids)
            )
            for cid, conns in zip(cids, found, strict=True):
                user = conns[0].get("authorized_user") if conns else None
                if not conns or not _undecided(user):
                    undecided.discard(cid)
                if user == wanted:
                    kicked += await self._kick(server_id, cid, timeout_s)
            if undecided and loop.time() >= deadline:
                # Past the server's own deadline a connection still waiting for
                # its authorization is none that the callout vouched for.
                log.warning("broker_undecided_kicked", connections=len(undecided))
                for cid in sorted(undecided):
                    await self._kick(server_id, cid, timeout_s)
                break
            if undecided:
                await asyncio.sleep(_UNDECIDED_POLL_S)
        return kicked

    async def _kick(self, server_id: str, cid: int, timeout_s: float) -> int:
        assert self._sys is not None
        reply = await self._sys.request(
            f"$SYS.REQ.SERVER.{server_id}.KICK",
            json.dumps({"cid": cid}).encode(),
            timeout=timeout_s,
        )
        answer = json.loads(reply.data or b"{}")
        if answer.get("error"):
            # Typically "no such client": it closed on its own meanwhile.
            log.info("broker_kick_missed", cid=cid, error=answer["error"])
            return 0
        return 1

    async def _connz(
        self, server_id: str, options: dict[str, Any], timeout_s: float
    ) -> list[dict[str, Any]]:
        assert self._sys is not None
        reply = await self._sys.request(
            f"$SYS.REQ.SERVER.{server_id}.CONNZ",
            json.dumps({"auth": True, **options}).encode(),
            timeout=timeout_s,
        )
        answer = json.loads(reply.data or b"{}")
        if answer.get("error"):
            raise BrokerAuthError(f"CONNZ of server {server_id} failed: {answer['error']}")
        data = answer.get("data") or {}
        return [c for c in data.get("connections") or [] if isinstance(c, dict)]


def _undecided(user: Any) -> bool:
    """Whether a CONNZ ``authorized_user`` is that of a connection still waiting
    for the callout's answer: it has sent CONNECT (the name is not empty) but
    is neither a principal the callout named (``host:X`` / ``user:U``) nor one
    of the control plane's nkey users (which bypass the callout)."""
    if not isinstance(user, str) or not user:
        return False
    kind, sep, name = user.partition(":")
    if sep and kind in ("host", "user") and is_valid_token(name):
        return False
    try:
        public_key_raw(user)
    except BrokerAuthError:
        return True
    return False


#: An async hook the ops side can call after ``Repository.revoke_host``.
DisconnectHook = Callable[[str], Awaitable[int]]
