"""The transport end to end: a real ``ControlPlaneService`` (actors, repository,
PostgreSQL, NATS server handlers) in-process under a test prefix, driven by the
real ``HostClient`` and, for attacks, by a raw nats-py client.

Every refused request is checked three ways: the typed error code, a snapshot
of the relevant tables taken before and after (nothing changed), and a normal
request afterwards (the server keeps serving).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgpack
import nats
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NatsClient

from fleetlease.ops.service import ControlPlaneService
from fleetlease.persistence.clock import ManualClock
from fleetlease.persistence.errors import NotFound
from fleetlease.persistence.model import LeaseTimings, TaskKind, TaskSpec, User
from fleetlease.transport import wire
from fleetlease.transport.auth import Signer
from fleetlease.transport.client import HostClient
from fleetlease.transport.server import HOST_VERBS as VERB_TYPES
from fleetlease.transport.server import Server
from fleetlease.transport.subjects import HOST_VERBS, Channel, Subjects
from tests.inbox import request as principal_request

pytestmark = pytest.mark.embedded

ADMIN = User(name="admin", platform_admin=True)
TABLES = ("hosts", "devices", "tasks", "attempts", "device_reservations", "log_lines", "artifacts")


async def until(cond: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    """Wait for ``cond`` to hold, checking often; fail after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await cond():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@dataclass
class Host:
    host_id: str
    credential: str
    client: HostClient
    ok: wire.RegisterOk

    def signer(self, clock: Any = None) -> Signer:
        return Signer(self.host_id, self.ok.generation, self.ok.session_key, clock=clock)


class System:
    def __init__(self, svc: ControlPlaneService, nats_url: str, nc: NatsClient) -> None:
        self.svc = svc
        self.nats_url = nats_url
        self.nc = nc
        self.subjects = Subjects(svc.prefix)
        self.hosts: list[Host] = []

    @property
    def repo(self) -> Any:
        return self.svc.repo

    @property
    def cp(self) -> Any:
        return self.svc.control_plane

    @property
    def server(self) -> Any:
        return self.svc.server

    async def host(self, host_id: str, devices: int = 2, **client_kw: Any) -> Host:
        cred = await self.repo.add_host(host_id)
        client = HostClient(
            nats_url=self.nats_url, host_id=host_id, credential=cred, prefix=self.svc.prefix,
            **client_kw,
        )  # fmt: skip
        await client.connect()
        ok = await client.register()
        await client.heartbeat(
            [
                wire.Device(device_id=f"{host_id}-d{i}", capabilities={"os": "sim"})
                for i in range(devices)
            ]
        )
        h = Host(host_id, cred, client, ok)
        self.hosts.append(h)
        return h

    async def submit(self, n: int = 1, **kw: Any) -> list[str]:
        return [
            await self.cp.submit(TaskSpec(kind=TaskKind.GOAL, goal="g", payload={"i": i}, **kw))
            for i in range(n)
        ]

    async def assigned_to(self, host_id: str, n: int = 1) -> None:
        async def ready() -> bool:
            return len(await self.repo.pending_assignments(host_id)) >= n

        await until(ready)

    async def running(self, host: Host) -> wire.Assignment:
        """Submit one task, claim it and ack it."""
        await self.submit()
        a = await host.client.claim(wait_s=30)
        assert a is not None
        await host.client.ack(a.task_id, a.attempt, a.lease_token)
        return a

    async def snapshot(self) -> dict[str, list[tuple[Any, ...]]]:
        assert self.svc.engine is not None
        out: dict[str, list[tuple[Any, ...]]] = {}
        async with self.svc.engine.connect() as conn:
            for table in TABLES:
                rows = (await conn.execute(sa.text(f"SELECT * FROM {table}"))).all()
                out[table] = sorted((tuple(r) for r in rows), key=repr)
        return out

    async def raw(self, subject: str, data: bytes) -> wire.Message:
        reply = await principal_request(self.nc, self.subjects, subject, data, 15)
        return wire.decode(reply.data).msg

    async def code(self, subject: str, data: bytes) -> str:
        msg = await self.raw(subject, data)
        assert isinstance(msg, wire.Error), msg
        return msg.code

    async def refused_without_change(self, subject: str, data: bytes, *codes: str) -> None:
        before = await self.snapshot()
        code = await self.code(subject, data)
        assert code in codes, (subject, code)
        assert await self.snapshot() == before, subject

    async def alive(self, host: Host) -> None:
        await host.client.heartbeat([wire.Device(device_id=f"{host.host_id}-d0")])


