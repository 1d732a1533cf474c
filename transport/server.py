"""The control plane's NATS side: one connection, subscription (queue group),
pending limit and worker pool per channel (control, jobs, logs, artifacts, ops),
so that a stuck log or artifact transfer never delays a heartbeat, a claim or a
result.

Every request goes through the same gate, in this order, and is refused at the
first check it fails (typed ``Error{code, message}`` reply, nothing read or
written past that point). Here, before any handler runs:

0. the reply subject lies inside the inbox of the principal the subject names
   (``Subjects.reply_allowed``); otherwise there is no reply at all, only a
   ``reply_subject_refused`` warning, since the reply subject is the sender's
   choice and the control plane must never publish elsewhere on its behalf;
0. then admission, as it is taken off the subscription and before it is decoded
   (``transport/admission.py``): within the channel's size limit
   (``bad_request``), its principal's budget of requests, bytes and parked
   long-polls, and the channel's backlog (``busy``). The subscription never
   waits for a worker, so nats-server never sees a slow consumer here.

Then the channel's handler: the host verbs and the rest of their gate
(``transport/host_handlers.py``: subject, decoding, signature, session
generation), artifacts (``transport/artifacts.py``), the ops channel
(``transport/ops_channel.py``). Task events and cross-process long-poll wake
notices: ``transport/events.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import nats
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from fleetlease.ops.observe import metrics
from fleetlease.persistence.clock import Clock, SystemClock
from fleetlease.persistence.errors import RepositoryError
from fleetlease.persistence.model import LeaseTimings
from fleetlease.transport import wire
from fleetlease.transport.admission import Admission, Budget, host_principal, ops_principal
from fleetlease.transport.artifacts import ARTIFACT_BUCKET, Artifacts, artifact_object_name
from fleetlease.transport.auth import AuthError, Verifier
from fleetlease.transport.background import background
from fleetlease.transport.broker_auth import ROLE_LIMITS
from fleetlease.transport.clip import MAX_MESSAGE_CHARS, MAX_SUBJECT_CHARS, clip
from fleetlease.transport.events import EventFanout
from fleetlease.transport.host_handlers import HOST_VERBS, ControlPlaneLike, HostHandlers
from fleetlease.transport.nats_connect import KEEPALIVE, server_list
from fleetlease.transport.ops_channel import OpsChannel, OpsHandler
from fleetlease.transport.replay import SharedReplay
from fleetlease.transport.staging import StagingLimits
from fleetlease.transport.subjects import Channel, Subjects, queue_group

if TYPE_CHECKING:
    from fleetlease.persistence.repository import Repository

log = structlog.get_logger("fleetlease.server")

__all__ = [
    "ARTIFACT_BUCKET",
    "DEFAULT_CHANNELS",
    "HOST_VERBS",
    "ChannelConfig",
    "ControlPlaneLike",
    "OpsHandler",
    "Server",
]


@dataclass(frozen=True, kw_only=True)
class ChannelConfig:
    """Limits of one channel. ``long_poll`` (jobs, ops) is a second pool for
    claims and ops ``events`` polls, which park until something happens: a host
    fleet long-polling can never take the workers that renewals and results
    need. A long-poll that finds no slot free is answered at once (no waiting)
    from the normal pool.

    Admission (``transport/admission.py``): one principal may have at most
    ``principal_requests`` requests (``principal_bytes`` bytes) of this channel
    taken and not yet answered, and park at most ``principal_polls`` long-polls;
    all principals together at most ``pending_msgs`` requests (``pending_bytes``
    bytes). A request over any of these is answered ``busy`` at once, undecoded.
    A request over ``max_request_bytes`` is refused (``bad_request``) the same
    way. ``pending_msgs`` / ``pending_bytes`` are also the nats-py subscription's
    pending limits: the dispatcher never waits, so that queue only holds what
    the event loop has not yet looked at."""

    workers: int
    long_poll: int = 0
    pending_msgs: int = 65536
    pending_bytes: int = 64 * 1024 * 1024
    principal_requests: int = 64
    principal_bytes: int = 8 * 1024 * 1024
    principal_polls: int = 16
    #: A larger request is refused (``bad_request``) undecoded.
    max_request_bytes: int = wire.MAX_MESSAGE_SIZE

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers!r}")
        if self.long_poll < 0:
            raise ValueError(f"long_poll must not be negative, got {self.long_poll!r}")
        self.budget()  # validates the admission bounds

    def budget(self) -> Budget:
        return Budget(
            principal_requests=self.principal_requests,
            principal_bytes=self.principal_bytes,
            principal_polls=self.principal_polls,
            backlog_requests=self.pending_msgs,
            backlog_bytes=self.pending_bytes,
        )


_MIB = 1024 * 1024

DEFAULT_CHANNELS: dict[Channel, ChannelConfig] = {
    # A host has one heartbeat (register, reconcile) in flight at a time.
    Channel.CONTROL: ChannelConfig(workers=64, principal_requests=8, principal_bytes=4 * _MIB),
    # One lease message per device may be in flight (renewals of a full host).
    # long_poll: the parked claims; an idle agent parks up to four
    # (``claim_polls``), so 16,384 hold 4,096 idle hosts' (a parked claim costs
    # a few KiB). Under load an agent covers each device freed by a finished
    # attempt with a claim of its own, so one host may park up to one claim per
    # idle device: principal_polls lets a 64-device host do so.
    Channel.JOBS: ChannelConfig(
        workers=256,
        long_poll=16384,
        principal_requests=wire.MAX_DEVICES,
        principal_bytes=8 * _MIB,
        principal_polls=64,
    ),
    # Every running attempt of a host may be appending logs (one per device).
    Channel.LOGS: ChannelConfig(
        workers=16, principal_requests=wire.MAX_DEVICES, principal_bytes=16 * _MIB
    ),
    Channel.ARTIFACTS: ChannelConfig(workers=8, principal_requests=64, principal_bytes=16 * _MIB),
    # long_poll: the ops `events` long-polls of live views (watch, web console).
    Channel.OPS: ChannelConfig(
        workers=64,
        long_poll=1024,
        principal_requests=256,
        principal_bytes=8 * _MIB,
        principal_polls=16,
        max_request_bytes=ROLE_LIMITS["user"]["payload"],
    ),
}


@dataclass
class _ChannelState:
    channel: Channel
    config: ChannelConfig
    nc: NatsClient | None = None
    sub: Subscription | None = None
    sem: asyncio.Semaphore | None = None
    poll_sem: asyncio.Semaphore | None = None
    admission: Admission | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    #: Tests close this gate to stall a channel on purpose.
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    received: int = 0
    handled: int = 0
    shed: int = 0


Handler = Callable[[Msg, bool], Awaitable[bytes]]


def _error(code: str, message: str) -> bytes:
    if code not in wire.ERROR_CODES:
        code = "internal"
    return wire.error_reply(code, message[: wire.MAX_TEXT_LEN])


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
        replay_ledger: Repository | None = None,
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
        #: Replay protection shared by every process of the fleet
        #: (``transport.replay``), through ``replay_ledger`` (``repo`` if None).
        self.replay = SharedReplay(
            replay_ledger or repo, auth_clock or SystemClock(), window_s=self.verifier.window_s
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
        self._stopping = False
        self._stopped = False
        self._started = False
        #: Artifact staging, commit and object store (``transport.artifacts``).
        self.artifacts = Artifacts(
            repo=repo,
            prefix=self.subjects.prefix,
            storage=lambda: self._storage_nc,
            limits=staging,
        )
        self.staging = self.artifacts.staging
        self.artifact_bucket = self.artifacts.artifact_bucket
        self.staging_stream = self.artifacts.staging_stream
        #: The host verbs and their gate (``transport.host_handlers``).
        self.hosts = HostHandlers(
            control_plane=control_plane,
            repo=repo,
            subjects=self.subjects,
            verifier=self.verifier,
            replay=self.replay,
            server_secret=server_secret,
            timings=self.timings,
            heartbeat_s=heartbeat_s,
            artifacts=self.artifacts,
            stopping=lambda: self._stopping,
        )
        #: The user API's requests (``transport.ops_channel``).
        self.ops_channel = OpsChannel(
            subjects=self.subjects, ops=ops, stopping=lambda: self._stopping
        )
        #: Task events and cross-process long-poll wakeups (``transport.events``).
        self.events = EventFanout(
            subjects=self.subjects,
            wake_hosts=lambda hosts: self.cp.wake_hosts(hosts),
            jobs_nc=lambda: self._channels[Channel.JOBS].nc,
        )

    # --- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        handlers: dict[Channel, tuple[str, Handler]] = {
            Channel.CONTROL: (self.subjects.control_wildcard(), self.hosts.handle),
            Channel.JOBS: (self.subjects.jobs_wildcard(), self.hosts.handle),
            Channel.LOGS: (self.subjects.logs_wildcard(), self.hosts.handle),
            Channel.ARTIFACTS: (self.subjects.artifacts_wildcard(), self.hosts.handle),
            Channel.OPS: (self.subjects.ops_wildcard(), self.ops_channel.handle),
        }
        try:
            for channel, (subject, handler) in handlers.items():
                state = self._channels[channel]
                state.gate.set()
                state.sem = asyncio.Semaphore(state.config.workers)
                state.admission = Admission(state.config.budget())
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
            events_nc = self._channels[Channel.OPS].nc
            assert events_nc is not None
            await self.events.start(events_nc)
            self.cp.add_listener(self.events.on_event)
            self.cp.add_listener(self.artifacts.on_attempt_event)
            self.replay.start()
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
            **KEEPALIVE,
        }
        opts.update(self._connect_options if options is None else options)
        return await nats.connect(server_list(self.nats_url), **opts)

    async def drain(self, grace_s: float = 10.0) -> None:
        """Stop taking new requests: NATS stops routing to this process (the
        queue group's other members get them) and what already reached it is
        still dispatched (drain, not unsubscribe: nothing is dropped). Claims
        from now on do not wait. Idempotent; ``stop`` calls it."""
        if self._stopping:
            return
        self._stopping = True
        self.events.stop()
        self.artifacts.stop_purging()
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
        self.artifacts.stop()
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
        await self.replay.stop()
        self.artifacts.close()
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

    def shed(self, channel: Channel) -> int:
        """Requests of ``channel`` answered ``busy`` without being served."""
        return self._channels[Channel(channel)].shed

    def in_flight(self, channel: Channel) -> int:
        return len(self._channels[Channel(channel)].tasks)

    def disconnected_channels(self) -> list[str] | None:
        """The channels whose connection is down now; None before ``start``."""
        if not self._started:
            return None
        return sorted(
            ch.value
            for ch, state in self._channels.items()
            if state.nc is None or not state.nc.is_connected
        )

    # --- dispatch ----------------------------------------------------------------
    def _dispatcher(
        self, state: _ChannelState, handler: Handler
    ) -> Callable[[Msg], Awaitable[None]]:
        """The subscription's callback. It never waits: a request is admitted
        (a task that queues for a worker) or shed (answered ``busy`` at once), so
        the connection is read as fast as nats-server writes to it."""
        polls = (".claim", ".events")

        async def on_message(msg: Msg) -> None:
            assert state.sem is not None and state.admission is not None
            admission = state.admission
            state.received += 1
            size = len(msg.data)
            principal = self._principal(state.channel, msg)
            if size > state.config.max_request_bytes:
                limit = state.config.max_request_bytes
                reason = f"request of {size} bytes, limit {limit}"
                self._shed(state, msg, principal, reason, code="bad_request")
                return
            refused = admission.admit(principal, size)
            if refused is not None:
                self._shed(state, msg, principal, refused)
                return
            sem, may_wait, parked = state.sem, False, False
            poll_sem = state.poll_sem
            if poll_sem is not None and msg.subject.endswith(polls):
                if not admission.park(principal):
                    admission.release(principal, size)
                    self._shed(
                        state, msg, principal, "too many long-polls parked by this principal"
                    )
                    return
                parked = True
                # With no long-poll slot free, answered without waiting from the
                # normal pool (the client paces itself).
                if not poll_sem.locked():
                    await poll_sem.acquire()  # a slot is free: returns at once
                    sem, may_wait = poll_sem, True
            task = asyncio.create_task(
                self._admitted(state, handler, msg, sem, may_wait, principal, size, parked)
            )
            state.tasks.add(task)
            task.add_done_callback(state.tasks.discard)

        return on_message

    def _principal(self, channel: Channel, msg: Msg) -> str:
        """Who a request is charged to (``transport/admission.py``)."""
        if channel is Channel.OPS:
            return ops_principal(self.subjects, msg.subject, msg.reply or "")
        return host_principal(self.subjects, msg.subject)

    def _shed(
        self, state: _ChannelState, msg: Msg, principal: str, reason: str, code: str = "busy"
    ) -> None:
        state.shed += 1
        if state.shed & (state.shed - 1) == 0:  # 1st, 2nd, 4th, 8th, ...: logs stay bounded
            log.warning(
                "requests_shed",
                channel=state.channel.value,
                principal=clip(principal),
                reason=clip(reason, MAX_MESSAGE_CHARS),
                shed=state.shed,
            )
        if msg.reply and self.subjects.reply_allowed(msg.subject, msg.reply):
            text = f"busy: {reason}; retry later" if code == "busy" else reason
            background(_respond(msg, _error(code, text)))

    async def _admitted(
        self,
        state: _ChannelState,
        handler: Handler,
        msg: Msg,
        sem: asyncio.Semaphore,
        may_wait: bool,
        principal: str,
        size: int,
        parked: bool,
    ) -> None:
        assert state.admission is not None
        try:
            if not may_wait:
                await sem.acquire()
            # ``_serve_one`` releases ``sem``.
            await self._serve_one(state, handler, msg, sem, may_wait)
        finally:
            state.admission.release(principal, size)
            if parked:
                state.admission.unpark(principal)

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
                    principal=clip(inbox.principal) if inbox else None,
                    subject=clip(msg.subject, MAX_SUBJECT_CHARS),
                    reply=clip(msg.reply, MAX_SUBJECT_CHARS),
                )
                metrics.request_error(msg.subject, "forbidden")  # refused, never answered
                return
            reply = await self._answer(handler, msg, may_wait)
            state.handled += 1
            if msg.reply:
                nc = state.nc
                if nc is not None and len(reply) > nc.max_payload:
                    log.error(
                        "reply_too_large",
                        subject=clip(msg.subject, MAX_SUBJECT_CHARS),
                        size=len(reply),
                    )
                    reply = _error("internal", "reply too large")
                try:
                    await msg.respond(reply)
                except Exception as exc:
                    log.warning(
                        "reply_failed",
                        subject=clip(msg.subject, MAX_SUBJECT_CHARS),
                        error=str(exc) or type(exc).__name__,
                    )
        finally:
            sem.release()

    async def _answer(self, handler: Handler, msg: Msg, may_wait: bool) -> bytes:
        try:
            return await handler(msg, may_wait)
        except (wire.DecodeError, AuthError, RepositoryError) as exc:
            code = exc.code
            metrics.request_error(msg.subject, code)
            # Messages may quote what the sender sent: logged clipped (the
            # reply is bounded by ``_error``).
            log.info(
                "request_refused",
                subject=clip(msg.subject, MAX_SUBJECT_CHARS),
                code=code,
                reason=clip(getattr(exc, "reason", None) or type(exc).__name__),
                error=clip(exc.message, MAX_MESSAGE_CHARS),
            )
            return _error(code, exc.message)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler_failed", subject=clip(msg.subject, MAX_SUBJECT_CHARS))
            metrics.request_error(msg.subject, "internal")
            return _error("internal", "internal error")

    # --- artifacts ---------------------------------------------------------------
    object_name = staticmethod(artifact_object_name)

    async def read_artifact(self, object_name: str) -> bytes:
        """The whole stored object (small objects and tests; ``NotFound`` if it
        is missing). The user API reads ranges: ``read_artifact_range``."""
        return await self.artifacts.read_artifact(object_name)

    async def read_artifact_range(
        self, object_name: str, *, offset: int, length: int, reader: str
    ) -> tuple[bytes, int]:
        """``length`` bytes of the stored object from ``offset`` and its size,
        reading only the chunks the range needs (``Artifacts.read_range``)."""
        return await self.artifacts.read_range(
            object_name, offset=offset, length=length, reader=reader
        )

    async def delete_storage(self) -> None:
        """Remove this prefix's object store bucket and staging stream (tests)."""
        await self.artifacts.delete_storage()


async def _respond(msg: Msg, reply: bytes) -> None:
    with contextlib.suppress(Exception):
        await msg.respond(reply)
