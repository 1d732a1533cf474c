"""The agent's session with the control plane: connect, register, reconcile the
journal, heartbeat, and re-establish all of it when it is lost.

Every registration opens a new session generation and kills the previous one.
After *every* registration the agent reconciles its journal before any other
job request goes out: the control plane confirms (and rebinds to the new
generation) the attempts it still considers this host's, and says "discard"
for the others; the verdicts are settled by the attempts
(:meth:`fleetlease.hostagent.attempts.Attempts.settle`). Requests wait while
the session is being re-established; a request refused with ``unauthorized``
triggers one re-registration (coalesced across all callers by a session
epoch) and is retried on the new session. Reconnecting agents wait a random
jitter (``resync_jitter_s``) before registering, so that a NATS restart does
not make every host register in the same instant.

Broker refusal: a NATS server that refuses the host's authorization on a
(re)connect ("Authorization Violation": on a secured broker the auth callout
refuses a revoked or unknown host) makes the agent stop with
:class:`BrokerRefused` once the refusals have lasted ``broker_refused_s``
without a successful connect in between (a callout briefly unavailable, as
while the control plane restarts, is refused the same way and must not stop
the agent). Plain connection errors are retried forever.

Heartbeats carry the device snapshot: periodically, and at once when a device
changes from outside (attached, detached, gone offline). While the agent
stops, every device is reported offline.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import msgpack
import structlog
from nats.errors import Error as NatsError

from fleetlease.hostagent.config import AGENT_VERSION, FALLBACK_HEARTBEAT_S
from fleetlease.hostagent.errors import (
    Aborted,
    AgentError,
    BrokerRefused,
    RegistrationRefused,
    is_authorization_refusal,
)
from fleetlease.hostagent.execution import end_orphan_groups
from fleetlease.hostagent.journal import JournalRecord
from fleetlease.hostagent.retry import sleep_or_event
from fleetlease.hostagent.state import AgentState
from fleetlease.transport import wire
from fleetlease.transport.broker_auth import host_connect_options
from fleetlease.transport.client import HostClient
from fleetlease.transport.wire import RemoteError

__all__ = ["Session", "Settle"]

log = structlog.get_logger("fleetlease.agent")

T = TypeVar("T")

#: Codes with which the control plane refuses the credential at registration.
_REFUSED_CODES = frozenset({"unauthorized", "forbidden", "bad_request", "not_found"})
#: How many times one request is retried on a fresh session after "unauthorized".
_MAX_SESSION_RETRIES = 3

#: Settles the reconciliation's verdicts on the journal entries; returns how
#: many were confirmed, discarded and resumed.
Settle = Callable[
    [Sequence[JournalRecord], Mapping[tuple[str, int], wire.Verdict]],
    Awaitable[tuple[int, int, int]],
]


class Session:
    """The connection and session of one agent; :meth:`call` sends a request on
    the current session, waiting for one and renewing it as needed."""

    def __init__(self, state: AgentState, *, settle: Settle) -> None:
        self._state = state
        self._config = state.config
        self._settle = settle
        self.client: HostClient | None = None
        #: Set while a session is established and reconciled.
        self.ready = asyncio.Event()
        #: Set once the first registration and reconciliation are done.
        self.started = asyncio.Event()
        self._epoch = 0
        self._resync_task: asyncio.Task[None] | None = None
        #: Loop time of the first of the current run of authorization refusals.
        self._refused_since: float | None = None
        #: (session generation, digest) of the last complete snapshot the
        #: control plane acknowledged: heartbeats then send only the digest.
        self._snapshot_sent: tuple[int | None, str] | None = None

    def client_or_fail(self) -> HostClient:
        if self.client is None:
            raise AgentError("not connected")
        return self.client

    # --- connection -------------------------------------------------------------------
    async def connect(self) -> None:
        cfg = self._config
        backoff = self._state.backoff()
        while not self._state.stopping.is_set():
            client = HostClient(
                nats_url=cfg.nats_url,
                host_id=cfg.host_id,
                credential=cfg.credential,
                prefix=cfg.prefix,
                timeout_s=cfg.request_timeout_s,
                on_reconnect=self._on_nats_reconnect,
                # Secured identity; harmless on an open server.
                connect_options={
                    **host_connect_options(cfg.host_id, cfg.credential),
                    "error_cb": self._on_nats_error,
                    **cfg.connect_options,
                },
            )
            client.advertised_workflows = None if cfg.workflows is None else list(cfg.workflows)
            client.advertised_goal_runner = cfg.goal_runner
            try:
                await client.connect()
            except asyncio.CancelledError:
                # A stop, or a refusal made fatal: nats-py retries a refused or
                # unreachable server inside connect() and never returns.
                await client.close()
                raise
            except (OSError, TimeoutError, NatsError) as exc:
                await client.close()
                delay = backoff.next_delay()
                log.warning(
                    "nats_connect_failed",
                    host_id=cfg.host_id,
                    error=str(exc) or type(exc).__name__,
                    retry_in_s=round(delay, 3),
                )
                await sleep_or_event(delay, self._state.stopping)
                continue
            self.client = client
            self._refused_since = None
            return

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def _on_nats_reconnect(self) -> None:
        self._refused_since = None
        self.request_resync("nats_reconnected", self._epoch)

    async def _on_nats_error(self, exc: Exception) -> None:
        """nats-py's error callback of every connection (it replaces the
        client's, which only logs): counts authorization refusals."""
        cfg = self._config
        text = str(exc) or type(exc).__name__
        if not is_authorization_refusal(exc):
            log.warning("nats_error", host_id=cfg.host_id, error=text)
            return
        loop = asyncio.get_running_loop()
        if self._refused_since is None:
            self._refused_since = loop.time()
        refused_for = loop.time() - self._refused_since
        limit = cfg.broker_refused_s
        if refused_for < limit:
            log.warning(
                "nats_authorization_refused",
                host_id=cfg.host_id,
                error=text,
                refused_for_s=round(refused_for, 1),
                exit_after_s=limit,
            )
            return
        if self._state.fatal is None:
            log.error(
                "broker_refused",
                host_id=cfg.host_id,
                error=text,
                refused_for_s=round(refused_for, 1),
            )
        self._state.set_fatal(BrokerRefused(cfg.host_id, text, refused_for), where="nats")

    # --- registration -------------------------------------------------------------------
    def request_resync(self, reason: str, epoch: int) -> None:
        """Re-register (once, however many callers ask) unless the session of
        ``epoch`` has already been replaced."""
        if self._state.fatal is not None or epoch != self._epoch or not self.started.is_set():
            # Before the first session is up, the initial registration retries.
            return
        if self._resync_task is not None and not self._resync_task.done():
            return
        self.ready.clear()
        log.info("session_resync", host_id=self._config.host_id, reason=reason)
        self._resync_task = self._state.spawn(self.resync(reason, jitter=True), "resync")

    async def resync(self, reason: str, *, jitter: bool) -> None:
        """Register, reconcile, heartbeat; then mark the session ready."""
        cfg = self._config
        state = self._state
        client = self.client_or_fail()
        self.ready.clear()
        if jitter and cfg.resync_jitter_s > 0:
            await asyncio.sleep(state.rng.random() * cfg.resync_jitter_s)
        backoff = state.backoff()
        while True:
            try:
                ok = await client.register(AGENT_VERSION)
            except RemoteError as exc:
                if exc.code in _REFUSED_CODES:
                    log.error(
                        "registration_refused",
                        host_id=cfg.host_id,
                        code=exc.code,
                        error=exc.message,
                    )
                    raise RegistrationRefused(cfg.host_id, exc.code, exc.message) from None
                delay = backoff.next_delay()
                log.warning(
                    "registration_failed",
                    host_id=cfg.host_id,
                    code=exc.code,
                    error=exc.message,
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)
                continue
            self._epoch += 1
            state.stats.registrations += 1
            log.info(
                "agent_registered",
                host_id=cfg.host_id,
                generation=ok.generation,
                lease_s=ok.lease_s,
                heartbeat_s=ok.heartbeat_s,
                reason=reason,
            )
            try:
                await self._reconcile(client)
                await self._first_heartbeat(client)
            except RemoteError as exc:
                delay = backoff.next_delay()
                log.warning(
                    "reconcile_failed",
                    host_id=cfg.host_id,
                    code=exc.code,
                    error=exc.message,
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)
                continue
            break
        state.devices_changed.clear()
        self.ready.set()
        state.wake.set()

    async def _first_heartbeat(self, client: HostClient) -> None:
        """The snapshot right after registering; only a dead session matters here
        (the heartbeat loop repeats it anyway)."""
        try:
            await client.heartbeat(self.snapshot())
        except RemoteError as exc:
            if exc.code == "unauthorized":
                raise
            log.warning(
                "heartbeat_failed", host_id=self._config.host_id, code=exc.code, error=exc.message
            )

    async def _reconcile(self, client: HostClient) -> None:
        state = self._state
        journal = state.journal_or_fail()
        async with state.journal_lock:
            entries = await state.journal_calls.call(journal.entries)
            # Process groups of attempts this agent no longer runs (a crashed
            # predecessor's steps) end before the control plane hears of them.
            await end_orphan_groups(
                [e for e in entries if e.key not in state.attempts],
                state.journal_calls,
                journal,
                grace_s=self._config.cancel_timeout_s,
            )
            result = await client.reconcile(
                [
                    wire.ReconcileEntry(
                        task_id=e.task_id, attempt=e.attempt, lease_token=e.lease_token
                    )
                    for e in entries
                ]
            )
        verdicts = {(v.task_id, v.attempt): v for v in result.verdicts}
        confirmed, discarded, resumed = await self._settle(entries, verdicts)
        log.info(
            "reconcile_done",
            host_id=self._config.host_id,
            generation=result.generation,
            entries=len(entries),
            confirmed=confirmed,
            discarded=discarded,
            resumed=resumed,
        )

    # --- requests -----------------------------------------------------------------------
    async def wait_ready(self, *aborts: asyncio.Event | None) -> None:
        if self.ready.is_set():
            return
        stops = [a for a in aborts if a is not None]
        while not self.ready.is_set():
            await sleep_or_event(3600.0, self.ready, *stops)
            if any(a.is_set() for a in stops):
                raise Aborted()

    async def call(
        self,
        fn: Callable[[HostClient], Awaitable[T]],
        *,
        abort: asyncio.Event | None = None,
        timeout_s: float | None = None,
        give_up: asyncio.Event | None = None,
    ) -> T:
        """A signed request on the current session. On ``unauthorized`` the session
        is re-established (once for everyone) and the request repeated, at most
        ``_MAX_SESSION_RETRIES`` times; a local timeout becomes ``unavailable``.
        ``abort`` and ``give_up`` end a wait for the session (``Aborted``); a
        request already sent runs to its reply or timeout."""
        client = self.client_or_fail()
        tries = 0
        while True:
            await self.wait_ready(abort, give_up)
            epoch = self._epoch
            try:
                if timeout_s is None:
                    return await fn(client)
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for runs the
                # request in a task of its own, a task per request for nothing.
                try:
                    async with asyncio.timeout(timeout_s):
                        return await fn(client)
                except TimeoutError:
                    raise RemoteError("unavailable", "no reply within the timeout") from None
            except RemoteError as exc:
                if exc.code != "unauthorized" or tries >= _MAX_SESSION_RETRIES:
                    raise
                tries += 1
                log.info("session_invalid", host_id=self._config.host_id, error=exc.message)
                self.request_resync("unauthorized", epoch)

    # --- heartbeat ----------------------------------------------------------------------
    def snapshot(self) -> list[wire.Device]:
        # While stopping, every device is reported offline so that the control
        # plane assigns nothing more to this host.
        stopping = self._state.stopping.is_set()
        return [
            wire.Device(
                device_id=d.device_id,
                state="offline" if stopping else d.state,
                capabilities=dict(d.capabilities),
            )
            for d in self._state.devices.snapshot()
        ]

    async def heartbeat_loop(self, refresh: Callable[[], Awaitable[None]]) -> None:
        """Heartbeat every period, or at once when a device changed from outside;
        ``refresh`` rescans the devices before a periodic one."""
        state = self._state
        while True:
            await self.wait_ready()
            client = self.client_or_fail()
            period = self._config.heartbeat_s or client.heartbeat_s or FALLBACK_HEARTBEAT_S
            changed = await sleep_or_event(period, state.devices_changed)
            if not changed:
                # Pick up attached/detached devices (adb); a change sets the
                # event again through the callback and is sent next round.
                await refresh()
            state.devices_changed.clear()
            await self.send_heartbeat()

    async def send_heartbeat(self) -> None:
        """The snapshot, or, when it is the one the control plane acknowledged
        last in this session, only its digest (one row written there instead of
        one per device); the complete snapshot again when the control plane
        answers that it does not hold that one."""
        devices = self.snapshot()
        client = self.client_or_fail()
        digest = snapshot_digest(
            devices, client.advertised_workflows, client.advertised_goal_runner
        )
        timeout_s = self._config.request_timeout_s
        try:
            sent = self._snapshot_sent
            if sent is not None and sent == (client.generation, digest):
                try:
                    await self.call(lambda c: c.heartbeat_unchanged(digest), timeout_s=timeout_s)
                    self._state.stats.heartbeats_sent += 1
                    return
                except RemoteError as exc:
                    if exc.code != "conflict":
                        raise
            self._snapshot_sent = None
            generation = await self.call(
                lambda c: _full_heartbeat(c, devices, digest), timeout_s=timeout_s
            )
            self._snapshot_sent = (generation, digest)
            self._state.stats.heartbeats_sent += 1
        except RemoteError as exc:
            log.warning(
                "heartbeat_failed", host_id=self._config.host_id, code=exc.code, error=exc.message
            )


async def _full_heartbeat(
    client: HostClient, devices: list[wire.Device], digest: str
) -> int | None:
    """Send the complete snapshot; returns the generation of the session it was
    sent in (the session may be renewed under a call)."""
    generation = client.generation
    await client.heartbeat(devices, digest=digest)
    return generation


def snapshot_digest(
    devices: list[wire.Device], workflows: list[str] | None, goal_runner: str
) -> str:
    """The tag of a heartbeat's snapshot: a SHA-256 of what it says."""
    doc = [
        [[d.device_id, d.state, sorted(d.capabilities.items())] for d in devices],
        workflows,
        goal_runner,
    ]
    return hashlib.sha256(msgpack.packb(doc, use_bin_type=True)).hexdigest()[:32]