async def start_service(
    db_url: str, nats_url: str, prefix: str, state_dir: Path, **kw: Any
) -> ControlPlaneService:
    kw.setdefault("timings", LeaseTimings(claim_s=30, ack_s=30, lease_s=30, liveness_s=60))
    return await ControlPlaneService(
        database_url=db_url,
        nats_url=nats_url,
        state_dir=state_dir,
        prefix=prefix,
        migrate=False,
        scheduler_interval_s=0.5,
        **kw,
    ).start()


@pytest.fixture
async def system(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> AsyncIterator[System]:
    svc = await start_service(db_url, nats_url, subject_prefix, state_dir)
    nc = await nats.connect(nats_url)
    sys_ = System(svc, nats_url, nc)
    try:
        await svc.repo.add_user("admin", platform_admin=True)  # type: ignore[union-attr]
        await svc.repo.add_project("default", owner="admin")  # type: ignore[union-attr]
        yield sys_
    finally:
        for h in sys_.hosts:
            await h.client.close()
        if svc.server is not None:
            await svc.server.delete_storage()
        await nc.close()
        await svc.stop()


# --- the protocol, end to end ------------------------------------------------------


async def test_host_registers_and_its_heartbeat_snapshot_is_visible(system: System) -> None:
    h = await system.host("h1", devices=3)
    assert h.ok.generation >= 1
    devices = await system.repo.list_devices()
    mine = sorted(d["device_id"] for d in devices if d["host_id"] == "h1")
    assert mine == ["h1-d0", "h1-d1", "h1-d2"]
    await h.client.heartbeat([wire.Device(device_id="h1-d9")])
    devices = await system.repo.list_devices()
    assert sorted(d["device_id"] for d in devices if d["host_id"] == "h1") == ["h1-d9"]


async def test_claim_returns_a_pending_assignment_at_once(system: System) -> None:
    h = await system.host("h1")
    (task_id,) = await system.submit()
    await system.assigned_to("h1")
    a = await h.client.claim(wait_s=0)  # no waiting allowed, yet it has work
    assert a is not None and a.task_id == task_id and a.attempt == 1
    assert a.device_id.startswith("h1-") and a.lease_token and a.payload == {"i": 0}


async def test_claim_with_nothing_to_do_returns_no_work_after_the_wait(system: System) -> None:
    h = await system.host("h1")
    assert await h.client.claim(wait_s=0.3) is None


async def test_a_parked_claim_is_woken_by_a_new_submit(system: System) -> None:
    h = await system.host("h1")
    wakeups = system.cp.host_wakeups
    poll = asyncio.ensure_future(h.client.claim(wait_s=60))

    async def parked() -> bool:
        return bool(system.cp.metrics["inflight"] >= 1 and system.server.in_flight(Channel.JOBS))

    await until(parked)
    (task_id,) = await system.submit()
    a = await poll
    assert a is not None and a.task_id == task_id
    assert system.cp.host_wakeups > wakeups


async def test_one_assignment_per_reply(system: System) -> None:
    h = await system.host("h1", devices=3)
    ids = await system.submit(3)
    await system.assigned_to("h1", 3)
    first = await h.client.claim(wait_s=0)
    assert first is not None
    states = await _task_states(system)
    assert sorted(states.values()) == ["assigned", "assigned", "dispatched"]
    second = await h.client.claim(wait_s=0)
    third = await h.client.claim(wait_s=0)
    assert second is not None and third is not None
    assert sorted([first.task_id, second.task_id, third.task_id]) == sorted(ids)
    assert await h.client.claim(wait_s=0) is None


async def _task_states(system: System) -> dict[str, str]:
    assert system.svc.engine is not None
    async with system.svc.engine.connect() as conn:
        rows = (await conn.execute(sa.text("SELECT id, status FROM tasks"))).all()
    return {str(r[0]): r[1] for r in rows}


async def test_ack_renew_progress_and_result_round_trip(system: System) -> None:
    h = await system.host("h1")
    await system.submit()
    a = await h.client.claim(wait_s=30)
    assert a is not None
    acked = await h.client.ack(a.task_id, a.attempt, a.lease_token)
    assert acked.state == "running" and not acked.cancel_requested
    renewed = await h.client.renew(a.task_id, a.attempt, a.lease_token)
    assert renewed.state == "running" and renewed.lease_expires_at >= acked.lease_expires_at
    prog = await h.client.progress(a.task_id, a.attempt, a.lease_token, seq=5, message="half")
    assert prog.state == "running"
    res = await h.client.result(
        a.task_id, a.attempt, a.lease_token, outcome="done", result={"ok": 1}, fingerprint="fp1"
    )
    assert res.state == "done" and res.outcome == "done" and not res.replayed
    again = await h.client.result(
        a.task_id, a.attempt, a.lease_token, outcome="done", result={"ok": 1}, fingerprint="fp1"
    )
    assert again.replayed and again.state == "done"
    before = await system.snapshot()
    with pytest.raises(wire.RemoteError) as err:
        await h.client.result(
            a.task_id, a.attempt, a.lease_token, outcome="failed", fingerprint="fp2"
        )
    assert err.value.code in {"conflict", "gone"}
    assert await system.snapshot() == before
    view = await system.repo.task_view(a.task_id, ADMIN)
    assert view["state"] == "done"


async def test_renew_and_cancel_poll_report_a_pending_cancel(system: System) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    assert not (await h.client.renew(a.task_id, a.attempt, a.lease_token)).cancel_requested
    await system.cp.cancel(a.task_id, ADMIN)
    assert (await h.client.renew(a.task_id, a.attempt, a.lease_token)).cancel_requested
    assert (await h.client.cancel_poll(a.task_id, a.attempt, a.lease_token)).cancel_requested
    res = await h.client.result(
        a.task_id, a.attempt, a.lease_token, outcome="cancelled", fingerprint="c"
    )
    assert res.state == "cancelled"


async def test_reconcile_confirms_the_current_attempt_after_re_registering(system: System) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    ok = await h.client.register()
    assert ok.generation == h.ok.generation + 1
    report = await h.client.reconcile(
        [
            wire.ReconcileEntry(task_id=a.task_id, attempt=a.attempt, lease_token=a.lease_token),
            wire.ReconcileEntry(task_id=a.task_id, attempt=a.attempt, lease_token="x" * 64),
        ]
    )
    assert report.generation == ok.generation
    verdicts = [v.verdict for v in report.verdicts]
    assert "confirmed" in verdicts
    renewed = await h.client.renew(a.task_id, a.attempt, a.lease_token)
    assert renewed.state == "running"


# --- bad input and attacks ------------------------------------------------------------


def _every_host_subject(s: Subjects, host_id: str) -> list[str]:
    return [s.host(host_id, ch, v) for ch, verbs in HOST_VERBS.items() for v in sorted(verbs)]


def _lease_msgs(task_id: str, attempt: int, token: str) -> dict[str, wire.Message]:
    lease = {"task_id": task_id, "attempt": attempt, "lease_token": token}
    return {
        "heartbeat": wire.Heartbeat(devices=[]),
        "reconcile": wire.Reconcile(entries=[wire.ReconcileEntry(**lease)]),
        "claim": wire.Claim(wait_s=0),
        "ack": wire.Ack(**lease),
        "renew": wire.Renew(**lease),
        "progress": wire.Progress(**lease, seq=9),
        "result": wire.Result(**lease, outcome=wire.Outcome.DONE, fingerprint="evil"),
        "cancel_poll": wire.CancelPoll(**lease),
        "append": wire.LogAppend(task_id=task_id, attempt=attempt, first_seq=0, lines=["x"]),
        "chunk": wire.ArtifactChunk(**lease, name="a", offset=0, data=b"x"),
        "commit": wire.ArtifactCommit(
            **lease, name="a", size=1,
            sha256=hashlib.sha256(b"x").hexdigest(),
        ),
    }  # fmt: skip


async def test_garbage_and_malformed_messages_change_nothing(system: System) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    signer = h.signer()
    subjects = [*_every_host_subject(system.subjects, "h1"), system.subjects.ops("alice", "whoami")]
    for subject in subjects:
        for data in (b"", os.urandom(40), msgpack.packb({"v": 1, "t": "nope", "b": b"\x80"})):
            await system.refused_without_change(subject, data, "bad_request")
    # Well-signed messages of the wrong type for the verb.
    for subject in _every_host_subject(system.subjects, "h1"):
        if subject.endswith(".register"):
            continue
        wrong = (
            wire.Heartbeat(devices=[])
            if not subject.endswith(".heartbeat")
            else wire.Renew(task_id=a.task_id, attempt=a.attempt, lease_token=a.lease_token)
        )
        await system.refused_without_change(subject, signer.seal(subject, wrong), "bad_request")
    await system.alive(h)


_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=16)
)
_junk = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    value=_junk,
    t=st.sampled_from(sorted(wire.MESSAGE_TYPES)),
    pick=st.integers(min_value=0),
    signed=st.booleans(),
)
async def test_hypothesis_messages_on_every_subject_change_nothing(
    system: System, value: Any, t: str, pick: int, signed: bool
) -> None:
    if not system.hosts:
        await system.host("h1")
    h = system.hosts[0]
    subjects = [*_every_host_subject(system.subjects, "h1"), system.subjects.ops("alice", "tasks")]
    subject = subjects[pick % len(subjects)]
    body = value if isinstance(value, dict) else {"x": value}
    raw_body = bytes(msgpack.packb(body, use_bin_type=True))
    # Every field of Claim, Heartbeat and Reconcile has a default and unknown
    # fields are ignored, so a signed body of unknown keys on the matching subject
    # is a real request (an empty poll, an empty snapshot): not junk.
    if signed and subject != system.subjects.ops("alice", "tasks"):
        verb = system.subjects.parse_host_subject(subject)
        expected = VERB_TYPES.get((verb.channel, verb.verb))
        if expected is not None and t == expected.TYPE:
            try:
                expected.from_body(body)
            except wire.DecodeError:
                pass
            else:
                assume(False)
    env: dict[str, Any] = {"v": 1, "t": t, "b": raw_body}
    if signed:
        env["a"] = h.signer().auth(subject, t, raw_body).to_map()
    before = await system.snapshot()
    reply = await system.raw(subject, bytes(msgpack.packb(env, use_bin_type=True)))
    assert isinstance(reply, wire.Error) and reply.code != "internal", reply
    assert await system.snapshot() == before


