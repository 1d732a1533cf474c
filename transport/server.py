"""The control plane's NATS side: one connection, subscription (queue group),
pending limit and worker pool per channel (control, jobs, logs, artifacts, ops),
so that a stuck log or artifact transfer never delays a heartbeat, a claim or a
result.

Every request goes through the same gate, in this order, and is refused at the
first check it fails (typed ``Error{code, message}`` reply, nothing read or
written past that point):

0. the reply subject lies inside the inbox of the principal the subject names
   (``Subjects.reply_allowed``); otherwise there is no reply at all, only a
   ``reply_subject_refused`` warning, since the reply subject is the sender's
   choice and the control plane must never publish elsewhere on its behalf;
1. the subject parses as one of ours and names a known verb (``bad_request``);
2. the bytes decode as exactly one envelope of the verb's message type, within
   the size and field limits, with no NUL characters in text bound for
   PostgreSQL (``bad_request``);
3. Register aside, the message is signed and the signing host is the host the
   subject names (``unauthorized`` / ``forbidden``: host A's session can never
   act for host B, and nothing of B is read before this check);
4. the signature, its timestamp and its nonce verify against the session key of
   the presented generation, without touching the database (``unauthorized``);
5. the presented generation is the host's current one (``unauthorized``); a
   per-process cache answers the common case, the database the rest, and the
   repository re-checks it inside every transaction anyway (so the cache can be
   stale in one direction only: towards asking the repository, which refuses).

Only then is the request handed to the actor system (``actors.runtime.ControlPlane``)
or, for logs and artifacts, to the repository and the JetStream object store.

Artifacts: chunks are staged in a JetStream stream of their own
(``transport.staging``: one subject per host, attempt, artifact and offset, and
the limits on it), so any ``fleetlease serve`` process of a queue group can take
any chunk and any of them can take the commit. A chunk or commit is taken only
for a lease the host holds now, fenced as a renewal is
(``Repository.check_holds``); an attempt's staged chunks are purged when it
ends. The commit reassembles the chunks in offset order, checks size and
SHA-256, stores the object under a content-addressed name in the object store,
and only then records it through the repository. A mismatch is a ``conflict``
and nothing is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import IO, TYPE_CHECKING, Any, Protocol, cast

import msgpack
import nats
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import NotFoundError

from fleetlease.ops.observe import metrics
from fleetlease.persistence.clock import Clock, SystemClock
from fleetlease.persistence.errors import (
    Conflict,
    Invalid,
    RepositoryError,
    Unauthorized,
    Unavailable,
)
from fleetlease.persistence.model import DeviceSnapshot, JournalEntry, LeaseTimings, Session
from fleetlease.transport import wire
from fleetlease.transport.auth import AuthError, Verifier, session_key
from fleetlease.transport.broker_auth import open_register_proof
from fleetlease.transport.staging import Staging, StagingLimits
from fleetlease.transport.subjects import IDENTIFY_VERB, Channel, Subjects, queue_group

if TYPE_CHECKING:
    from fleetlease.persistence.repository import Repository

log = structlog.get_logger("fleetlease.server")

#: Which message type each host verb accepts.
HOST_VERBS: dict[tuple[Channel, str], type[wire.Message]] = {
    (Channel.CONTROL, "register"): wire.Register,
    (Channel.CONTROL, "heartbeat"): wire.Heartbeat,
    (Channel.CONTROL, "reconcile"): wire.Reconcile,
    (Channel.JOBS, "claim"): wire.Claim,
    (Channel.JOBS, "ack"): wire.Ack,
    (Channel.JOBS, "renew"): wire.Renew,
    (Channel.JOBS, "progress"): wire.Progress,
    (Channel.JOBS, "result"): wire.Result,
    (Channel.JOBS, "cancel_poll"): wire.CancelPoll,
    (Channel.LOGS, "append"): wire.LogAppend,
    (Channel.ARTIFACTS, "chunk"): wire.ArtifactChunk,
    (Channel.ARTIFACTS, "commit"): wire.ArtifactCommit,
}

ARTIFACT_BUCKET = "fleetlease-artifacts"
#: Task states in which an attempt still holds its lease (staging is kept).
_HELD_STATES = frozenset({"assigned", "dispatched", "running"})
_INT64_MAX = 2**63 - 1
#: What an unknown host's register proof is checked against (never matches).
_DUMMY_HASH = hashlib.sha256(b"fleetlease: no such host").digest()


class ControlPlaneLike(Protocol):
    """What the server needs of ``actors.runtime.ControlPlane``. Every method
    raises a ``RepositoryError`` (typed reply) on refusal."""

    async def register(self, host_id: str, credential: str) -> Session: ...

    async def heartbeat(self, session: Session, devices: list[DeviceSnapshot]) -> Any: ...

    async def reconcile(self, session: Session, entries: list[JournalEntry]) -> Any: ...

    async def claim(
        self, session: Session, *, wait_s: float, device_ids: list[str] | tuple[str, ...] = ()
    ) -> Any: ...

    async def ack(self, session: Session, task_id: str, attempt: int, lease_token: str) -> Any: ...

    async def renew(
        self, session: Session, task_id: str, attempt: int, lease_token: str
    ) -> Any: ...

    async def progress(
        self, session: Session, task_id: str, attempt: int, lease_token: str, seq: int
    ) -> Any: ...

    async def report_result(
        self, session: Session, task_id: str, attempt: int, lease_token: str, **kw: Any
    ) -> Any: ...

    async def cancel_poll(
        self, session: Session, task_id: str, attempt: int, lease_token: str
    ) -> Any: ...

    def add_listener(self, listener: Callable[[Any], None]) -> Any: ...

    def wake_hosts(self, hosts: list[str]) -> None: ...


class OpsHandler(Protocol):
    """The user API behind the ops subjects (``ops/api.py``). ``handle`` returns
    any msgpack-able value or raises a ``RepositoryError`` (typed reply)."""

    async def handle(
        self, verb: str, token: str, args: dict[str, Any], *, user: str | None
    ) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class ChannelConfig:
    """Limits of one channel. ``long_poll`` (jobs, ops) is a second pool for
    claims and ops ``events`` polls, which park until something happens: a host
    fleet long-polling can never take the workers that renewals and results
    need. A long-poll that finds no slot free is answered at once (no waiting)
    from the normal pool."""

    workers: int
    long_poll: int = 0
    pending_msgs: int = 65536
    pending_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers!r}")
        if self.long_poll < 0:
            raise ValueError(f"long_poll must not be negative, got {self.long_poll!r}")


DEFAULT_CHANNELS: dict[Channel, ChannelConfig] = {
    Channel.CONTROL: ChannelConfig(workers=64),
    Channel.JOBS: ChannelConfig(workers=256, long_poll=4096),
    Channel.LOGS: ChannelConfig(workers=16),
    Channel.ARTIFACTS: ChannelConfig(workers=8),
    # long_poll: the ops `events` long-polls of live views (watch, web console).
    Channel.OPS: ChannelConfig(workers=64, long_poll=1024),
}


@dataclass
class _ChannelState:
    channel: Channel
    config: ChannelConfig
    nc: NatsClient | None = None
    sub: Subscription | None = None
    sem: asyncio.Semaphore | None = None
    poll_sem: asyncio.Semaphore | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    #: Tests close this gate to stall a channel on purpose.
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    received: int = 0
    handled: int = 0


Handler = Callable[[Msg, bool], Awaitable[bytes]]


def _error(code: str, message: str) -> bytes:
    if code not in wire.ERROR_CODES:
        code = "internal"
    return wire.error_reply(code, message[: wire.MAX_TEXT_LEN])


def _reject_nul(root: object, name: str) -> None:
    """PostgreSQL text and JSONB cannot hold U+0000: refuse it at the edge
    (``bad_request``) rather than as a driver error deep in a transaction."""
    stack: list[object] = [root]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                raise wire.DecodeError("nul_character", f"{name} contains a NUL character")
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


#: Host messages of exactly (task_id, attempt, lease_token).
_LEASE_MESSAGES: frozenset[type[wire.Message]] = frozenset({wire.Ack, wire.Renew, wire.CancelPoll})


class Server:
    """Serves one control plane on NATS. Several ``Server`` processes may share one
    NATS and one PostgreSQL: every subscription is in a queue group and no state a
    request depends on lives only in one process."""

    def __init__(
        self,
        *,
        nats_url: str,
        control_plane: ControlPlaneLike,
        repo: Repository,
        server_secret: bytes,
        subjects: Subjects | None = None,
        ops: OpsHandler | None = None,
        timings: LeaseTimings | None = None,
        heartbeat_s: float = 5.0,
        channels: Mapping[Channel, ChannelConfig] | None = None,
        connect_options: dict[str, Any] | None = None,
        storage_connect_options: dict[str, Any] | None = None,
        replay_window_s: float | None = None,
        auth_clock: Clock | None = None,
        staging: StagingLimits | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.cp = control_plane
        self.repo = repo
        self._secret = server_secret
        self.subjects = subjects or Subjects()
        self.ops = ops
        self.timings = timings or repo.timings
        self.heartbeat_s = heartbeat_s
        verifier_opts: dict[str, Any] = {}
        if replay_window_s is not None:
            verifier_opts["window_s"] = replay_window_s
        # Message freshness is judged by wall time, as hosts sign: the repository's
        # clock may be a test's ManualClock jumping ahead to expire leases, which
        # must not make every signature look stale.
        self.verifier = Verifier(
            server_secret, auth_clock or SystemClock(), subjects=self.subjects, **verifier_opts
        )
        self._connect_options = dict(connect_options or {})
        # JetStream (staging, object store) goes through a connection of its own
        # that never answers a client: on a secured broker the serving
        # connections may publish only replies and the control plane's own
        # subjects (``transport/broker_config.py``).
        self._storage_connect_options = dict(
            self._connect_options if storage_connect_options is None else storage_connect_options
        )
        self._storage_nc: NatsClient | None = None
        cfg = dict(DEFAULT_CHANNELS)
        cfg.update(channels or {})
        self._channels = {ch: _ChannelState(ch, cfg[ch]) for ch in Channel}
        self._generations: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._js_lock = asyncio.Lock()
        self._object_store: Any = None
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fleetlease-artifact-io")
        self._events_nc: NatsClient | None = None
        self._stopping = False
        self._stopped = False
        self._started = False
        prefix_id = self.subjects.prefix.replace(".", "-")
        self.artifact_bucket = f"{ARTIFACT_BUCKET}-{prefix_id}"
        self.staging_stream = f"FLEETLEASE_UPLOADS_{prefix_id}"
        #: Artifact staging and its limits (``transport.staging``).
        self.staging = Staging(
            self._js,
            stream=self.staging_stream,
            root=f"{self.subjects.prefix}._uploads",
            limits=staging or StagingLimits(),
        )
        self._ended: set[tuple[str, str, int]] = set()
        self._purging = False
        #: Cross-process long-poll wakeups (see ``_on_event``).
        self._wake_subject = f"{self.subjects.prefix}._wake"
        self._instance = os.urandom(8)
        self._wake_pending: set[str] = set()
        self._events_pending: list[Any] = []
        self._wake_sub: Subscription | None = None

    # --- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        handlers: dict[Channel, tuple[str, Handler]] = {
            Channel.CONTROL: (self.subjects.control_wildcard(), self._host_message),
            Channel.JOBS: (self.subjects.jobs_wildcard(), self._host_message),
            Channel.LOGS: (self.subjects.logs_wildcard(), self._host_message),
            Channel.ARTIFACTS: (self.subjects.artifacts_wildcard(), self._host_message),
            Channel.OPS: (self.subjects.ops_wildcard(), self._ops_message),
        }
        try:
            for channel, (subject, handler) in handlers.items():
                state = self._channels[channel]
                state.gate.set()
                state.sem = asyncio.Semaphore(state.config.workers)
                if state.config.long_poll:
                    state.poll_sem = asyncio.Semaphore(state.config.long_poll)
                state.nc = await self._connect(f"fleetlease-server-{channel.value}")
                state.sub = await state.nc.subscribe(
                    subject,
                    queue=queue_group(channel),
                    cb=self._dispatcher(state, handler),
                    pending_msgs_limit=state.config.pending_msgs,
                    pending_bytes_limit=state.config.pending_bytes,
                )
            for state in self._channels.values():
                # The subscriptions are live on the server once this returns.
                assert state.nc is not None
                await state.nc.flush()
            self._storage_nc = await self._connect(
                "fleetlease-server-storage", self._storage_connect_options
            )
            self._events_nc = self._channels[Channel.OPS].nc
            jobs_nc = self._channels[Channel.JOBS].nc
            assert jobs_nc is not None
            # Every process hears every wake notice (no queue group).
            self._wake_sub = await jobs_nc.subscribe(self._wake_subject, cb=self._on_wake_notice)
            await jobs_nc.flush()
            self.cp.add_listener(self._on_event)
            self.cp.add_listener(self._on_attempt_event)
        except BaseException:
            await self.stop(grace_s=0)
            raise
        self._started = True
        log.info("server_started", prefix=self.subjects.prefix)

    async def _connect(self, name: str, options: dict[str, Any] | None = None) -> NatsClient:
        async def on_error(exc: Exception) -> None:
            log.warning("nats_error", connection=name, error=str(exc) or type(exc).__name__)
            metrics.nats_error(name, exc)

        async def on_disconnect() -> None:
            log.warning("nats_disconnected", connection=name)

        async def on_reconnect() -> None:
            log.info("nats_reconnected", connection=name)

        opts: dict[str, Any] = {
            "name": name,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "connect_timeout": 5,
            "allow_reconnect": True,
            "error_cb": on_error,
            "disconnected_cb": on_disconnect,
            "reconnected_cb": on_reconnect,
        }
        opts.update(self._connect_options if options is None else options)
        return await nats.connect(self.nats_url, **opts)

    async def drain(self, grace_s: float = 10.0) -> None:
        """Stop taking new requests: NATS stops routing to this process (the
        queue group's other members get them) and what already reached it is
        still dispatched (drain, not unsubscribe: nothing is dropped). Claims
        from now on do not wait. Idempotent; ``stop`` calls it."""
        if self._stopping:
            return
        self._stopping = True
        self._events_nc = None
        for state in self._channels.values():
            state.gate.set()  # a stalled channel must not hold the shutdown
        drains = [
            self._drain(state.sub) for state in self._channels.values() if state.sub is not None
        ]
        if drains:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*drains, return_exceptions=True), timeout=max(grace_s, 1.0)
                )

    async def stop(self, grace_s: float = 10.0) -> None:
        """``drain``, then let the requests in flight finish and reply (up to
        ``grace_s``; the control plane's own stop releases parked long-polls),
        then close the connections. Idempotent."""
        if self._stopped:
            return
        await self.drain(grace_s)
        self._stopped = True
        pending = [t for s in self._channels.values() for t in s.tasks]
        if pending:
            _done, late = await asyncio.wait(pending, timeout=max(grace_s, 0.0))
            for t in late:
                t.cancel()
            if late:
                log.warning("server_stop_abandoned", requests=len(late))
                await asyncio.wait(late, timeout=1.0)
        for state in self._channels.values():
            if state.nc is not None:
                with contextlib.suppress(Exception):
                    await state.nc.flush(timeout=2)
                with contextlib.suppress(Exception):
                    await state.nc.close()
                state.nc = None
                state.sub = None
        if self._storage_nc is not None:
            with contextlib.suppress(Exception):
                await self._storage_nc.close()
            self._storage_nc = None
        self._io.shutdown(wait=False, cancel_futures=True)
        if self._started:
            log.info("server_stopped")

    @staticmethod
    async def _drain(sub: Subscription) -> None:
        with contextlib.suppress(Exception):
            await sub.drain()  # type: ignore[no-untyped-call]

    def stall(self, channel: Channel) -> None:
        """Hold every request of ``channel`` until ``unstall`` (fault tests). The
        held requests keep their workers, as a stuck handler would."""
        self._channels[Channel(channel)].gate.clear()

    def unstall(self, channel: Channel) -> None:
        self._channels[Channel(channel)].gate.set()

    def handled(self, channel: Channel) -> int:
        """Requests of ``channel`` answered so far."""
        return self._channels[Channel(channel)].handled

    def received(self, channel: Channel) -> int:
        """Requests of ``channel`` taken off NATS so far (answered or not)."""
        return self._channels[Channel(channel)].received

    def in_flight(self, channel: Channel) -> int:
        return len(self._channels[Channel(channel)].tasks)

    # --- dispatch ----------------------------------------------------------------
    def _dispatcher(
        self, state: _ChannelState, handler: Handler
    ) -> Callable[[Msg], Awaitable[None]]:
        async def on_message(msg: Msg) -> None:
            assert state.sem is not None
            state.received += 1
            sem = state.sem
            may_wait = False
            # Never block the subscription on the long-poll pool: with no slot
            # free, a claim is answered without waiting.
            if (
                state.poll_sem is not None
                and msg.subject.endswith((".claim", ".events"))
                and not state.poll_sem.locked()
            ):
                sem, may_wait = state.poll_sem, True
            await sem.acquire()
            try:
                task = asyncio.create_task(self._serve_one(state, handler, msg, sem, may_wait))
            except BaseException:
                sem.release()
                raise
            state.tasks.add(task)
            task.add_done_callback(state.tasks.discard)

        return on_message

    async def _serve_one(
        self,
        state: _ChannelState,
        handler: Handler,
        msg: Msg,
        sem: asyncio.Semaphore,
        may_wait: bool,
    ) -> None:
        try:
            await state.gate.wait()
            if msg.reply and not self.subjects.reply_allowed(msg.subject, msg.reply):
                # The reply subject is the sender's choice: answering outside its
                # own inbox would publish with the control plane's rights.
                inbox = self.subjects.reply_inbox(msg.subject)
                log.warning(
                    "reply_subject_refused",
                    principal=inbox.principal if inbox else None,
                    subject=msg.subject,
                    reply=msg.reply[:256],
                )
                metrics.request_error(msg.subject, "forbidden")  # refused, never answered
                return
            reply = await self._answer(handler, msg, may_wait)
            state.handled += 1
            if msg.reply:
                nc = state.nc
                if nc is not None and len(reply) > nc.max_payload:
                    log.error("reply_too_large", subject=msg.subject, size=len(reply))
                    reply = _error("internal", "reply too large")
                try:
                    await msg.respond(reply)
                except Exception as exc:
                    log.warning(
                        "reply_failed", subject=msg.subject, error=str(exc) or type(exc).__name__
                    )
        finally:
            sem.release()

    async def _answer(self, handler: Handler, msg: Msg, may_wait: bool) -> bytes:
        try:
            return await handler(msg, may_wait)
        except (wire.DecodeError, AuthError, RepositoryError) as exc:
            code = exc.code
            metrics.request_error(msg.subject, code)
            log.info(
                "request_refused",
                subject=msg.subject,
                code=code,
                reason=getattr(exc, "reason", None) or type(exc).__name__,
                error=exc.message,
            )
            return _error(code, exc.message)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler_failed", subject=msg.subject)
            metrics.request_error(msg.subject, "internal")
            return _error("internal", "internal error")

    # --- host messages -----------------------------------------------------------
    async def _host_message(self, msg: Msg, may_wait: bool) -> bytes:
        try:
            hs = self.subjects.parse_host_subject(msg.subject)
        except ValueError as exc:
            raise wire.DecodeError("bad_subject", str(exc)) from None
        expected = HOST_VERBS.get((hs.channel, hs.verb))
        if expected is None:
            raise wire.DecodeError("unknown_verb", f"unknown verb {hs.verb!r}")
        env = wire.decode(msg.data)
        if type(env.msg) is not expected:
            raise wire.DecodeError(
                "wrong_type", f"{hs.verb} expects {expected.TYPE}, got {env.msg.TYPE}", field="t"
            )
        m = self._sanitize(env.msg)
        if isinstance(m, wire.Register):
            return await self._register(hs.host_id, m)
        auth = env.auth
        if auth is None:
            raise AuthError("message is not signed", reason="unsigned")
        if auth.host_id != hs.host_id:
            # Host A's session acting for host B: refused before anything of B is read.
            raise AuthError(
                "session does not belong to this host", reason="host_mismatch", code="forbidden"
            )
        # Signature, freshness and replay first, against the presented
        # generation's key: unauthenticated traffic never reaches the database.
        self.verifier.verify_envelope(msg.subject, env, auth.generation, subject_host=hs.host_id)
        # Artifact chunks touch no repository transaction before the commit, so
        # they are checked against the database itself, not the cache.
        fresh = isinstance(m, wire.ArtifactChunk)
        await self._check_generation(hs.host_id, auth.generation, fresh=fresh)
        session = Session(host_id=hs.host_id, generation=auth.generation)
        try:
            return await self._host_verb(session, m, may_wait)
        except Unauthorized:
            # Revoked or superseded behind this process's back: forget the cache.
            self._generations.pop(hs.host_id, None)
            raise

    @staticmethod
    def _sanitize(m: wire.Message) -> wire.Message:
        """Edge checks wire.py leaves to the server: NUL characters, duplicate
        device ids, sequence overflow. Log lines get U+FFFD for NUL instead of a
        refusal: a program's output is not the host's to choose."""
        if isinstance(m, wire.LogAppend):
            if m.first_seq + max(len(m.lines) - 1, 0) > _INT64_MAX:
                raise wire.DecodeError(
                    "out_of_range", "first_seq + lines overflows", field="first_seq"
                )
            if any("\x00" in line for line in m.lines):
                m = replace(m, lines=[line.replace("\x00", "\ufffd") for line in m.lines])
            return m
        if type(m) in _LEASE_MESSAGES:
            # A canonical UUID, an int and the token: only the token can hold one
            # (the general walk below re-encoded the message first, for nothing).
            if "\x00" in m.lease_token:  # type: ignore[attr-defined]
                raise wire.DecodeError("nul_character", f"{m.TYPE} contains a NUL character")
            return m
        if isinstance(m, wire.ArtifactChunk):
            _reject_nul([m.name, m.lease_token], m.TYPE)
            return m
        if isinstance(m, wire.Heartbeat):
            seen: set[str] = set()
            for i, d in enumerate(m.devices):
                if d.device_id in seen:
                    raise wire.DecodeError(
                        "duplicate", f"devices[{i}].device_id is repeated", field="devices"
                    )
                seen.add(d.device_id)
        _reject_nul(m.to_body(), m.TYPE)
        return m

    async def _check_generation(self, host_id: str, presented: int, *, fresh: bool) -> None:
        cached = self._generations.get(host_id)
        if not fresh and cached is not None:
            if presented == cached:
                return
            if presented < cached:
                raise AuthError("session superseded; register again", reason="generation")
        current = await self.repo.current_generation(host_id)
        if current is None:
            self._generations.pop(host_id, None)
            raise AuthError("unknown or revoked host", reason="no_session")
        self._generations[host_id] = current
        if presented != current:
            raise AuthError("session superseded; register again", reason="generation")

    async def _register(self, host_id: str, m: wire.Register) -> bytes:
        if m.host_id != host_id:
            raise AuthError(
                "credentials are bound to another host", reason="host_mismatch", code="forbidden"
            )
        credential = m.credential
        if credential is None:
            credential = await self._open_register_proof(host_id, m)
        session = await self.cp.register(host_id, credential)
        self._generations[host_id] = session.generation
        key = session_key(self._secret, host_id, session.generation)
        log.info("host_registered", host_id=host_id, generation=session.generation)
        return wire.encode_reply(
            wire.RegisterOk(
                host_id=host_id,
                generation=session.generation,
                session_key=key,
                lease_s=self.timings.lease_s,
                heartbeat_s=self.heartbeat_s,
            )
        )

    async def _open_register_proof(self, host_id: str, m: wire.Register) -> str:
        """The credential inside a Register proof (issue 11: the credential never
        crosses the wire). Timestamp window first, then the stored hash (read
        only; an unknown or revoked host is checked against a dummy hash, so it
        costs the same), then the replay check. The repository re-checks the
        recovered credential in constant time in the registering transaction."""
        assert m.proof is not None and m.ts_ms is not None and m.nonce is not None
        self.verifier.check_register_fresh(m.ts_ms)
        stored = await self.repo.host_credential_hash(host_id)
        credential = open_register_proof(
            stored if stored is not None else _DUMMY_HASH, host_id, m.ts_ms, m.nonce, m.proof
        )
        if stored is None or credential is None:
            raise Unauthorized("invalid host credentials")
        self.verifier.remember_register(host_id, m.nonce, m.ts_ms)
        return credential

    async def _host_verb(self, s: Session, m: wire.Message, may_wait: bool) -> bytes:
        cp = self.cp
        if isinstance(m, wire.Heartbeat):
            await cp.heartbeat(
                s,
                [
                    DeviceSnapshot(
                        device_id=d.device_id, state=d.state, capabilities=d.capabilities
                    )
                    for d in m.devices
                ],
            )
            return wire.encode_reply(wire.Ok())
        if isinstance(m, wire.Reconcile):
            report = await cp.reconcile(
                s,
                [
                    JournalEntry(task_id=e.task_id, attempt=e.attempt, lease_token=e.lease_token)
                    for e in m.entries
                ],
            )
            self._purge_staged((e.host_id, e.task_id, e.attempt) for e in report.lost)
            return wire.encode_reply(
                wire.ReconcileResult(
                    generation=report.generation,
                    verdicts=[
                        wire.Verdict(
                            task_id=v.task_id,
                            attempt=v.attempt,
                            verdict=v.verdict,
                            reason=v.reason or "",
                            cancel_requested=bool(v.cancel_requested),
                            lease_expires_at=(
                                wire.to_unix(v.lease_expires_at) if v.lease_expires_at else None
                            ),
                        )
                        for v in report.verdicts
                    ],
                )
            )
        if isinstance(m, wire.Claim):
            wait_s = m.wait_s if may_wait and not self._stopping else 0.0
            claimed = await cp.claim(s, wait_s=wait_s, device_ids=list(m.devices))
            if claimed is None:
                return wire.encode_reply(wire.NoWork())
            return wire.encode_reply(
                wire.Assignment(
                    task_id=claimed.task_id,
                    attempt=claimed.attempt,
                    device_id=claimed.device_id,
                    lease_id=claimed.lease_id,
                    lease_token=claimed.lease_token,
                    kind=claimed.kind,
                    goal=claimed.goal,
                    workflow=claimed.workflow,
                    payload=claimed.payload,
                    ack_deadline=wire.to_unix(claimed.ack_deadline),
                    lease_s=claimed.lease_s,
                )
            )
        if isinstance(m, wire.Ack | wire.Renew | wire.Progress):
            if isinstance(m, wire.Ack):
                status = await cp.ack(s, m.task_id, m.attempt, m.lease_token)
            elif isinstance(m, wire.Renew):
                status = await cp.renew(s, m.task_id, m.attempt, m.lease_token)
            else:
                status = await cp.progress(s, m.task_id, m.attempt, m.lease_token, m.seq)
            return wire.encode_reply(
                wire.LeaseReply(
                    task_id=status.task_id,
                    attempt=status.attempt,
                    state=status.state,
                    lease_expires_at=wire.to_unix(status.lease_expires_at),
                    cancel_requested=status.cancel_requested,
                )
            )
        if isinstance(m, wire.Result):
            rec = await cp.report_result(
                s,
                m.task_id,
                m.attempt,
                m.lease_token,
                outcome=m.outcome,
                retryable=m.retryable,
                reason=m.reason,
                result=m.result,
                fingerprint=m.fingerprint,
            )
            return wire.encode_reply(
                wire.ResultReply(
                    task_id=rec.task_id,
                    attempt=rec.attempt,
                    state=rec.state,
                    outcome=rec.outcome,
                    fingerprint=rec.fingerprint,
                    replayed=rec.replayed,
                    retry_at=wire.to_unix(rec.retry_at) if rec.retry_at else None,
                )
            )
        if isinstance(m, wire.CancelPoll):
            status = await cp.cancel_poll(s, m.task_id, m.attempt, m.lease_token)
            return wire.encode_reply(
                wire.CancelStatus(
                    task_id=status.task_id,
                    attempt=status.attempt,
                    cancel_requested=status.cancel_requested,
                )
            )
        if isinstance(m, wire.LogAppend):
            await self.repo.append_logs(s, m.task_id, m.attempt, m.first_seq, m.lines)
            return wire.encode_reply(wire.Ok())
        if isinstance(m, wire.ArtifactChunk):
            await self._artifact_chunk(s, m)
            return wire.encode_reply(wire.Ok())
        if isinstance(m, wire.ArtifactCommit):
            with self.staging.host_slot(s.host_id):
                await self._artifact_commit(s, m)
            return wire.encode_reply(wire.Ok())
        raise wire.DecodeError("unknown_type", f"unexpected message {m.TYPE}")

    # --- artifacts -------------------------------------------------------------------
    @staticmethod
    def object_name(task_id: str, attempt: int, name: str, sha256: str) -> str:
        """Content-addressed within the attempt: writing it again can only ever
        write the same bytes, whoever writes it."""
        return f"{task_id}/{attempt}/{sha256}/{name}"

    async def _js(self) -> Any:
        nc = self._storage_nc
        if nc is None:
            raise Unavailable("the artifact store connection is closed")
        return nc.jetstream(timeout=10.0)

    async def _store(self) -> Any:
        if self._object_store is None:
            js = await self._js()
            async with self._js_lock:
                if self._object_store is None:
                    try:
                        self._object_store = await js.object_store(self.artifact_bucket)
                    except NotFoundError:
                        with contextlib.suppress(Exception):
                            await js.create_object_store(self.artifact_bucket)
                        self._object_store = await js.object_store(self.artifact_bucket)
        return self._object_store

    async def _artifact_chunk(self, s: Session, m: wire.ArtifactChunk) -> None:
        """Stage one chunk: only for a lease the host holds now (fenced as a
        renewal, nothing staged otherwise), within the staging limits."""
        with self.staging.host_slot(s.host_id):
            await self.repo.check_holds(s, m.task_id, m.attempt, m.lease_token)
            if not m.data:
                return  # nothing to stage; an empty artifact is a commit of size 0
            await self.staging.stage(s.host_id, m.task_id, m.attempt, m.name, m.offset, m.data)

    async def _artifact_commit(self, s: Session, m: wire.ArtifactCommit) -> None:
        """Reassemble and verify the staged chunks (``conflict`` on any mismatch,
        nothing recorded, the upload's chunks dropped); record the artifact
        (fenced: only for a lease the host holds now); then store the object. A
        failed store leaves a record whose object is missing until the host's
        retry of the commit (the record is idempotent) stores it."""
        limit = self.staging.limits.max_artifact_bytes
        if m.size > limit:
            raise Invalid(f"artifacts are limited to {limit} bytes", field="size")
        await self.repo.check_holds(s, m.task_id, m.attempt, m.lease_token)
        upload = self.staging.artifact_filter(s.host_id, m.task_id, m.attempt, m.name)
        object_name = self.object_name(m.task_id, m.attempt, m.name, m.sha256)
        store = await self._store()
        stored = await self._stored(store, object_name, m.size)
        fd, path = tempfile.mkstemp(prefix="fleetlease-artifact-")
        f = os.fdopen(fd, "w+b")
        try:
            if not stored:
                try:
                    await self._assemble(s, m, f)
                except Conflict:
                    await self.staging.purge(upload)
                    raise
            await self.repo.record_artifact(
                s,
                m.task_id,
                m.attempt,
                name=m.name,
                size=m.size,
                sha256=m.sha256,
                object_name=object_name,
            )
            if not stored:
                await store.put(object_name, cast(IO[bytes], f))
        finally:
            f.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
        log.info(
            "artifact_committed",
            host_id=s.host_id,
            task_id=m.task_id,
            attempt=m.attempt,
            name=m.name,
            size=m.size,
        )
        await self.staging.purge(upload)

    @staticmethod
    async def _stored(store: Any, object_name: str, size: int) -> bool:
        try:
            info = await store.get_info(object_name)
        except NotFoundError:
            return False
        return int(info.size or 0) == size

    async def _assemble(self, s: Session, m: wire.ArtifactCommit, f: IO[bytes]) -> None:
        """The staged chunks from offset 0, in order, into ``f``; ``Conflict``
        unless they add up to exactly ``m.size`` bytes with digest ``m.sha256``."""
        loop = asyncio.get_running_loop()
        digest = hashlib.sha256()
        offset = 0
        while offset < m.size:
            data = await self.staging.chunk(s.host_id, m.task_id, m.attempt, m.name, offset)
            if not data or offset + len(data) > m.size:
                raise Conflict(
                    f"artifact {m.name!r}: chunks do not add up to {m.size} bytes", field="size"
                )
            digest.update(data)
            await loop.run_in_executor(self._io, f.write, data)
            offset += len(data)
        if digest.hexdigest() != m.sha256:
            raise Conflict(
                f"artifact {m.name!r}: digest does not match the chunks received", field="sha256"
            )
        await loop.run_in_executor(self._io, _rewind, f)

    def _on_attempt_event(self, event: Any) -> None:
        """Listener for the actor system's events (on the loop): an attempt that
        no longer holds its lease (result, expiry) has its staged chunks purged."""
        if not isinstance(event, dict):
            return
        host, task, attempt = event.get("host_id"), event.get("task_id"), event.get("attempt")
        if event.get("state") in _HELD_STATES or not isinstance(host, str):
            return
        if not isinstance(task, str) or not isinstance(attempt, int) or attempt < 1:
            return
        self._purge_staged([(host, task, attempt)])

    def _purge_staged(self, ended: Iterable[tuple[str, str, int]]) -> None:
        """Purge the staged chunks of these ended (host, task, attempt)s soon:
        in batches, one purge task at a time (``Staging.purge_attempts``)."""
        if self._stopping:
            return
        self._ended.update(ended)
        if self._ended and not self._purging:
            self._purging = True
            _background(self._purge_ended())

    async def _purge_ended(self) -> None:
        try:
            while self._ended and not self._stopped:
                ended, self._ended = self._ended, set()
                await self.staging.purge_attempts(ended)
        finally:
            self._purging = False

    async def read_artifact(self, object_name: str) -> bytes:
        store = await self._store()
        try:
            result = await store.get(object_name)
        except NotFoundError:
            from fleetlease.persistence.errors import NotFound

            raise NotFound(f"artifact object {object_name!r} is missing", field="name") from None
        return bytes(result.data or b"")

    async def delete_storage(self) -> None:
        """Remove this prefix's object store bucket and staging stream (tests)."""
        js = await self._js()
        with contextlib.suppress(Exception):
            await js.delete_object_store(self.artifact_bucket)
        with contextlib.suppress(Exception):
            await js.delete_stream(self.staging_stream)
        self._object_store = None
        self.staging.forget()

    # --- ops and events ---------------------------------------------------------------
    async def _ops_message(self, msg: Msg, may_wait: bool) -> bytes:
        try:
            user, verb = self.subjects.parse_ops_subject(msg.subject)
        except ValueError as exc:
            raise wire.DecodeError("bad_subject", str(exc)) from None
        env = wire.decode(msg.data)
        if not isinstance(env.msg, wire.OpsRequest):
            raise wire.DecodeError(
                "wrong_type", f"ops expects ops_request, got {env.msg.TYPE}", field="t"
            )
        if env.msg.verb != verb:
            raise wire.DecodeError("wrong_verb", "verb does not match the subject", field="verb")
        if user is None and verb != IDENTIFY_VERB:  # parse_ops_subject guarantees it
            raise wire.DecodeError("bad_subject", "name the user in the subject")
        _reject_nul(env.msg.args, "args")
        if self.ops is None:
            raise Unavailable("the user API is not served here")
        args = env.msg.args
        if verb == "events" and isinstance(args, dict) and (not may_wait or self._stopping):
            # No long-poll slot (or stopping): answered without waiting.
            args = {**args, "wait_s": 0.0}
        # The subject names the user (the broker lets each user publish only its
        # own); the handler refuses a token that is not that user's.
        data = await self.ops.handle(verb, env.msg.token, args, user=user)
        return wire.encode_reply(wire.OpsReply(data=data))

    def _on_event(self, event: Any) -> None:
        """Listener for the actor system's events; may be called from any thread."""
        loop = self._loop
        if loop is None or self._stopping or self._events_nc is None:
            return
        events = event if isinstance(event, list) else [event]
        if threading.get_ident() == self._loop_thread:
            # Published together at the end of this loop iteration: one task and
            # one flush for the events of many transitions.
            if not self._events_pending:
                loop.call_soon(self._publish_pending)
            self._events_pending.extend(events)
        else:
            with contextlib.suppress(RuntimeError):  # loop closed: shutting down
                loop.call_soon_threadsafe(self._publish_events, events)

    def _publish_pending(self) -> None:
        events, self._events_pending = self._events_pending, []
        self._publish_events(events)

    def _publish_events(self, events: list[Any]) -> None:
        nc = self._events_nc
        if nc is None or self._stopping:
            return
        subject = self.subjects.events_task()
        payloads: list[bytes] = []
        for event in events:
            try:
                payloads.append(msgpack.packb(event, default=str, use_bin_type=True))
            except (TypeError, ValueError):
                log.warning("event_not_encodable")
                continue
            if isinstance(event, dict) and event.get("state") == "assigned":
                host = event.get("host_id")
                if isinstance(host, str):
                    self._wake_elsewhere(host)
        if payloads:
            # One task for the batch, not one per event.
            _background(_publish_all(nc, subject, payloads))

    # A host's long-poll may be parked in another ``fleetlease serve`` process
    # than the one whose Scheduler made the assignment: tell the others. One
    # notice per loop iteration, whatever the batch size.
    def _wake_elsewhere(self, host_id: str) -> None:
        if not self._wake_pending:
            asyncio.get_running_loop().call_soon(self._send_wake_notice)
        self._wake_pending.add(host_id)

    def _send_wake_notice(self) -> None:
        hosts, self._wake_pending = sorted(self._wake_pending), set()
        nc = self._channels[Channel.JOBS].nc
        if not hosts or nc is None or self._stopping:
            return
        payload = msgpack.packb({"o": self._instance, "h": hosts}, use_bin_type=True)
        _background(nc.publish(self._wake_subject, payload))

    async def _on_wake_notice(self, msg: Msg) -> None:
        try:
            notice = msgpack.unpackb(msg.data, raw=False)
            origin, hosts = notice["o"], notice["h"]
        except Exception:
            return
        if origin == self._instance or not isinstance(hosts, list):
            return
        self.cp.wake_hosts([h for h in hosts if isinstance(h, str)])


async def _publish_all(nc: NatsClient, subject: str, payloads: list[bytes]) -> None:
    for payload in payloads:
        await nc.publish(subject, payload)


def _background(coro: Awaitable[None]) -> None:
    task = asyncio.ensure_future(coro)
    task.add_done_callback(_ignore_result)


def _ignore_result(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()


def _rewind(f: IO[bytes]) -> None:
    f.flush()
    f.seek(0)
