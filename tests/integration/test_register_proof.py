"""Registration without the credential on the wire, against a
real PostgreSQL, nats-server and control plane: the agent's Register carries a
proof bound to the host, a timestamp and a fresh nonce; the server opens it with
the stored hash and refuses replays, stale timestamps, wrong proofs, unknown
and revoked hosts alike. Older agents' credential-bearing Register still works.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import nats
import pytest
from nats.aio.msg import Msg

from fleetlease.ops.service import ControlPlaneService
from fleetlease.transport import wire
from fleetlease.transport.broker_auth import register_proof
from fleetlease.transport.client import HostClient
from fleetlease.transport.subjects import Subjects
from tests.inbox import request as principal_request

WAIT_S = 10.0


@pytest.fixture
async def service(
    db_url: str, nats_url: str, subject_prefix: str, tmp_path: Path
) -> AsyncIterator[ControlPlaneService]:
    svc = ControlPlaneService(
        database_url=db_url, nats_url=nats_url, state_dir=tmp_path, prefix=subject_prefix
    )
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()


def _proof_register(host_id: str, credential: str, *, ts_ms: int | None = None) -> wire.Register:
    ts = int(time.time() * 1000) if ts_ms is None else ts_ms
    nonce = secrets.token_bytes(wire.NONCE_LEN)
    return wire.Register(
        host_id=host_id,
        proof=register_proof(credential, host_id, ts, nonce),
        ts_ms=ts,
        nonce=nonce,
    )


async def _code(nc: nats.NATS, subject: str, data: bytes) -> str:
    prefix = subject.rsplit(".host.", 1)[0]  # every subject here is a host's
    reply = await principal_request(nc, Subjects(prefix), subject, data, WAIT_S)
    try:
        wire.decode_reply(reply.data, wire.RegisterOk)
    except wire.RemoteError as exc:
        return exc.code
    return "ok"


async def test_the_agent_register_carries_a_proof_never_the_credential(
    service: ControlPlaneService, nats_url: str, subject_prefix: str
) -> None:
    assert service.repo is not None
    credential = await service.repo.add_host("h1")
    subjects = Subjects(subject_prefix)
    sniffer = await nats.connect(nats_url)
    captured: asyncio.Queue[Msg] = asyncio.Queue()

    async def capture(msg: Msg) -> None:
        captured.put_nowait(msg)

    await sniffer.subscribe(subjects.register("h1"), cb=capture)
    await sniffer.flush()
    client = HostClient(
        nats_url=nats_url, host_id="h1", credential=credential, prefix=subject_prefix
    )
    try:
        await client.connect()
        ok = await client.register("test")
        assert ok.generation == 1
        msg = await asyncio.wait_for(captured.get(), WAIT_S)
        # Neither the hex text nor its bytes travel; the body has no credential.
        assert credential.encode() not in msg.data
        assert bytes.fromhex(credential) not in msg.data
        env = wire.decode(msg.data)
        assert isinstance(env.msg, wire.Register)
        assert env.msg.credential is None and env.msg.proof is not None
        body = msgpack.unpackb(msgpack.unpackb(msg.data)["b"])
        assert "credential" not in body and set(body) >= {"proof", "ts_ms", "nonce"}
        # The session works: a heartbeat is accepted.
        await client.heartbeat([wire.Device(device_id="d1")])

        # A replay of the captured Register is refused, and opens no session.
        assert await _code(sniffer, subjects.register("h1"), msg.data) == "unauthorized"
        assert await service.repo.current_generation("h1") == 1
    finally:
        await client.close()
        await sniffer.close()


async def test_stale_wrong_unknown_and_revoked_proofs_are_refused(
    service: ControlPlaneService, nats_url: str, subject_prefix: str
) -> None:
    assert service.repo is not None
    credential = await service.repo.add_host("h1")
    other = await service.repo.add_host("h2")
    subjects = Subjects(subject_prefix)
    reg = subjects.register("h1")
    nc = await nats.connect(nats_url)
    try:
        stale = _proof_register("h1", credential, ts_ms=int(time.time() * 1000) - 3_600_000)
        future = _proof_register("h1", credential, ts_ms=int(time.time() * 1000) + 3_600_000)
        wrong = _proof_register("h1", other)  # h2's credential presented for h1
        for msg in (stale, future, wrong):
            assert await _code(nc, reg, wire.encode(msg)) == "unauthorized"
        ghost = _proof_register("ghost", credential)
        assert await _code(nc, subjects.register("ghost"), wire.encode(ghost)) == "unauthorized"
        # A proof for h1 sent on h2's subject: bound to another host.
        assert (
            await _code(nc, subjects.register("h2"), wire.encode(_proof_register("h1", credential)))
            == "forbidden"
        )
        assert await service.repo.current_generation("h1") is None

        # The right proof works; an older agent's credential Register still works.
        assert await _code(nc, reg, wire.encode(_proof_register("h1", credential))) == "ok"
        legacy = wire.Register(host_id="h1", credential=credential)
        assert await _code(nc, reg, wire.encode(legacy)) == "ok"
        assert await service.repo.current_generation("h1") == 2

        await service.repo.revoke_host("h1")
        assert (
            await _code(nc, reg, wire.encode(_proof_register("h1", credential))) == "unauthorized"
        )
    finally:
        await nc.close()