async def test_forged_replayed_and_stale_signatures_are_unauthorized(system: System) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    renew = system.subjects.renew("h1")
    msg = wire.Renew(task_id=a.task_id, attempt=a.attempt, lease_token=a.lease_token)
    forged = Signer("h1", h.ok.generation, secrets.token_bytes(32))
    await system.refused_without_change(renew, forged.seal(renew, msg), "unauthorized")
    stale = h.signer(clock=ManualClock(datetime.now(UTC) - timedelta(minutes=10)))
    await system.refused_without_change(renew, stale.seal(renew, msg), "unauthorized")
    once = h.signer().seal(renew, msg)
    assert isinstance(await system.raw(renew, once), wire.LeaseReply)
    await system.refused_without_change(renew, once, "unauthorized")  # replayed
    unsigned = wire.encode(msg)
    await system.refused_without_change(renew, unsigned, "unauthorized")
    await system.alive(h)


async def test_a_rotated_session_is_dead(system: System) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    old = h.signer()
    await h.client.register()  # generation n+1: n is dead
    for subject in _every_host_subject(system.subjects, "h1"):
        verb = subject.rsplit(".", 1)[1]
        if verb == "register":
            continue
        msg = _lease_msgs(a.task_id, a.attempt, a.lease_token)[verb]
        await system.refused_without_change(subject, old.seal(subject, msg), "unauthorized")
    await system.alive(h)


