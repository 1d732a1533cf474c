"""The host side of the protocol: outbound NATS connections only, one per channel
(control, jobs, logs, artifacts), every message after registration signed with
the session key.

``HostClient`` raises ``RemoteError`` for an error reply (``.code`` is the wire
code, ``.retryable`` for ``unavailable`` and ``busy``) and ``TransportError`` (a retryable
``RemoteError`` with code ``unavailable``) when no reply came: the request may or
may not have been applied, so callers retry with the same content (results carry
a fingerprint, renewals are idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import structlog
from nats.aio.client import Client as NatsClient
from nats.errors import ConnectionClosedError, MaxPayloadError, NoRespondersError
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout

from fleetlease.persistence.model import Outcome
from fleetlease.transport import wire
from fleetlease.transport.auth import Signer
from fleetlease.transport.broker_auth import register_proof
from fleetlease.transport.nats_connect import connect as nats_connect
from fleetlease.transport.subjects import Channel, Subjects

log = structlog.get_logger("fleetlease.client")

M = TypeVar("M", bound=wire.Message)

DEFAULT_TIMEOUT_S = 10.0
ARTIFACT_CHUNK = wire.ARTIFACT_CHUNK_BYTES


RECONNECT_WAIT_S = 1.0


def _jittered_reconnect(servers: list[Any], info: dict[str, Any]) -> tuple[Any, float]:
    """nats-py reconnect handler: the least-tried server, after a wait drawn
    from [0.5, 1.5] x RECONNECT_WAIT_S so that reconnecting hosts spread out."""
    server = min(servers, key=lambda s: s.reconnects) if servers else None
    return server, RECONNECT_WAIT_S * (0.5 + random.random())


class TransportError(wire.RemoteError):
    """No reply (timeout, no responders, connection closed). Retryable."""

    def __init__(self, message: str) -> None:
        super().__init__("unavailable", message)


class NotRegistered(wire.RemoteError):
    def __init__(self) -> None:
        super().__init__("unauthorized", "not registered: call register() first")


class HostClient:
    def __init__(
        self,
        *,
        nats_url: str,
        host_id: str,
        credential: str,
        prefix: str = "fleetlease",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        on_reconnect: Callable[[], Awaitable[None]] | None = None,
        connect_options: dict[str, Any] | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.host_id = host_id
        self._credential = credential
        self.subjects = Subjects(prefix)
        self.subjects.register(host_id)  # validates the host id up front
        self.timeout_s = timeout_s
        self._on_reconnect = on_reconnect
        self._connect_options = dict(connect_options or {})
        #: Sent with every heartbeat: the workflows this host serves (None: any)
        #: and the name of its goal runner.
        self.advertised_workflows: list[str] | None = None
        self.advertised_goal_runner: str = ""
        self._conns: dict[Channel, NatsClient] = {}
        self._bg: set[asyncio.Future[None]] = set()
        self._signer: Signer | None = None
        self.generation: int | None = None
        self.lease_s: float | None = None
        self.heartbeat_s: float | None = None

    # --- connections -----------------------------------------------------------------
    async def connect(self) -> None:
        try:
            for channel in (Channel.CONTROL, Channel.JOBS, Channel.LOGS, Channel.ARTIFACTS):
                self._conns[channel] = await self._connect(channel)
        except BaseException:
            # Do not leak the connections already opened (each has reconnect tasks).
            await self.close()
            raise

    async def _connect(self, channel: Channel) -> NatsClient:
        async def reconnected() -> None:
            log.info("nats_reconnected", host_id=self.host_id, channel=channel.value)
            if channel is Channel.CONTROL and self._on_reconnect is not None:
                # The agent re-registers and reconciles; keep a reference so the
                # task is not collected mid-flight.
                self._bg.add(task := asyncio.ensure_future(self._on_reconnect()))
                task.add_done_callback(self._bg.discard)

        async def on_error(exc: Exception) -> None:
            log.warning(
                "nats_error",
                host_id=self.host_id,
                channel=channel.value,
                error=str(exc) or type(exc).__name__,
            )

        async def disconnected() -> None:
            log.warning("nats_disconnected", host_id=self.host_id, channel=channel.value)

        opts: dict[str, Any] = {
            "name": f"fleetlease-host-{self.host_id}-{channel.value}",
            "inbox_prefix": self.subjects.host_inbox_prefix(self.host_id).encode(),
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": RECONNECT_WAIT_S,
            # Many agents reconnecting at once spread out (nats-py has no jitter
            # option of its own; this handler replaces its fixed wait).
            "reconnect_to_server_handler": _jittered_reconnect,
            "reconnected_cb": reconnected,
            "disconnected_cb": disconnected,
            "error_cb": on_error,
            "connect_timeout": 5,
        }
        opts.update(self._connect_options)
        # Reconnects through the expiry of the broker's authorization too.
        return await nats_connect(self.nats_url, **opts)

    async def close(self) -> None:
        for nc in self._conns.values():
            with contextlib.suppress(Exception):
                await nc.close()
        self._conns.clear()

    @property
    def registered(self) -> bool:
        return self._signer is not None

    # --- requests ----------------------------------------------------------------------
    async def _request(
        self,
        channel: Channel,
        subject: str,
        data: bytes,
        expected: type[M] | tuple[type, ...],
        timeout_s: float | None = None,
    ) -> Any:
        nc = self._conns.get(channel)
        if nc is None:
            raise TransportError("not connected")
        try:
            reply = await nc.request(subject, data, timeout=timeout_s or self.timeout_s)
        except (TimeoutError, NatsTimeout):
            raise TransportError(f"no reply on {channel.value} within the timeout") from None
        except NoRespondersError:
            raise TransportError("no control plane is serving") from None
        except ConnectionClosedError:
            raise TransportError("connection closed") from None
        except MaxPayloadError:
            raise wire.RemoteError(
                "bad_request", "message exceeds the server's max payload"
            ) from None
        except NatsError as exc:
            # Reconnecting, draining, stale connection, outbound buffer full: no
            # reply will come on this attempt, but a retry may succeed.
            raise TransportError(f"{type(exc).__name__}: {exc}") from None
        try:
            return wire.decode_reply(reply.data, expected)
        except wire.DecodeError as exc:
            # A reply we cannot read is the peer's fault, not a crash of ours.
            raise wire.RemoteError("internal", f"undecodable reply: {exc.message}") from exc

    async def _signed(
        self,
        channel: Channel,
        subject: str,
        msg: wire.Message,
        expected: type[M],
        timeout_s: float | None = None,
    ) -> M:
        if self._signer is None:
            raise NotRegistered()
        data = self._signer.seal(subject, msg)
        result: M = await self._request(channel, subject, data, expected, timeout_s)
        return result

    async def register(self, agent_version: str = "") -> wire.RegisterOk:
        subject = self.subjects.register(self.host_id)
        # A proof of possession, never the credential itself.
        ts_ms = int(time.time() * 1000)
        nonce = secrets.token_bytes(wire.NONCE_LEN)
        msg = wire.Register(
            host_id=self.host_id,
            agent_version=agent_version,
            proof=register_proof(self._credential, self.host_id, ts_ms, nonce),
            ts_ms=ts_ms,
            nonce=nonce,
        )
        ok: wire.RegisterOk = await self._request(
            Channel.CONTROL, subject, wire.encode(msg), wire.RegisterOk
        )
        self._signer = Signer(self.host_id, ok.generation, ok.session_key)
        self.generation = ok.generation
        self.lease_s = ok.lease_s
        self.heartbeat_s = ok.heartbeat_s
        return ok

    async def heartbeat(self, devices: Sequence[wire.Device], digest: str | None = None) -> None:
        """The complete snapshot (``digest``: the host's tag of it, for
        :meth:`heartbeat_unchanged`)."""
        await self._signed(
            Channel.CONTROL,
            self.subjects.heartbeat(self.host_id),
            wire.Heartbeat(
                devices=list(devices),
                workflows=self.advertised_workflows,
                goal_runner=self.advertised_goal_runner,
                digest=digest,
            ),
            wire.Ok,
        )

    async def heartbeat_unchanged(self, digest: str) -> None:
        """A heartbeat without a snapshot: the host's is still the one sent with
        ``digest`` this session. ``RemoteError`` ``conflict`` when the control
        plane does not hold that one: send the complete snapshot then."""
        await self._signed(
            Channel.CONTROL,
            self.subjects.heartbeat(self.host_id),
            wire.Heartbeat(digest=digest, unchanged=True),
            wire.Ok,
        )

    async def reconcile(self, entries: Sequence[wire.ReconcileEntry]) -> wire.ReconcileResult:
        return await self._signed(
            Channel.CONTROL,
            self.subjects.reconcile(self.host_id),
            wire.Reconcile(entries=list(entries)),
            wire.ReconcileResult,
        )

    async def claim(self, wait_s: float, devices: Sequence[str] = ()) -> wire.Assignment | None:
        if self._signer is None:
            raise NotRegistered()
        subject = self.subjects.claim(self.host_id)
        data = self._signer.seal(subject, wire.Claim(wait_s=wait_s, devices=list(devices)))
        reply = await self._request(
            Channel.JOBS,
            subject,
            data,
            (wire.Assignment, wire.NoWork),
            timeout_s=wait_s + self.timeout_s,
        )
        return reply if isinstance(reply, wire.Assignment) else None

    async def ack(self, task_id: str, attempt: int, lease_token: str) -> wire.LeaseReply:
        return await self._signed(
            Channel.JOBS,
            self.subjects.ack(self.host_id),
            wire.Ack(task_id=task_id, attempt=attempt, lease_token=lease_token),
            wire.LeaseReply,
        )

    async def renew(self, task_id: str, attempt: int, lease_token: str) -> wire.LeaseReply:
        return await self._signed(
            Channel.JOBS,
            self.subjects.renew(self.host_id),
            wire.Renew(task_id=task_id, attempt=attempt, lease_token=lease_token),
            wire.LeaseReply,
        )

    async def progress(
        self, task_id: str, attempt: int, lease_token: str, seq: int, message: str = ""
    ) -> wire.LeaseReply:
        return await self._signed(
            Channel.JOBS,
            self.subjects.progress(self.host_id),
            wire.Progress(
                task_id=task_id, attempt=attempt, lease_token=lease_token, seq=seq, message=message
            ),
            wire.LeaseReply,
        )

    async def result(
        self,
        task_id: str,
        attempt: int,
        lease_token: str,
        *,
        outcome: str,
        retryable: bool = False,
        reason: str = "",
        result: dict[str, Any] | None = None,
        fingerprint: str,
    ) -> wire.ResultReply:
        return await self._signed(
            Channel.JOBS,
            self.subjects.result(self.host_id),
            wire.Result(
                task_id=task_id,
                attempt=attempt,
                lease_token=lease_token,
                outcome=Outcome(outcome),
                retryable=retryable,
                reason=reason,
                result=result or {},
                fingerprint=fingerprint,
            ),
            wire.ResultReply,
        )

    async def cancel_poll(self, task_id: str, attempt: int, lease_token: str) -> wire.CancelStatus:
        return await self._signed(
            Channel.JOBS,
            self.subjects.cancel_poll(self.host_id),
            wire.CancelPoll(task_id=task_id, attempt=attempt, lease_token=lease_token),
            wire.CancelStatus,
        )

    async def append_logs(
        self, task_id: str, attempt: int, first_seq: int, lines: Sequence[str]
    ) -> None:
        await self._signed(
            Channel.LOGS,
            self.subjects.log_append(self.host_id),
            wire.LogAppend(
                task_id=task_id, attempt=attempt, first_seq=first_seq, lines=list(lines)
            ),
            wire.Ok,
        )

    async def upload_artifact(
        self, task_id: str, attempt: int, lease_token: str, name: str, data: bytes
    ) -> None:
        """Upload ``data`` as artifact ``name`` of an attempt whose lease the
        host holds (the control plane refuses it for any other)."""
        subject = self.subjects.artifact_chunk(self.host_id)
        for offset in range(0, len(data), ARTIFACT_CHUNK):
            chunk = data[offset : offset + ARTIFACT_CHUNK]
            await self._signed(
                Channel.ARTIFACTS,
                subject,
                wire.ArtifactChunk(
                    task_id=task_id,
                    attempt=attempt,
                    lease_token=lease_token,
                    name=name,
                    offset=offset,
                    data=chunk,
                ),
                wire.Ok,
            )
        await self._signed(
            Channel.ARTIFACTS,
            self.subjects.artifact_commit(self.host_id),
            wire.ArtifactCommit(
                task_id=task_id,
                attempt=attempt,
                lease_token=lease_token,
                name=name,
                size=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
            ),
            wire.Ok,
        )
