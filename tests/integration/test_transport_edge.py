"""The server's edge on a real nats-server: decoding, validation and session
checks, against a recording stub behind it.

These are the pure validation paths: each refused request must be refused
before the control plane or the repository is asked anything (the stubs record
every call), with the right typed code, and the server must keep answering.
The end-to-end behaviour with the real actors and PostgreSQL is in
``test_transport_e2e.py``.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgpack
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NatsClient

from fleetlease.ops.embedded import EmbeddedNats
from fleetlease.persistence.clock import ManualClock, SystemClock
from fleetlease.persistence.errors import Conflict, NotFound, Unauthorized
from fleetlease.persistence.model import LeaseStatus, LeaseTimings, Session, TaskState
from fleetlease.transport import wire
from fleetlease.transport.auth import Signer, session_key
from fleetlease.transport.server import ChannelConfig, Server
from fleetlease.transport.subjects import HOST_VERBS, Channel, Subjects
from tests.inbox import request as principal_request

pytestmark = pytest.mark.embedded

SECRET = secrets.token_bytes(32)
TASK = "0b4f6c1e-2a5d-4d0e-9a43-1f0c2b7e9d11"
CRED_A = "a" * 64
CRED_B = "b" * 64
TOKEN = "t" * 64


@dataclass
class Recorder:
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class StubRepo:
    """Only what the server itself asks of the repository."""

    def __init__(self, rec: Recorder, generations: dict[str, int]) -> None:
        self.rec = rec
        self.clock = SystemClock()
        self.timings = LeaseTimings()
        self.generations = generations
        self.nonces: set[tuple[str, bytes]] = set()

    async def record_nonces(self, entries: Any, *, timeout_s: Any = None) -> list[bool]:
        out = []
        for scope, nonce, _expires_at in entries:
            out.append((scope, nonce) not in self.nonces)
            self.nonces.add((scope, nonce))
        return out

    async def prune_nonces(self, before: Any, *, batch: int = 5000) -> int:
        return 0

    async def current_generation(self, host_id: str) -> int | None:
        self.rec.calls.append(("current_generation", host_id))
        return self.generations.get(host_id)

    async def append_logs(
        self, s: Session, task_id: str, attempt: int, first: int, lines: Any
    ) -> int:
        self.rec.calls.append(("append_logs", (s, task_id, attempt, first, list(lines))))
        return len(lines)

    async def record_artifact(self, s: Session, task_id: str, attempt: int, **kw: Any) -> None:
        self.rec.calls.append(("record_artifact", (s, task_id, attempt, kw)))


class StubControlPlane:
    """Records every call; answers like a control plane that accepts everything."""

    def __init__(self, rec: Recorder, repo: StubRepo) -> None:
        self.rec = rec
        self.repo = repo
        self.fail_with: BaseException | None = None

    def add_listener(self, listener: Any) -> None:
        pass

    async def register(self, host_id: str, credential: str) -> Session:
        self.rec.calls.append(("register", host_id))
        expected = {"ha": CRED_A, "hb": CRED_B}.get(host_id)
        if credential != expected:
            raise Unauthorized("unknown host or bad credential")
        gen = self.repo.generations.get(host_id, 0) + 1
        self.repo.generations[host_id] = gen
        return Session(host_id=host_id, generation=gen)

    async def heartbeat(
        self, s: Session, devices: Any, advert: Any = None, *, digest: Any = None
    ) -> None:
        self.rec.calls.append(("heartbeat", (s, devices)))
        if self.fail_with is not None:
            raise self.fail_with

    async def renew(self, s: Session, task_id: str, attempt: int, token: str) -> LeaseStatus:
        self.rec.calls.append(("renew", (s, task_id, attempt)))
        return LeaseStatus(
            task_id=task_id,
            attempt=attempt,
            state=TaskState.RUNNING,
            lease_expires_at=datetime.now(UTC) + timedelta(seconds=30),
            cancel_requested=False,
        )

    async def claim(self, s: Session, *, wait_s: float, device_ids: Any = ()) -> None:
        self.rec.calls.append(("claim", (s, wait_s)))
        return None

    def __getattr__(self, name: str) -> Any:
        async def refuse(*args: Any, **kw: Any) -> Any:
            self.rec.calls.append((name, args))
            raise NotFound("stub")

        return refuse


@dataclass
class Edge:
    server: Server
    nc: NatsClient
    subjects: Subjects
    rec: Recorder
    repo: StubRepo
    cp: StubControlPlane

    async def raw(self, subject: str, data: bytes, timeout: float = 10.0) -> wire.Message:
        reply = await principal_request(self.nc, self.subjects, subject, data, timeout)
        return wire.decode(reply.data).msg

    async def code(self, subject: str, data: bytes) -> str:
        msg = await self.raw(subject, data)
        assert isinstance(msg, wire.Error), msg
        return msg.code

    def signer(self, host_id: str, generation: int, *, clock: Any = None) -> Signer:
        return Signer(host_id, generation, session_key(SECRET, host_id, generation), clock=clock)

    async def alive(self) -> None:
        """A normal request still gets its normal answer."""
        s = self.signer("ha", self.repo.generations["ha"])
        subject = self.subjects.heartbeat("ha")
        msg = await self.raw(subject, s.seal(subject, wire.Heartbeat(devices=[])))
        assert isinstance(msg, wire.Ok), msg


async def _edge(nats_url: str, prefix: str, **server_kw: Any) -> AsyncIterator[Edge]:
    rec = Recorder()
    repo = StubRepo(rec, {"ha": 1, "hb": 1})
    cp = StubControlPlane(rec, repo)
    server = Server(
        nats_url=nats_url,
        control_plane=cp,  # type: ignore[arg-type]
        repo=repo,  # type: ignore[arg-type]
        server_secret=SECRET,
        subjects=Subjects(prefix),
        **server_kw,
    )
    await server.start()
    nc = await nats.connect(nats_url)
    try:
        yield Edge(server, nc, Subjects(prefix), rec, repo, cp)
    finally:
        await nc.close()
        await server.stop()


@pytest.fixture
async def edge(nats_url: str, subject_prefix: str) -> AsyncIterator[Edge]:
    async for e in _edge(nats_url, subject_prefix):
        yield e


def all_host_subjects(s: Subjects, host_id: str = "ha") -> list[str]:
    return [s.host(host_id, ch, verb) for ch, verbs in HOST_VERBS.items() for verb in sorted(verbs)]


def all_subjects(s: Subjects) -> list[str]:
    return [*all_host_subjects(s), s.ops("alice", "whoami"), s.ops("alice", "submit")]


def envelope(t: Any, body: Any, auth: Any = None, v: Any = 1) -> bytes:
    env: dict[str, Any] = {"v": v, "t": t, "b": msgpack.packb(body, use_bin_type=True)}
    if auth is not None:
        env["a"] = auth
    return bytes(msgpack.packb(env, use_bin_type=True))


# --- malformed input ------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00\xff garbage",
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"v": 1}),
        msgpack.packb({"v": 2, "t": "heartbeat", "b": b"\x80"}),
        msgpack.packb({"v": 1, "t": "heartbeat", "b": b"\x80\x80"}),  # trailing data
        msgpack.packb({"v": 1, "t": "heartbeat", "b": "not bytes"}),
        msgpack.packb({"v": True, "t": "heartbeat", "b": b"\x80"}),
        bytes(msgpack.packb({"v": 1, "t": "heartbeat", "b": b"\x80"}))[:-1],
    ],
    ids=lambda d: d[:12].hex() or "empty",
)
async def test_garbage_on_every_subject_is_bad_request_and_changes_nothing(
    edge: Edge, data: bytes
) -> None:
    for subject in all_subjects(edge.subjects):
        assert await edge.code(subject, data) == "bad_request", subject
    assert edge.rec.calls == []
    await edge.alive()


async def test_unknown_type_and_wrong_type_for_the_verb_are_bad_request(edge: Edge) -> None:
    signer = edge.signer("ha", 1)
    for subject in all_subjects(edge.subjects):
        assert await edge.code(subject, envelope("no_such_type", {})) == "bad_request"
        # A well-formed, correctly signed message of another verb's type.
        wrong: wire.Message = (
            wire.Ack(task_id=TASK, attempt=1, lease_token=TOKEN)
            if not subject.endswith(".ack")
            else wire.Renew(task_id=TASK, attempt=1, lease_token=TOKEN)
        )
        assert await edge.code(subject, signer.seal(subject, wrong)) == "bad_request", subject
        # Reply types are not requests either.
        assert await edge.code(subject, wire.encode(wire.Ok())) == "bad_request", subject
    assert [n for n in edge.rec.names() if n != "current_generation"] == []
    await edge.alive()


@pytest.mark.parametrize(
    ("msg_type", "body"),
    [
        ("register", {"host_id": "ha"}),
        ("register", {"credential": CRED_A}),
        ("heartbeat", {"devices": [{"state": "idle"}]}),
        ("heartbeat", {"devices": [{"device_id": "d1", "state": "melting"}]}),
        ("heartbeat", {"devices": "d1"}),
        ("claim", {"wait_s": "soon"}),
        ("claim", {"wait_s": 61}),
        ("ack", {"task_id": TASK, "attempt": 1}),
        ("renew", {"task_id": "not-a-uuid", "attempt": 1, "lease_token": TOKEN}),
        ("renew", {"task_id": TASK, "attempt": True, "lease_token": TOKEN}),
        ("progress", {"task_id": TASK, "attempt": 1, "lease_token": TOKEN}),
        ("result", {"task_id": TASK, "attempt": 1, "lease_token": TOKEN, "outcome": "done"}),
        ("result", {"task_id": TASK, "attempt": 0, "lease_token": TOKEN, "outcome": "done",
                    "fingerprint": "f"}),
        ("cancel_poll", {"task_id": TASK, "lease_token": TOKEN}),
        ("log_append", {"task_id": TASK, "attempt": 1}),
        ("log_append", {"task_id": TASK, "attempt": 1, "first_seq": 0, "lines": ["x" * 9000]}),
        ("artifact_chunk", {"task_id": TASK, "attempt": 1, "lease_token": TOKEN, "name": "a",
                            "offset": 0}),
        ("artifact_chunk", {"task_id": TASK, "attempt": 1, "lease_token": TOKEN, "name": "a",
                            "offset": 0,
                            "data": b"x" * (256 * 1024 + 1)}),
        ("artifact_commit", {"task_id": TASK, "attempt": 1, "lease_token": TOKEN, "name": "a",
                             "size": 1,
                             "sha256": "XYZ"}),
    ],
)  # fmt: skip
async def test_missing_or_ill_typed_fields_are_bad_request(
    edge: Edge, msg_type: str, body: dict[str, Any]
) -> None:
    verb = {"log_append": "append", "artifact_chunk": "chunk", "artifact_commit": "commit"}
    subject = next(
        s
        for s in all_host_subjects(edge.subjects)
        if s.endswith("." + verb.get(msg_type, msg_type))
    )
    # Signed properly, so that only the body can be at fault.
    signer = edge.signer("ha", 1)
    raw_body = bytes(msgpack.packb(body, use_bin_type=True))
    auth = signer.auth(subject, msg_type, raw_body).to_map()
    data = bytes(msgpack.packb({"v": 1, "t": msg_type, "b": raw_body, "a": auth}))
    assert await edge.code(subject, data) == "bad_request"
    assert edge.rec.calls == []
    await edge.alive()


async def test_text_bound_for_postgresql_with_nul_is_bad_request(edge: Edge) -> None:
    signer = edge.signer("ha", 1)
    hb = edge.subjects.heartbeat("ha")
    bad_caps = wire.Heartbeat(
        devices=[wire.Device(device_id="d1", capabilities={"os": "and\x00roid"})]
    )
    assert await edge.code(hb, signer.seal(hb, bad_caps)) == "bad_request"
    twice = wire.Heartbeat(devices=[wire.Device(device_id="d1"), wire.Device(device_id="d1")])
    assert await edge.code(hb, signer.seal(hb, twice)) == "bad_request"
    res = edge.subjects.result("ha")
    bad_result = wire.Result(
        task_id=TASK,
        attempt=1,
        lease_token=TOKEN,
        outcome=wire.Outcome.DONE,
        result={"k\x00": 1},
        fingerprint="f",
    )
    assert await edge.code(res, signer.seal(res, bad_result)) == "bad_request"
    for subject, msg in (
        (edge.subjects.renew("ha"), wire.Renew),
        (edge.subjects.ack("ha"), wire.Ack),
        (edge.subjects.cancel_poll("ha"), wire.CancelPoll),
    ):
        bad_token = msg(task_id=TASK, attempt=1, lease_token="to\x00ken")
        assert await edge.code(subject, signer.seal(subject, bad_token)) == "bad_request"
    assert [n for n in edge.rec.names() if n != "current_generation"] == []
    await edge.alive()


async def test_log_lines_with_nul_are_stored_with_a_replacement_character(edge: Edge) -> None:
    signer = edge.signer("ha", 1)
    subject = edge.subjects.log_append("ha")
    msg = wire.LogAppend(task_id=TASK, attempt=1, first_seq=0, lines=["a\x00b"])
    assert isinstance(await edge.raw(subject, signer.seal(subject, msg)), wire.Ok)
    (call,) = [c for c in edge.rec.calls if c[0] == "append_logs"]
    assert call[1][4] == ["a\ufffdb"]


# hypothesis: arbitrary msgpack values, arbitrary envelopes of every known type.

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=40),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=10), st.sampled_from(
            ["task_id", "attempt", "lease_token", "devices", "device_id", "state", "wait_s",
             "seq", "outcome", "fingerprint", "lines", "first_seq", "name", "offset", "data",
             "size", "sha256", "host_id", "credential", "token", "verb", "args", "entries"])),
            inner, max_size=6),
    ),
    max_leaves=12,
)  # fmt: skip
_types = st.sampled_from(sorted(wire.MESSAGE_TYPES)) | st.text(max_size=12)


@st.composite
def _messages(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return bytes(msgpack.packb(draw(_values), use_bin_type=True))
    auth = draw(
        st.none()
        | st.fixed_dictionaries(
            {
                "h": st.sampled_from(["ha", "hb", "zz"]),
                "g": st.integers(0, 3),
                "ts": st.integers(0, 2**63 - 1),
                "n": st.binary(min_size=16, max_size=16),
                "s": st.binary(min_size=32, max_size=32),
            }
        )
        | _values
    )
    body = draw(_values if kind == 1 else st.dictionaries(st.text(max_size=8), _values))
    return envelope(draw(_types), body, auth, v=draw(st.sampled_from([1, 1, 1, 0, 2, "1"])))


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=_messages(), pick=st.integers(min_value=0))
async def test_hypothesis_messages_on_every_subject_get_a_typed_refusal(
    edge: Edge, data: bytes, pick: int
) -> None:
    subjects = all_subjects(edge.subjects)
    subject = subjects[pick % len(subjects)]
    msg = await edge.raw(subject, data)
    # Random bytes cannot carry a valid session signature or a credential.
    assert isinstance(msg, wire.Error), msg
    assert msg.code in {"bad_request", "unauthorized", "forbidden", "unavailable"}, msg
    assert [n for n in edge.rec.names() if n not in ("current_generation", "register")] == []


_VERB_TYPE = {
    "register": "register", "heartbeat": "heartbeat", "reconcile": "reconcile",
    "claim": "claim", "ack": "ack", "renew": "renew", "progress": "progress",
    "result": "result", "cancel_poll": "cancel_poll", "append": "log_append",
    "chunk": "artifact_chunk", "commit": "artifact_commit",
}  # fmt: skip


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    body=st.dictionaries(
        st.sampled_from(
            [
                "task_id",
                "attempt",
                "lease_token",
                "devices",
                "wait_s",
                "seq",
                "outcome",
                "fingerprint",
                "lines",
                "first_seq",
                "name",
                "offset",
                "data",
                "size",
                "sha256",
                "entries",
                "result",
                "reason",
                "retryable",
                "message",
            ]
        ),
        _values,
        max_size=8,
    ),
    pick=st.integers(min_value=0),
)
async def test_hypothesis_bodies_correctly_signed_are_refused_as_bad_request_or_served(
    edge: Edge, body: dict[str, Any], pick: int
) -> None:
    subjects = [s for s in all_host_subjects(edge.subjects) if not s.endswith(".register")]
    subject = subjects[pick % len(subjects)]
    msg_type = _VERB_TYPE[subject.rsplit(".", 1)[1]]
    raw_body = bytes(msgpack.packb(body, use_bin_type=True))
    auth = edge.signer("ha", 1).auth(subject, msg_type, raw_body).to_map()
    before = [n for n in edge.rec.names() if n != "current_generation"]
    reply = await edge.raw(subject, envelope_raw(msg_type, raw_body, auth))
    after = [n for n in edge.rec.names() if n != "current_generation"]
    if isinstance(reply, wire.Error):
        # bad_request before anything is called; not_found is the stub's own answer.
        assert reply.code in {"bad_request", "not_found"}, reply
        if reply.code == "bad_request":
            assert after == before
    # Anything else is a normal reply to a body that happened to be valid.


def envelope_raw(t: str, raw_body: bytes, auth: Any) -> bytes:
    env = {"v": 1, "t": t, "b": raw_body, "a": auth}
    return bytes(msgpack.packb(env, use_bin_type=True))


async def test_server_keeps_serving_after_the_hypothesis_run(edge: Edge) -> None:
    for _ in range(3):
        for subject in all_subjects(edge.subjects):
            await edge.raw(subject, os.urandom(64))
    await edge.alive()


# --- oversize --------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_nats(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A nats-server whose payload limit is above ours, so that an oversize
    message reaches the server at all (a default server refuses it earlier)."""
    d: Path = tmp_path_factory.mktemp("big-nats")
    conf = d / "nats.conf"
    conf.write_text("max_payload: 4194304\n")
    server = EmbeddedNats(d, extra_args=["-c", str(conf)])
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