async def test_a_revoked_host_is_refused_everywhere(system: System) -> None:
    h = await system.host("h1")
    other = await system.host("h2")
    a = await system.running(h)
    await system.repo.revoke_host("h1")
    signer = h.signer()
    for subject in _every_host_subject(system.subjects, "h1"):
        verb = subject.rsplit(".", 1)[1]
        if verb == "register":
            data = wire.encode(wire.Register(host_id="h1", credential=h.credential))
        else:
            data = signer.seal(subject, _lease_msgs(a.task_id, a.attempt, a.lease_token)[verb])
        await system.refused_without_change(subject, data, "unauthorized")
    await system.alive(other)


async def test_an_unknown_host_is_unauthorized(system: System) -> None:
    h = await system.host("h1")
    ghost = Signer("ghost", 1, secrets.token_bytes(32))
    hb = system.subjects.heartbeat("ghost")
    await system.refused_without_change(hb, ghost.seal(hb, wire.Heartbeat()), "unauthorized")
    reg = system.subjects.register("ghost")
    data = wire.encode(wire.Register(host_id="ghost", credential="0" * 64))
    await system.refused_without_change(reg, data, "unauthorized")
    await system.alive(h)


async def test_host_a_acting_for_host_b_is_forbidden(system: System) -> None:
    ha = await system.host("ha", devices=0)  # all work goes to hb
    hb = await system.host("hb")
    b_task = await system.running(hb)
    signer_a = ha.signer()
    for subject in _every_host_subject(system.subjects, "hb"):
        verb = subject.rsplit(".", 1)[1]
        if verb == "register":
            data = wire.encode(wire.Register(host_id="ha", credential=ha.credential))
        else:
            msgs = _lease_msgs(b_task.task_id, b_task.attempt, b_task.lease_token)
            data = signer_a.seal(subject, msgs[verb])
        await system.refused_without_change(subject, data, "forbidden")
    await system.alive(hb)


