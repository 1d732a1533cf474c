"""Reply-subject reflection and ops-token binding, against a real nats-server with
the auth callout, a real control plane and PostgreSQL.

A request names its own reply subject. The control plane answers only inside
the inbox of the principal the request subject names, so a request cannot make
it publish to ``$JS.API...`` (purging the artifact store) or into another
principal's inbox; and its serving connections may not publish there anyway.
An ops request is acted on only with a token of the user its subject names.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
import sqlalchemy as sa
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from structlog.testing import capture_logs

from fleetlease.ops.cli import main
from fleetlease.ops.client import OpsClient
from fleetlease.ops.embedded import EmbeddedNats
from fleetlease.ops.service import ControlPlaneService
from fleetlease.persistence.tables import tasks, users
from fleetlease.transport import wire
from fleetlease.transport.broker_auth import host_connect_options, user_connect_options
from fleetlease.transport.broker_config import BrokerKeys, secure_embedded_args
from fleetlease.transport.subjects import Channel, Subjects
from tests.chaos.harness import wait_until
from tests.inbox import request as principal_request

WAIT_S = 20.0
ARTIFACT = b"an artifact nobody may purge"


@dataclass
class Secure:
    service: ControlPlaneService
    url: str
    keys: BrokerKeys
    subjects: Subjects
    conns: list[NatsClient]
    errors: dict[int, asyncio.Queue[str]]

    @property
    def stream(self) -> str:
        assert self.service.server is not None
        return f"OBJ_{self.service.server.artifact_bucket}"

    async def connect(self, **opts: Any) -> NatsClient:
        errors: asyncio.Queue[str] = asyncio.Queue()

        async def on_error(exc: Exception) -> None:
            errors.put_nowait(str(exc) or type(exc).__name__)

        nc = await nats.connect(
            self.url,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=5,
            error_cb=on_error,
            **opts,
        )
        self.conns.append(nc)
        self.errors[id(nc)] = errors
        return nc

    async def expect_error(self, nc: NatsClient, *needles: str) -> str:
        text = await asyncio.wait_for(self.errors[id(nc)].get(), WAIT_S)
        assert all(n.lower() in text.lower() for n in needles), text
        return text

    async def user(self, name: str, *, admin: bool = False) -> tuple[NatsClient, str]:
        assert self.service.repo is not None
        token = await self.service.repo.add_user(name, platform_admin=admin)
        return await self.connect(**user_connect_options(name, token, self.subjects)), token

    async def host(self, host_id: str) -> NatsClient:
        assert self.service.repo is not None
        credential = await self.service.repo.add_host(host_id)
        return await self.connect(
            inbox_prefix=self.subjects.host_inbox_prefix(host_id).encode(),
            **host_connect_options(host_id, credential),
        )

    async def put_artifact(self) -> None:
        """One object in the artifact store, through the storage identity."""
        nc = await self.connect(**self.keys.storage_connect_options())
        assert self.service.server is not None
        store = await nc.jetstream().create_object_store(self.service.server.artifact_bucket)
        await store.put("probe", ARTIFACT)

    async def artifact_intact(self) -> bool:
        nc = await self.connect(**self.keys.storage_connect_options())
        js = nc.jetstream()
        info = await js.stream_info(self.stream)
        assert self.service.server is not None
        store = await js.object_store(self.service.server.artifact_bucket)
        got = await store.get("probe")
        return info.state.messages > 0 and got.data == ARTIFACT


@pytest.fixture
async def secure(tmp_path: Path, db_url: str, subject_prefix: str) -> AsyncIterator[Secure]:
    state = tmp_path / "state"
    subjects = Subjects(subject_prefix)
    server = EmbeddedNats(
        tmp_path / "nats", extra_args=secure_embedded_args(state, subjects=subjects)
    )
    await asyncio.to_thread(server.start)
    service = ControlPlaneService(
        database_url=db_url,
        nats_url=server.url,
        state_dir=state,
        prefix=subject_prefix,
        broker_security=True,
    )
    s = Secure(service, server.url, BrokerKeys.load_or_create(state / "broker"), subjects, [], {})
    try:
        await service.start()
        await s.put_artifact()
        yield s
    finally:
        for nc in s.conns:
            await nc.close()
        await service.stop()
        await asyncio.to_thread(server.stop)


def _refusals(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e.get("event") == "reply_subject_refused"]


async def test_no_request_makes_the_control_plane_answer_outside_the_requesters_inbox(
    secure: Secure,
) -> None:
    s = secure.subjects
    server = secure.service.server
    assert server is not None
    mallory, mallory_token = await secure.user("mallory")  # no role anywhere
    alice, _ = await secure.user("alice")
    h1 = await secure.host("h1")
    h2 = await secure.host("h2")
    purge = f"$JS.API.STREAM.PURGE.{secure.stream}"
    delete = f"$JS.API.STREAM.DELETE.{secure.stream}"

    # What arrives in alice's and h2's inboxes (each may watch its own).
    landed: list[str] = []

    async def seen(msg: Msg) -> None:
        landed.append(msg.subject)

    await alice.subscribe(f"{s.ops_inbox_prefix('alice')}.>", cb=seen)
    await h2.subscribe(f"{s.host_inbox_prefix('h2')}.>", cb=seen)
    await alice.flush()
    await h2.flush()

    whoami = wire.encode(wire.OpsRequest(token=mallory_token, verb="whoami"))
    forged: list[tuple[NatsClient, str, bytes, str]] = [
        (mallory, s.ops("mallory", "whoami"), b"junk", purge),
        (mallory, s.ops("mallory", "whoami"), whoami, purge),
        (mallory, s.ops("mallory", "whoami"), whoami, delete),
        (mallory, s.ops("mallory", "whoami"), whoami, f"{s.ops_inbox_prefix('alice')}.x1"),
        (mallory, s.ops("mallory", "whoami"), whoami, f"{s.host_inbox_prefix('h2')}.x2"),
        (mallory, s.ops("mallory", "whoami"), whoami, "$KV.anything.k"),
        (mallory, s.ops("mallory", "whoami"), whoami, "$SYS.REQ.SERVER.PING"),
        (h1, s.heartbeat("h1"), b"junk", purge),
        (h1, s.heartbeat("h1"), b"junk", f"{s.host_inbox_prefix('h2')}.x3"),
        (h1, s.claim("h1"), b"junk", f"{s.ops_inbox_prefix('alice')}.x4"),
        (h1, s.log_append("h1"), b"junk", f"$O.{server.artifact_bucket}.C.x"),
    ]
    received = {ch: server.received(ch) for ch in Channel}
    with capture_logs() as logs:
        for nc, subject, data, reply in forged:
            await nc.publish(subject, data, reply=reply)
            await nc.flush()
        await wait_until(
            lambda: len(_refusals(logs)) >= len(forged), timeout=WAIT_S, what="every refusal"
        )
    refusals = _refusals(logs)
    assert [(e["principal"], e["reply"]) for e in refusals] == [
        ("user:mallory" if nc is mallory else "host:h1", reply) for nc, _, _, reply in forged
    ]
    assert all(e["log_level"] == "warning" for e in refusals)
    assert sum(server.received(ch) - received[ch] for ch in Channel) == len(forged)

    # Each one's legitimate request is still answered, into its own inbox.
    me = await principal_request(mallory, s, s.ops("mallory", "whoami"), whoami, WAIT_S)
    assert wire.decode_reply(me.data, wire.OpsReply).data["name"] == "mallory"
    # The artifact store is whole, and the forged replies never arrived.
    assert await secure.artifact_intact()
    await alice.flush()
    await h2.flush()
    assert landed == []


async def test_the_serving_identity_cannot_publish_to_system_subjects(secure: Secure) -> None:
    """The second wall: even a server bug that answered a forged reply subject
    could not reach JetStream, the object store, KV, the system account or a
    request subject through a serving connection."""
    cp = await secure.connect(**secure.keys.control_plane_connect_options())
    p = secure.subjects.prefix
    for subject in (
        f"$JS.API.STREAM.PURGE.{secure.stream}",
        "$O.bucket.C.x",
        "$KV.bucket.k",
        "$SYS.REQ.SERVER.PING",
        f"{p}.host.h1.control.heartbeat",
        f"{p}.ops.alice.whoami",
        "_INBOX.x",
        "anything.else",
    ):
        await cp.publish(subject, b"x")
        await secure.expect_error(cp, "permissions violation", "publish", subject)
    # The storage identity takes no request: it may subscribe to its own inbox only.
    storage = await secure.connect(**secure.keys.storage_connect_options())
    for subject in (f"{p}.ops.>", f"{p}.host.*.control.>", f"_INBOX_{p}.ops.alice.>"):
        await storage.subscribe(subject)
        await secure.expect_error(storage, "permissions violation", "subscription", subject)
    assert await secure.artifact_intact()


async def test_a_user_connection_presenting_another_users_token_is_refused(
    secure: Secure,
) -> None:
    s = secure.subjects
    alice, _ = await secure.user("alice")
    _, admin_token = await secure.user("root", admin=True)
    for verb, args in (("whoami", {}), ("submit", {"goal": "g"}), ("user_add", {"name": "x"})):
        req = wire.encode(wire.OpsRequest(token=admin_token, verb=verb, args=args))
        reply = await principal_request(alice, s, s.ops("alice", verb), req, WAIT_S)
        with pytest.raises(wire.RemoteError) as info:
            wire.decode_reply(reply.data, wire.OpsReply)
        assert info.value.code == "unauthorized", info.value
    # Nothing was done: no task, no user.
    assert secure.service.engine is not None
    async with secure.service.engine.connect() as conn:
        assert (await conn.execute(sa.select(sa.func.count()).select_from(tasks))).scalar() == 0
        names = (await conn.execute(sa.select(users.c.name))).scalars().all()
    assert sorted(names) == ["alice", "root"]
    # Nor may she publish on root's subject at all.
    await alice.publish(s.ops("root", "whoami"), b"x")
    await secure.expect_error(alice, "permissions violation", "publish")


async def test_on_an_open_broker_the_token_must_be_the_subjects_user(
    db_url: str, nats_url: str, subject_prefix: str, tmp_path: Path
) -> None:
    service = ControlPlaneService(
        database_url=db_url, nats_url=nats_url, state_dir=tmp_path, prefix=subject_prefix
    )
    await service.start()
    nc = await nats.connect(nats_url)
    try:
        assert service.repo is not None
        await service.repo.add_user("alice")
        bob = await service.repo.add_user("bob")
        s = Subjects(subject_prefix)
        req = wire.encode(wire.OpsRequest(token=bob, verb="submit", args={"goal": "g"}))
        reply = await principal_request(nc, s, s.ops("alice", "submit"), req, WAIT_S)
        with pytest.raises(wire.RemoteError) as info:
            wire.decode_reply(reply.data, wire.OpsReply)
        assert info.value.code == "unauthorized"
        assert service.engine is not None
        async with service.engine.connect() as conn:
            count = (await conn.execute(sa.select(sa.func.count()).select_from(tasks))).scalar()
        assert count == 0
        # The identify request names no user: it answers whoami only, into the
        # anonymous inbox.
        who = wire.encode(wire.OpsRequest(token=bob, verb="whoami"))
        reply = await principal_request(nc, s, s.ops_identify(), who, WAIT_S)
        assert wire.decode_reply(reply.data, wire.OpsReply).data["name"] == "bob"
        # A client not told its user identifies once, however many first calls
        # it makes at once, and every one of them is answered.
        client = OpsClient(nats_url=nats_url, token=bob, prefix=subject_prefix, timeout_s=WAIT_S)
        async with client:
            answers = await asyncio.gather(*(client.call("whoami") for _ in range(6)))
        assert [a["name"] for a in answers] == ["bob"] * 6
    finally:
        await nc.close()
        await service.stop()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_empty_token_is_a_usage_error_not_the_admin_token(
    how: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A context file with an admin token must not stand in for an empty one."""
    (tmp_path / "admin.token").write_text("a" * 64 + "\n")
    (tmp_path / "context.json").write_text(
        json.dumps(
            {
                "nats_url": "nats://127.0.0.1:1",
                "admin_token_path": str(tmp_path / "admin.token"),
                "admin_user": "admin",
            }
        )
    )
    monkeypatch.delenv("FLEETLEASE_USER", raising=False)
    argv = ["whoami", "--state-dir", str(tmp_path)]
    if how == "flag":
        monkeypatch.delenv("FLEETLEASE_TOKEN", raising=False)
        argv += ["--token", ""]
    else:
        monkeypatch.setenv("FLEETLEASE_TOKEN", "")
    capsys.readouterr()
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    assert "empty user token" in lines[0]