async def test_oversize_payload_is_bad_request_and_server_keeps_serving(
    big_nats: str, subject_prefix: str
) -> None:
    async for e in _edge(big_nats, subject_prefix):
        assert e.nc.max_payload > wire.MAX_MESSAGE_SIZE
        signer = e.signer("ha", 1)
        for subject in all_subjects(e.subjects):
            data = envelope("heartbeat", {"pad": b"x" * (wire.MAX_MESSAGE_SIZE + 1)})
            assert await e.code(subject, data) == "bad_request"
            padded = signer.seal(
                subject,
                wire.Heartbeat(devices=[wire.Device(device_id="d", capabilities={"p": "x" * 100})]),
            )
            big = padded + b"\x00" * (wire.MAX_MESSAGE_SIZE + 1 - len(padded))
            assert await e.code(subject, big) == "bad_request"
        assert e.rec.calls == []
        await e.alive()


# --- authentication --------------------------------------------------------------


async def test_unsigned_forged_stale_and_unknown_are_unauthorized(edge: Edge) -> None:
    hb = edge.subjects.heartbeat("ha")
    msg = wire.Heartbeat(devices=[wire.Device(device_id="d1")])
    # Unsigned.
    assert await edge.code(hb, wire.encode(msg)) == "unauthorized"
    # Forged: right host and generation, wrong key.
    forged = Signer("ha", 1, secrets.token_bytes(32))
    assert await edge.code(hb, forged.seal(hb, msg)) == "unauthorized"
    # Stale and future timestamps, with the right key.
    past = ManualClock(datetime.now(UTC) - timedelta(minutes=5))
    assert await edge.code(hb, edge.signer("ha", 1, clock=past).seal(hb, msg)) == "unauthorized"
    future = ManualClock(datetime.now(UTC) + timedelta(minutes=5))
    assert await edge.code(hb, edge.signer("ha", 1, clock=future).seal(hb, msg)) == "unauthorized"
    # Unknown host, signing with a key it cannot have and with one it could derive.
    zz = edge.subjects.heartbeat("zz")
    assert await edge.code(zz, Signer("zz", 1, secrets.token_bytes(32)).seal(zz, msg)) == (
        "unauthorized"
    )
    assert await edge.code(zz, edge.signer("zz", 1).seal(zz, msg)) == "unauthorized"
    assert "heartbeat" not in edge.rec.names()
    # Only the one correctly signed message for an unknown host reached the
    # database, to learn that the host does not exist.
    assert edge.rec.names() == ["current_generation"]
    await edge.alive()