async def test_stale_attempt_or_lease_token_is_refused(system: System) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    c = h.client
    for call in (
        lambda: c.renew(a.task_id, a.attempt, "f" * 64),
        lambda: c.ack(a.task_id, a.attempt, "f" * 64),
        lambda: c.progress(a.task_id, a.attempt, "f" * 64, seq=3),
        lambda: c.cancel_poll(a.task_id, a.attempt, "f" * 64),
        lambda: c.result(a.task_id, a.attempt, "f" * 64, outcome="done", fingerprint="x"),
        lambda: c.renew(a.task_id, a.attempt + 1, a.lease_token),
        lambda: c.result(a.task_id, a.attempt + 1, a.lease_token, outcome="done", fingerprint="x"),
    ):
        before = await system.snapshot()
        with pytest.raises(wire.RemoteError) as err:
            await call()
        assert err.value.code in {"conflict", "gone", "not_found", "forbidden"}, err.value
        assert await system.snapshot() == before
    assert (await c.renew(a.task_id, a.attempt, a.lease_token)).state == "running"


async def test_a_result_for_another_hosts_task_is_refused(system: System) -> None:
    ha = await system.host("ha", devices=0)  # all work goes to hb
    hb = await system.host("hb")
    b_task = await system.running(hb)
    # A's own subject and session, B's task, even B's lease token.
    for call in (
        lambda: ha.client.result(
            b_task.task_id, b_task.attempt, b_task.lease_token, outcome="done", fingerprint="x"
        ),
        lambda: ha.client.renew(b_task.task_id, b_task.attempt, b_task.lease_token),
        lambda: ha.client.append_logs(b_task.task_id, b_task.attempt, 0, ["not mine"]),
        lambda: ha.client.upload_artifact(
            b_task.task_id, b_task.attempt, b_task.lease_token, "a", b"not mine"
        ),
    ):
        before = await system.snapshot()
        with pytest.raises(wire.RemoteError) as err:
            await call()
        assert err.value.code in {"forbidden", "conflict", "not_found"}, err.value
        assert await system.snapshot() == before
    # Nor was anything written into the object store under B's task.
    with pytest.raises(NotFound):
        await system.server.read_artifact(
            Server.object_name(
                b_task.task_id, b_task.attempt, "a", hashlib.sha256(b"not mine").hexdigest()
            )
        )
    ok = await hb.client.result(
        b_task.task_id, b_task.attempt, b_task.lease_token, outcome="done", fingerprint="b"
    )
    assert ok.state == "done"


