"""The host verbs (register, heartbeat, reconcile, claim, ack, renew, progress,
result, cancel_poll, log append, artifact chunk and commit) and the gate every
host request passes before one of them runs.

A host request reaches ``HostHandlers.handle`` once the server has checked its
reply subject and admitted it (steps 0 of the gate, ``transport/server.py``).
The rest of the gate, in this order; a request is refused at the first check it
fails (typed ``Error{code, message}`` reply, nothing read or written past that
point):

1. the subject parses as one of ours and names a known verb (``bad_request``);
2. the bytes decode as exactly one envelope of the verb's message type, within
   the size and field limits, with no NUL characters in text bound for
   PostgreSQL (``bad_request``);
3. Register aside, the message is signed and the signing host is the host the
   subject names (``unauthorized`` / ``forbidden``: host A's session can never
   act for host B, and nothing of B is read before this check);
4. the signature, its timestamp and its nonce verify against the session key of
   the presented generation, without touching the database, and the nonce was
   not seen by this process (``unauthorized``);
5. the presented generation is the host's current one (``unauthorized``); a
   per-process cache answers the common case, the database the rest, and the
   repository re-checks it inside every transaction anyway (so the cache can be
   stale in one direction only: towards asking the repository, which refuses);
6. the nonce was not seen by any control-plane process: it is recorded in the
   database (``transport/replay.py``; ``unauthorized`` for a replay,
   ``unavailable`` when the database cannot say).

Only then is the request handed to the actor system (``actors.runtime.ControlPlane``)
or, for logs and artifacts, to the repository and ``transport/artifacts.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import structlog
from nats.aio.msg import Msg

from fleetlease.persistence.errors import Unauthorized
from fleetlease.persistence.model import (
    DeviceSnapshot,
    HostAdvert,
    JournalEntry,
    LeaseTimings,
    Session,
)
from fleetlease.transport import wire
from fleetlease.transport.artifacts import Artifacts
from fleetlease.transport.auth import AuthError, Verifier, session_key
from fleetlease.transport.broker_auth import open_register_proof
from fleetlease.transport.clip import MAX_MESSAGE_CHARS, clip, clip_repr
from fleetlease.transport.replay import SharedReplay, register_scope
from fleetlease.transport.subjects import Channel, Subjects

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

_INT64_MAX = 2**63 - 1
#: What an unknown host's register proof is checked against (never matches).
_DUMMY_HASH = hashlib.sha256(b"fleetlease: no such host").digest()


class ControlPlaneLike(Protocol):
    """What the server needs of ``actors.runtime.ControlPlane``. Every method
    raises a ``RepositoryError`` (typed reply) on refusal."""

    async def register(self, host_id: str, credential: str) -> Session: ...

    async def heartbeat(
        self,
        session: Session,
        devices: list[DeviceSnapshot],
        advert: HostAdvert | None = None,
        *,
        digest: str | None = None,
    ) -> Any: ...

    async def heartbeat_unchanged(self, session: Session, digest: str) -> Any: ...

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


def reject_nul(root: object, name: str) -> None:
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


#: The periodic host messages, whose replay check may wait a few milliseconds
#: to share its statement (``transport/replay.py``); no answer to them is
#: needed within milliseconds (a lease is tens of seconds long).
_PERIODIC: frozenset[type[wire.Message]] = frozenset(
    {wire.Heartbeat, wire.Renew, wire.Progress, wire.CancelPoll, wire.LogAppend}
)

#: Host messages of exactly (task_id, attempt, lease_token).
_LEASE_MESSAGES: frozenset[type[wire.Message]] = frozenset({wire.Ack, wire.Renew, wire.CancelPoll})


class HostHandlers:
    """Answers the requests of the host channels (control, jobs, logs,
    artifacts): the gate, then the verb, through the control plane
    (``ControlPlaneLike``), the repository or the artifacts. Keeps a
    per-process cache of each host's current session generation.
    ``stopping()`` says whether the server is stopping (claims then do not
    wait)."""

    def __init__(
        self,
        *,
        control_plane: ControlPlaneLike,
        repo: Repository,
        subjects: Subjects,
        verifier: Verifier,
        replay: SharedReplay,
        server_secret: bytes,
        timings: LeaseTimings,
        heartbeat_s: float,
        artifacts: Artifacts,
        stopping: Callable[[], bool],
    ) -> None:
        self.cp = control_plane
        self.repo = repo
        self.subjects = subjects
        self.verifier = verifier
        self.replay = replay
        self._secret = server_secret
        self.timings = timings
        self.heartbeat_s = heartbeat_s
        self.artifacts = artifacts
        self._stopping = stopping
        self._generations: dict[str, int] = {}

    async def handle(self, msg: Msg, may_wait: bool) -> bytes:
        try:
            hs = self.subjects.parse_host_subject(msg.subject)
        except ValueError as exc:
            # The subject is the sender's: quoted clipped.
            raise wire.DecodeError("bad_subject", clip(exc, MAX_MESSAGE_CHARS)) from None
        expected = HOST_VERBS.get((hs.channel, hs.verb))
        if expected is None:
            raise wire.DecodeError("unknown_verb", f"unknown verb {clip_repr(hs.verb)}")
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
        # The last check, as it writes a row: once any process accepted the
        # message, every process refuses it here.
        await self.replay.check(hs.host_id, auth.nonce, auth.ts_ms, urgent=type(m) not in _PERIODIC)
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
            # A canonical UUID, an int and the token: only the token can hold one,
            # so the general walk below (which re-encodes the message) is skipped.
            if "\x00" in m.lease_token:  # type: ignore[attr-defined]
                raise wire.DecodeError("nul_character", f"{m.TYPE} contains a NUL character")
            return m
        if isinstance(m, wire.ArtifactChunk):
            reject_nul([m.name, m.lease_token], m.TYPE)
            return m
        if isinstance(m, wire.Heartbeat):
            seen: set[str] = set()
            for i, d in enumerate(m.devices):
                if d.device_id in seen:
                    raise wire.DecodeError(
                        "duplicate", f"devices[{i}].device_id is repeated", field="devices"
                    )
                seen.add(d.device_id)
        reject_nul(m.to_body(), m.TYPE)
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
        """The credential inside a Register proof (the credential never crosses
        the wire). Timestamp window first, then the stored hash (read
        only; an unknown or revoked host is checked against a dummy hash, so it
        costs the same), then the replay checks (this process's, then every
        process's). The repository re-checks the recovered credential in
        constant time in the registering transaction."""
        assert m.proof is not None and m.ts_ms is not None and m.nonce is not None
        self.verifier.check_register_fresh(m.ts_ms)
        stored = await self.repo.host_credential_hash(host_id)
        credential = open_register_proof(
            stored if stored is not None else _DUMMY_HASH, host_id, m.ts_ms, m.nonce, m.proof
        )
        if stored is None or credential is None:
            raise Unauthorized("invalid host credentials")
        self.verifier.remember_register(host_id, m.nonce, m.ts_ms)
        await self.replay.check(register_scope(host_id), m.nonce, m.ts_ms)
        return credential

    async def _host_verb(self, s: Session, m: wire.Message, may_wait: bool) -> bytes:
        cp = self.cp
        if isinstance(m, wire.Heartbeat):
            if m.unchanged:
                assert m.digest is not None  # the decoder checked it
                await cp.heartbeat_unchanged(s, m.digest)
                return wire.encode_reply(wire.Ok())
            await cp.heartbeat(
                s,
                [
                    DeviceSnapshot(
                        device_id=d.device_id, state=d.state, capabilities=d.capabilities
                    )
                    for d in m.devices
                ],
                HostAdvert(
                    workflows=None if m.workflows is None else tuple(m.workflows),
                    goal_runner=m.goal_runner,
                ),
                digest=m.digest,
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
            self.artifacts.purge_staged((e.host_id, e.task_id, e.attempt) for e in report.lost)
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
            wait_s = m.wait_s if may_wait and not self._stopping() else 0.0
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
            await self.artifacts.chunk(s, m)
            return wire.encode_reply(wire.Ok())
        if isinstance(m, wire.ArtifactCommit):
            with self.artifacts.staging.host_slot(s.host_id):
                await self.artifacts.commit(s, m)
            return wire.encode_reply(wire.Ok())
        raise wire.DecodeError("unknown_type", f"unexpected message {m.TYPE}")