async def test_replayed_message_is_unauthorized_and_applied_once(edge: Edge) -> None:
    hb = edge.subjects.heartbeat("ha")
    data = edge.signer("ha", 1).seal(hb, wire.Heartbeat(devices=[]))
    assert isinstance(await edge.raw(hb, data), wire.Ok)
    assert await edge.code(hb, data) == "unauthorized"
    assert edge.rec.names().count("heartbeat") == 1
    await edge.alive()


async def test_superseded_generation_is_unauthorized(edge: Edge) -> None:
    reg = edge.subjects.register("ha")
    ok = await edge.raw(reg, wire.encode(wire.Register(host_id="ha", credential=CRED_A)))
    assert isinstance(ok, wire.RegisterOk) and ok.generation == 2
    assert ok.session_key == session_key(SECRET, "ha", 2)
    hb = edge.subjects.heartbeat("ha")
    old = edge.signer("ha", 1).seal(hb, wire.Heartbeat(devices=[]))
    assert await edge.code(hb, old) == "unauthorized"
    assert "heartbeat" not in edge.rec.names()
    new = Signer("ha", 2, ok.session_key).seal(hb, wire.Heartbeat(devices=[]))
    assert isinstance(await edge.raw(hb, new), wire.Ok)


async def test_bad_credential_and_credential_for_another_host_are_refused(edge: Edge) -> None:
    reg_a = edge.subjects.register("ha")
    bad = wire.encode(wire.Register(host_id="ha", credential="c" * 64))
    assert await edge.code(reg_a, bad) == "unauthorized"
    # B's credential sent on A's register subject: refused before B is looked up.
    cross = wire.encode(wire.Register(host_id="hb", credential=CRED_B))
    assert await edge.code(reg_a, cross) == "forbidden"
    assert edge.rec.names() == ["register"]
    assert edge.repo.generations == {"ha": 1, "hb": 1}