# --- channels apart ---------------------------------------------------------------------


async def test_stalled_logs_and_artifacts_never_delay_control_and_jobs(system: System) -> None:
    h = await system.host("h1", devices=2)
    a = await system.running(h)
    system.server.stall(Channel.LOGS)
    system.server.stall(Channel.ARTIFACTS)
    # Pile requests up on the stalled channels, from the same host, on a signer of
    # its session (the client's own log/artifact connections would do the same).
    signer = h.signer()
    log_subject = system.subjects.log_append("h1")
    chunk_subject = system.subjects.artifact_chunk("h1")
    piled = [
        asyncio.ensure_future(
            principal_request(
                system.nc,
                system.subjects,
                log_subject,
                signer.seal(
                    log_subject,
                    wire.LogAppend(
                        task_id=a.task_id, attempt=a.attempt, first_seq=i * 10, lines=["l"] * 10
                    ),
                ),
                timeout=110,
            )
        )
        for i in range(40)
    ] + [
        asyncio.ensure_future(
            principal_request(
                system.nc,
                system.subjects,
                chunk_subject,
                signer.seal(
                    chunk_subject,
                    wire.ArtifactChunk(
                        task_id=a.task_id, attempt=a.attempt, lease_token=a.lease_token,
                        name="a", offset=0, data=os.urandom(64 * 1024),
                    ),
                ),
                timeout=110,
            )
        )
        for i in range(20)
    ]  # fmt: skip

    async def piled_up() -> bool:
        return (
            system.server.received(Channel.LOGS) >= 16
            and system.server.received(Channel.ARTIFACTS) >= 8
        )

    await until(piled_up)
    assert system.server.handled(Channel.LOGS) == 0
    assert system.server.handled(Channel.ARTIFACTS) == 0
    # Control and jobs traffic completes, each within its client's normal timeout.
    c = h.client
    await c.heartbeat([wire.Device(device_id="h1-d0"), wire.Device(device_id="h1-d1")])
    assert (await c.renew(a.task_id, a.attempt, a.lease_token)).state == "running"
    (second_id,) = await system.submit()
    b = await c.claim(wait_s=30)
    assert b is not None and b.task_id == second_id
    assert (await c.ack(b.task_id, b.attempt, b.lease_token)).state == "running"
    assert (await c.progress(b.task_id, b.attempt, b.lease_token, seq=1)).state == "running"
    assert not (await c.cancel_poll(b.task_id, b.attempt, b.lease_token)).cancel_requested
    res = await c.result(b.task_id, b.attempt, b.lease_token, outcome="done", fingerprint="f")
    assert res.state == "done"
    await c.reconcile(
        [wire.ReconcileEntry(task_id=a.task_id, attempt=a.attempt, lease_token=a.lease_token)]
    )
    assert not any(p.done() for p in piled)
    # Released, the piled-up requests are all served: the chunks beyond the
    # host's chunks-at-once limit with a typed "busy".
    system.server.unstall(Channel.LOGS)
    system.server.unstall(Channel.ARTIFACTS)
    replies = [wire.decode(r.data).msg for r in await asyncio.gather(*piled)]
    assert all(isinstance(m, wire.Ok) for m in replies[:40])
    assert all(
        isinstance(m, wire.Ok) or (isinstance(m, wire.Error) and m.code == "busy")
        for m in replies[40:]
    ), replies[40:]
    assert any(isinstance(m, wire.Ok) for m in replies[40:])
    lines = await system.repo.read_logs(a.task_id, ADMIN, limit=1000)
    assert len(lines) == 400


