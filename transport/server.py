"""The control plane's NATS side: one connection, subscription (queue group),
pending limit and worker pool per channel (control, jobs, logs, artifacts, ops),
so that a stuck log or artifact transfer never delays a heartbeat, a claim or a
result.

Every request is decoded and validated at the edge (``transport.wire.decode``),
its type checked against the subject's verb, its session signature verified
(``transport.auth.Verifier``) for the host named in the subject, and only then
handed to the actor system (``actors.runtime.ControlPlane``) or the repository.
Every reply is a typed message or ``Error{code, message}``; nothing a malformed
or hostile message does can stop the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgpack
import nats
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from persistence.errors import Conflict, Invalid, RepositoryError, Unavailable
from persistence.model import DeviceSnapshot, JournalEntry, LeaseTimings, Session
from transport import wire
from transport.auth import AuthError, Verifier, session_key
from transport.subjects import Channel, Subjects, queue_group

if TYPE_CHECKING:
    from actors.runtime import ControlPlane

    from persistence.repository import Repository

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

MAX_ARTIFACT_BYTES = 256 * 1024 * 1024
ARTIFACT_BUCKET = "fleetlease-artifacts"


class OpsHandler(Protocol):
    """The user API behind the ops subjects (``ops/api.py``). ``handle`` returns
    any msgpack-able value or raises a ``RepositoryError`` (typed reply)."""

    async def handle(self, verb: str, token: str, args: dict[str, Any]) -> Any: ...


@dataclass(kw_only=True)
class ChannelConfig:
    workers: int
    pending_msgs: int = 65536
    pending_bytes: int = 64 * 1024 * 1024


DEFAULT_CHANNELS: dict[Channel, ChannelConfig] = {
    Channel.CONTROL: ChannelConfig(workers=64),
    # Claims are long-polls that park a worker each: allow many.
    Channel.JOBS: ChannelConfig(workers=4096),
    Channel.LOGS: ChannelConfig(workers=16),
    Channel.ARTIFACTS: ChannelConfig(workers=8),
    Channel.OPS: ChannelConfig(workers=64),
}


@dataclass
class _ChannelState:
    channel: Channel
    config: ChannelConfig
    nc: NatsClient | None = None
    sem: asyncio.Semaphore | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    #: Tests close this gate to stall a channel on purpose.
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    handled: int = 0


@dataclass
class _Upload:
    path: Path
    size: int = 0
    digest: Any = field(default_factory=hashlib.sha256)


class Server:
    """Serves one control plane on NATS. Several ``Server`` processes may share one
    NATS and one PostgreSQL: every subscription is in a queue group."""

    def __init__(
        self,
        *,
        nats_url: str,
        control_plane: ControlPlane,
        repo: Repository,
        server_secret: bytes,
        subjects: Subjects | None = None,
        ops: OpsHandler | None = None,
        timings: LeaseTimings | None = None,
        heartbeat_s: float = 5.0,
        channels: dict[Channel, ChannelConfig] | None = None,
        connect_options: dict[str, Any] | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.cp = control_plane
        self.repo = repo
        self._secret = server_secret
        self.subjects = subjects or Subjects()
        self.ops = ops
        self.timings = timings or repo.timings
        self.heartbeat_s = heartbeat_s
        self.verifier = Verifier(server_secret, repo.clock, subjects=self.subjects)
        self._connect_options = dict(connect_options or {})
        cfg = channels or DEFAULT_CHANNELS
        self._channels = {ch: _ChannelState(ch, cfg[ch]) for ch in Channel}
        self._generations: dict[str, int] = {}
        self._uploads: dict[tuple[str, int, str], _Upload] = {}
        self._upload_dir = Path(tempfile.mkdtemp(prefix="fleetlease-uploads-"))
        self._object_store: Any = None
        self._events_nc: NatsClient | None = None
        self._stopping = False

    # --- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        handlers: dict[Channel, tuple[str, Callable[[Msg], Awaitable[bytes]]]] = {
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
                state.nc = await self._connect(f"fleetlease-server-{channel.value}")
                await state.nc.subscribe(
                    subject,
                    queue=queue_group(channel),
                    cb=self._dispatcher(state, handler),
                    pending_msgs_limit=state.config.pending_msgs,
                    pending_bytes_limit=state.config.pending_bytes,
                )
            self._events_nc = self._channels[Channel.OPS].nc
            self.cp.add_listener(self._publish_event)
        except Exception:
            await self.stop()
            raise
        log.info("server_started", prefix=self.subjects.prefix)

    async def _connect(self, name: str) -> NatsClient:
        async def on_error(exc: Exception) -> None:
            log.warning("nats_error", connection=name, error=str(exc) or type(exc).__name__)

        opts: dict[str, Any] = {
            "name": name,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "error_cb": on_error,
        }
        opts.update(self._connect_options)
        return await nats.connect(self.nats_url, **opts)

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop taking new requests, let in-flight ones finish (up to ``grace_s``),
        close the connections."""
        self._stopping = True
        for state in self._channels.values():
            if state.nc is not None and state.nc.is_connected:
                with contextlib.suppress(Exception):
                    for sub in list(state.nc._subs.values()):
                        await sub.unsubscribe()
        pending = [t for s in self._channels.values() for t in s.tasks]
        if pending:
            _, late = await asyncio.wait(pending, timeout=grace_s)
            for t in late:
                t.cancel()
        for state in self._channels.values():
            if state.nc is not None:
                with contextlib.suppress(Exception):
                    await state.nc.drain()
                state.nc = None
        for upload in self._uploads.values():
            with contextlib.suppress(OSError):
                upload.path.unlink()
        self._uploads.clear()
        with contextlib.suppress(OSError):
            self._upload_dir.rmdir()
        log.info("server_stopped")

    def stall(self, channel: Channel) -> None:
        """Hold every new request of ``channel`` until ``unstall`` (fault tests)."""
        self._channels[channel].gate.clear()

    def unstall(self, channel: Channel) -> None:
        self._channels[channel].gate.set()

    def handled(self, channel: Channel) -> int:
        return self._channels[channel].handled

    # --- dispatch ----------------------------------------------------------------
    def _dispatcher(
        self, state: _ChannelState, handler: Callable[[Msg], Awaitable[bytes]]
    ) -> Callable[[Msg], Awaitable[None]]:
        async def on_message(msg: Msg) -> None:
            assert state.sem is not None
            await state.sem.acquire()
            task = asyncio.create_task(self._serve_one(state, handler, msg))
            state.tasks.add(task)
            task.add_done_callback(state.tasks.discard)

        return on_message

    async def _serve_one(
        self, state: _ChannelState, handler: Callable[[Msg], Awaitable[bytes]], msg: Msg
    ) -> None:
        assert state.sem is not None
        try:
            await state.gate.wait()
            try:
                reply = await handler(msg)
            except (RepositoryError, wire.DecodeError, AuthError) as exc:
                reply = wire.error_reply(exc.code, exc.message)
            except Exception:
                log.exception("handler_failed", subject=msg.subject)
                reply = wire.error_reply("internal", "internal error")
            state.handled += 1
            if msg.reply:
                with contextlib.suppress(Exception):
                    await msg.respond(reply)
        finally:
            state.sem.release()

    async def _generation(self, host_id: str, presented: int) -> int | None:
        cached = self._generations.get(host_id)
        if cached is None or presented > cached:
            # Another server process may have registered a newer session.
            current = await self.repo.current_generation(host_id)
            if current is None:
                self._generations.pop(host_id, None)
                return None
            self._generations[host_id] = current
            return current
        return cached

    async def _host_message(self, msg: Msg) -> bytes:
        try:
            hs = self.subjects.parse_host_subject(msg.subject)
        except ValueError as exc:
            raise wire.DecodeError("bad_subject", str(exc)) from None
        expected = HOST_VERBS.get((hs.channel, hs.verb))
        if expected is None:
            raise wire.DecodeError("unknown_verb", f"unknown verb {hs.verb!r}")
        env = wire.decode(msg.data)
        if not isinstance(env.msg, expected):
            raise wire.DecodeError(
                "wrong_type", f"{hs.verb} expects {expected.TYPE}, got {env.msg.TYPE}"
            )
        if isinstance(env.msg, wire.Register):
            return await self._register(hs.host_id, env.msg)
        if env.auth is None:
            raise AuthError("message is not signed", reason="unsigned")
        if env.auth.host_id != hs.host_id:
            # Host A's session acting for host B: refused before anything of B is read.
            raise AuthError(
                "session does not belong to this host", reason="host_mismatch", code="forbidden"
            )
        generation = await self._generation(hs.host_id, env.auth.generation)
        self.verifier.verify_envelope(msg.subject, env, generation)
        session = Session(host_id=hs.host_id, generation=env.auth.generation)
        return await self._host_verb(session, env.msg)

    async def _register(self, host_id: str, m: wire.Register) -> bytes:
        if m.host_id != host_id:
            raise AuthError(
                "credentials are bound to another host", reason="host_mismatch", code="forbidden"
            )
        session = await self.cp.register(host_id, m.credential)
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

    async def _host_verb(self, s: Session, m: wire.Message) -> bytes:
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
            return wire.encode_reply(
                wire.ReconcileResult(
                    generation=report.generation,
                    verdicts=[
                        wire.Verdict(
                            task_id=v.task_id,
                            attempt=v.attempt,
                            verdict=v.verdict,
                            reason=v.reason,
                            cancel_requested=v.cancel_requested,
                            lease_expires_at=(
                                wire.to_unix(v.lease_expires_at) if v.lease_expires_at else None
                            ),
                        )
                        for v in report.verdicts
                    ],
                )
            )
        if isinstance(m, wire.Claim):
            claimed = await cp.claim(s, wait_s=m.wait_s, device_ids=m.devices)
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
            await self._artifact_commit(s, m)
            return wire.encode_reply(wire.Ok())
        raise wire.DecodeError("unknown_type", f"unexpected message {m.TYPE}")

    # --- artifacts -------------------------------------------------------------------
    async def _artifact_chunk(self, s: Session, m: wire.ArtifactChunk) -> None:
        key = (m.task_id, m.attempt, m.name)
        upload = self._uploads.get(key)
        if upload is None:
            if m.offset != 0:
                raise Conflict("the first artifact chunk must start at offset 0")
            fd, path = tempfile.mkstemp(dir=self._upload_dir)
            os.close(fd)
            upload = self._uploads[key] = _Upload(path=Path(path))
        if m.offset != upload.size:
            if m.offset < upload.size:
                return  # a retried chunk we already have
            raise Conflict(f"artifact chunk at offset {m.offset}, expected {upload.size}")
        if upload.size + len(m.data) > MAX_ARTIFACT_BYTES:
            raise Invalid("artifact too large", field="data")
        await asyncio.to_thread(_append, upload.path, m.data)
        upload.size += len(m.data)
        upload.digest.update(m.data)

    async def _artifact_commit(self, s: Session, m: wire.ArtifactCommit) -> None:
        key = (m.task_id, m.attempt, m.name)
        upload = self._uploads.get(key)
        if upload is None:
            if m.size == 0:
                fd, path = tempfile.mkstemp(dir=self._upload_dir)
                os.close(fd)
                upload = _Upload(path=Path(path))
            else:
                raise Conflict("no upload in progress for this artifact")
        try:
            if upload.size != m.size or upload.digest.hexdigest() != m.sha256:
                raise Conflict("artifact size or digest does not match the chunks received")
            object_name = f"{m.task_id}/{m.attempt}/{m.name}"
            store = await self._store()
            data = await asyncio.to_thread(upload.path.read_bytes)
            await store.put(object_name, data)
            await self.repo.record_artifact(
                s,
                m.task_id,
                m.attempt,
                name=m.name,
                size=m.size,
                sha256=m.sha256,
                object_name=object_name,
            )
        finally:
            self._uploads.pop(key, None)
            with contextlib.suppress(OSError):
                upload.path.unlink()

    async def _store(self) -> Any:
        if self._object_store is None:
            nc = self._channels[Channel.ARTIFACTS].nc
            assert nc is not None
            js = nc.jetstream()
            bucket = f"{ARTIFACT_BUCKET}-{self.subjects.prefix.replace('.', '-')}"
            try:
                self._object_store = await js.object_store(bucket)
            except Exception:
                self._object_store = await js.create_object_store(bucket)
        return self._object_store

    async def read_artifact(self, object_name: str) -> bytes:
        store = await self._store()
        result = await store.get(object_name)
        return bytes(result.data or b"")

    # --- ops and events ---------------------------------------------------------------
    async def _ops_message(self, msg: Msg) -> bytes:
        verb = self.subjects.parse_ops_subject(msg.subject)
        env = wire.decode(msg.data)
        if not isinstance(env.msg, wire.OpsRequest):
            raise wire.DecodeError("wrong_type", f"ops expects ops_request, got {env.msg.TYPE}")
        if env.msg.verb != verb:
            raise wire.DecodeError("wrong_verb", "verb does not match the subject", field="verb")
        if self.ops is None:
            raise Unavailable("the user API is not served here")
        data = await self.ops.handle(verb, env.msg.token, env.msg.args)
        return wire.encode_reply(wire.OpsReply(data=data))

    def _publish_event(self, event: dict[str, Any]) -> None:
        nc = self._events_nc
        if nc is None or self._stopping:
            return
        payload = msgpack.packb(event, default=str)
        task = asyncio.ensure_future(nc.publish(self.subjects.events_task(), payload))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)