async def test_host_a_acting_for_host_b_is_forbidden_before_b_is_read(edge: Edge) -> None:
    signer_a = edge.signer("ha", 1)
    for subject in all_host_subjects(edge.subjects, "hb"):
        if subject.endswith(".register"):
            continue
        # A signs honestly (auth host "ha") but sends on B's subject...
        data = _retype_for(subject, signer_a)
        assert await edge.code(subject, data) == "forbidden", subject
    assert edge.rec.calls == []  # nothing of B (or anyone) was read
    # ... or claims to be B in the auth map: the signature cannot verify.
    hb_b = edge.subjects.heartbeat("hb")
    posing = Signer("hb", 1, session_key(SECRET, "ha", 1)).seal(hb_b, wire.Heartbeat(devices=[]))
    assert await edge.code(hb_b, posing) == "unauthorized"
    assert edge.rec.calls == []
    await edge.alive()


def _retype_for(subject: str, signer: Signer) -> bytes:
    """A valid message of the subject's own type, signed by ``signer``."""
    verb = subject.rsplit(".", 1)[1]
    lease = {"task_id": TASK, "attempt": 1, "lease_token": TOKEN}
    msg: wire.Message = {
        "heartbeat": wire.Heartbeat(devices=[]),
        "reconcile": wire.Reconcile(entries=[]),
        "claim": wire.Claim(wait_s=0),
        "ack": wire.Ack(**lease),
        "renew": wire.Renew(**lease),
        "progress": wire.Progress(**lease, seq=1),
        "result": wire.Result(**lease, outcome=wire.Outcome.DONE, fingerprint="f"),
        "cancel_poll": wire.CancelPoll(**lease),
        "append": wire.LogAppend(task_id=TASK, attempt=1, first_seq=0, lines=["x"]),
        "chunk": wire.ArtifactChunk(
            task_id=TASK, attempt=1, lease_token=TOKEN, name="a", offset=0, data=b"x"
        ),
        "commit": wire.ArtifactCommit(
            task_id=TASK, attempt=1, lease_token=TOKEN, name="a", size=1, sha256="0" * 64
        ),
    }[verb]
    return signer.seal(subject, msg)