# --- logs and artifacts --------------------------------------------------------------------


async def test_log_batches_are_stored_in_order_and_duplicates_ignored(system: System) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    c = h.client
    await c.append_logs(a.task_id, a.attempt, 0, ["zero", "one"])
    await c.append_logs(a.task_id, a.attempt, 2, ["two"])
    await c.append_logs(a.task_id, a.attempt, 0, ["zero", "one"])  # a retried batch
    await c.append_logs(a.task_id, a.attempt, 1, ["one", "two", "three"])  # overlapping
    await c.result(a.task_id, a.attempt, a.lease_token, outcome="done", fingerprint="f")
    await c.append_logs(a.task_id, a.attempt, 4, ["after the result"])  # logs may trail
    lines = await system.repo.read_logs(a.task_id, ADMIN)
    assert [(r["seq"], r["line"]) for r in lines] == [
        (0, "zero"),
        (1, "one"),
        (2, "two"),
        (3, "three"),
        (4, "after the result"),
    ]


async def test_artifact_upload_is_chunked_checked_and_readable(system: System) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    data = os.urandom(300 * 1024 + 7)  # three chunks of the client's 128 KiB
    await h.client.upload_artifact(a.task_id, a.attempt, a.lease_token, "screen.png", data)
    await h.client.upload_artifact(a.task_id, a.attempt, a.lease_token, "empty.txt", b"")
    rows = {r["name"]: r for r in await system.repo.list_artifacts(a.task_id, ADMIN)}
    assert rows["screen.png"]["size"] == len(data)
    assert rows["screen.png"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert await system.server.read_artifact(rows["screen.png"]["object_name"]) == data
    assert await system.server.read_artifact(rows["empty.txt"]["object_name"]) == b""
    # A retried commit (lost reply) is answered the same and records nothing new.
    before = await system.snapshot()
    await h.client.upload_artifact(a.task_id, a.attempt, a.lease_token, "screen.png", data)
    assert await system.snapshot() == before


async def test_artifact_commit_with_wrong_size_or_digest_is_conflict_and_records_nothing(
    system: System,
) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    signer = h.signer()
    chunk_s = system.subjects.artifact_chunk("h1")
    commit_s = system.subjects.artifact_commit("h1")
    unit = wire.ARTIFACT_CHUNK_BYTES
    data = os.urandom(unit + 400)
    lease = {"task_id": a.task_id, "attempt": a.attempt, "lease_token": a.lease_token}

    async def stage() -> None:
        for offset in (0, unit):
            part = data[offset : offset + unit]
            chunk = wire.ArtifactChunk(**lease, name="f", offset=offset, data=part)
            assert isinstance(await system.raw(chunk_s, signer.seal(chunk_s, chunk)), wire.Ok)

    good = hashlib.sha256(data).hexdigest()
    size = len(data)
    for bad_size, digest in (
        (size, hashlib.sha256(b"other").hexdigest()),
        (size - 1, good),
        (size + 1, good),
    ):
        await stage()
        commit = wire.ArtifactCommit(**lease, name="f", size=bad_size, sha256=digest)
        await system.refused_without_change(commit_s, signer.seal(commit_s, commit), "conflict")
    assert await system.repo.list_artifacts(a.task_id, ADMIN) == []
    # A refused commit drops the upload's chunks: committing again finds none.
    commit = wire.ArtifactCommit(**lease, name="f", size=size, sha256=good)
    await system.refused_without_change(commit_s, signer.seal(commit_s, commit), "conflict")
    await stage()
    assert isinstance(await system.raw(commit_s, signer.seal(commit_s, commit)), wire.Ok)
    (row,) = await system.repo.list_artifacts(a.task_id, ADMIN)
    assert await system.server.read_artifact(row["object_name"]) == data


# --- several control planes -----------------------------------------------------------------


async def test_two_control_planes_share_the_work_without_double_processing(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> None:
    one = await start_service(db_url, nats_url, subject_prefix, state_dir)
    two = await start_service(db_url, nats_url, subject_prefix, state_dir)
    nc = await nats.connect(nats_url)
    s1, s2 = System(one, nats_url, nc), System(two, nats_url, nc)
    try:
        await s1.repo.add_user("admin", platform_admin=True)
        await s1.repo.add_project("default", owner="admin")
        h = await s1.host("h1", devices=4)
        # A long-poll parked in one process is woken by an assignment made by the
        # other process's Scheduler.
        poll = asyncio.ensure_future(h.client.claim(wait_s=60))

        async def parked() -> bool:
            return one.server.in_flight(Channel.JOBS) + two.server.in_flight(Channel.JOBS) == 1

        await until(parked)
        elsewhere = s2 if one.server.in_flight(Channel.JOBS) else s1
        (first,) = await elsewhere.submit()
        a = await poll
        assert a is not None and a.task_id == first
        await h.client.ack(a.task_id, a.attempt, a.lease_token)
        await h.client.result(a.task_id, a.attempt, a.lease_token, outcome="done", fingerprint="f")
        # A batch of work through both processes.
        ids = await s1.submit(10) + await s2.submit(10)
        done: list[wire.ResultReply] = []
        while len(done) < len(ids):
            b = await h.client.claim(wait_s=30)
            assert b is not None
            await h.client.ack(b.task_id, b.attempt, b.lease_token)
            for _ in range(3):
                await h.client.renew(b.task_id, b.attempt, b.lease_token)
            await h.client.append_logs(b.task_id, b.attempt, 0, ["a", "b"])
            done.append(
                await h.client.result(
                    b.task_id, b.attempt, b.lease_token, outcome="done", fingerprint=b.task_id
                )
            )
        assert sorted(r.task_id for r in done) == sorted(ids)
        assert not any(r.replayed for r in done)
        for srv in (one.server, two.server):
            assert srv.handled(Channel.JOBS) > 0
            assert srv.handled(Channel.CONTROL) + srv.handled(Channel.LOGS) > 0
        assert one.engine is not None
        async with one.engine.connect() as conn:
            attempts = (
                await conn.execute(sa.text("SELECT task_id, count(*) FROM attempts GROUP BY 1"))
            ).all()
            logs = (await conn.execute(sa.text("SELECT count(*) FROM log_lines"))).scalar_one()
            states = (await conn.execute(sa.text("SELECT DISTINCT status FROM tasks"))).all()
        assert all(n == 1 for _, n in attempts) and len(attempts) == 21
        assert logs == 40
        assert [r[0] for r in states] == ["done"]
    finally:
        for hh in s1.hosts:
            await hh.client.close()
        await nc.close()
        await two.server.delete_storage()
        await one.stop()
        await two.stop()