# --- errors from behind the edge --------------------------------------------------


async def test_errors_from_the_control_plane_are_typed_and_unexpected_ones_are_internal(
    edge: Edge,
) -> None:
    hb = edge.subjects.heartbeat("ha")
    signer = edge.signer("ha", 1)
    edge.cp.fail_with = Conflict("stale")
    assert await edge.code(hb, signer.seal(hb, wire.Heartbeat())) == "conflict"
    edge.cp.fail_with = RuntimeError("boom")
    assert await edge.code(hb, signer.seal(hb, wire.Heartbeat())) == "internal"
    edge.cp.fail_with = Unauthorized("revoked")
    assert await edge.code(hb, signer.seal(hb, wire.Heartbeat())) == "unauthorized"
    edge.cp.fail_with = None
    # The Unauthorized made the server forget its cached generation: it asks again.
    before = edge.rec.names().count("current_generation")
    await edge.alive()
    assert edge.rec.names().count("current_generation") == before + 1


async def test_a_claim_without_a_free_long_poll_slot_is_answered_without_waiting(
    nats_url: str, subject_prefix: str
) -> None:
    channels = {Channel.JOBS: ChannelConfig(workers=4, long_poll=1)}
    async for e in _edge(nats_url, subject_prefix, channels=channels):
        signer = e.signer("ha", 1)
        claim = e.subjects.claim("ha")
        replies = await asyncio.gather(
            *(e.raw(claim, signer.seal(claim, wire.Claim(wait_s=5))) for _ in range(3))
        )
        assert all(isinstance(r, wire.NoWork) for r in replies)
        waits = sorted(c[1][1] for c in e.rec.calls if c[0] == "claim")
        assert waits == [0.0, 0.0, 5.0]


async def test_unknown_ops_verb_and_subject_outside_the_tree_are_bad_request(edge: Edge) -> None:
    req = wire.encode(wire.OpsRequest(token="x", verb="whoami"))
    assert await edge.code(edge.subjects.ops("alice", "submit"), req) == "bad_request"
    # No user API behind this server: a well-formed request is 'unavailable'.
    assert await edge.code(edge.subjects.ops("alice", "whoami"), req) == "unavailable"
    # A host subject with a verb the channel does not have.
    bogus = f"{edge.subjects.prefix}.host.ha.jobs.explode"
    assert await edge.code(bogus, wire.encode(wire.Heartbeat())) == "bad_request"
    assert edge.rec.calls == []


async def test_stop_finishes_requests_in_flight(nats_url: str, subject_prefix: str) -> None:
    gen = _edge(nats_url, subject_prefix)
    e = await gen.__anext__()
    try:
        e.server.stall(Channel.CONTROL)
        hb = e.subjects.heartbeat("ha")
        signer = e.signer("ha", 1)
        pending = [
            asyncio.ensure_future(e.raw(hb, signer.seal(hb, wire.Heartbeat()))) for _ in range(5)
        ]
        await _until(lambda: e.server.received(Channel.CONTROL) == 5)
        await e.server.stop()
        replies = await asyncio.gather(*pending)
        assert all(isinstance(r, wire.Ok) for r in replies)
        assert e.rec.names().count("heartbeat") == 5
    finally:
        await gen.aclose()


async def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
