"""Every message type with every field set: encoded to exactly the body the
wire format specifies (key order included, so signatures over old and new
encoders agree) and decoded back equal. The field declarations of
``fleetlease.transport.wire.messages`` are the one source of both directions."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest

from fleetlease.persistence.model import Outcome, TaskKind, TaskState
from fleetlease.transport import wire

TASK = "0b4f6c1e-2a5d-4d0e-9a43-1f0c2b7e9d11"
LEASE = "6a1f0f5e-93a1-4b8c-8f0d-5c6c1a1d2e3f"

#: (message with every field set, its body map in wire order)
FULL: list[tuple[wire.Message, dict[str, Any]]] = [
    (
        wire.Register(host_id="h1", credential="0f" * 32, agent_version="1.2.3"),
        {"host_id": "h1", "credential": "0f" * 32, "agent_version": "1.2.3"},
    ),
    (
        wire.Register(
            host_id="h1",
            proof=b"p" * 64,
            ts_ms=1_700_000_000_123,
            nonce=b"n" * 16,
            agent_version="2.0",
        ),
        {
            "host_id": "h1",
            "proof": b"p" * 64,
            "ts_ms": 1700000000123,
            "nonce": b"n" * 16,
            "agent_version": "2.0",
        },
    ),
    (
        wire.RegisterOk(
            host_id="h1", generation=3, session_key=b"k" * 32, lease_s=30.0, heartbeat_s=5.0
        ),
        {
            "host_id": "h1",
            "generation": 3,
            "session_key": b"k" * 32,
            "lease_s": 30.0,
            "heartbeat_s": 5.0,
        },
    ),
    (
        wire.Heartbeat(
            devices=[
                wire.Device(device_id="d1", state="busy", capabilities={"os": "android"}),
                wire.Device(device_id="d2", state="offline", capabilities={}),
            ],
            workflows=["build", "smoke"],
            goal_runner="command",
            digest="tag-1",
        ),
        {
            "devices": [
                {"device_id": "d1", "state": "busy", "capabilities": {"os": "android"}},
                {"device_id": "d2", "state": "offline", "capabilities": {}},
            ],
            "workflows": ["build", "smoke"],
            "goal_runner": "command",
            "digest": "tag-1",
            "unchanged": False,
        },
    ),
    (
        wire.Heartbeat(digest="tag-1", unchanged=True),
        {"devices": [], "goal_runner": "", "digest": "tag-1", "unchanged": True},
    ),
    (
        wire.Reconcile(entries=[wire.ReconcileEntry(task_id=TASK, attempt=2, lease_token="tok")]),
        {"entries": [{"task_id": TASK, "attempt": 2, "lease_token": "tok"}]},
    ),
    (
        wire.ReconcileResult(
            generation=4,
            verdicts=[
                wire.Verdict(
                    task_id=TASK,
                    attempt=2,
                    verdict="discard",
                    reason="gone",
                    cancel_requested=True,
                    lease_expires_at=1700000000.5,
                )
            ],
        ),
        {
            "generation": 4,
            "verdicts": [
                {
                    "task_id": TASK,
                    "attempt": 2,
                    "verdict": "discard",
                    "reason": "gone",
                    "cancel_requested": True,
                    "lease_expires_at": 1700000000.5,
                }
            ],
        },
    ),
    (
        wire.Ok(),
        {},
    ),
    (
        wire.Claim(wait_s=2.5, devices=["d1", "d2"]),
        {"wait_s": 2.5, "devices": ["d1", "d2"]},
    ),
    (
        wire.Assignment(
            task_id=TASK,
            attempt=1,
            device_id="d1",
            lease_id=LEASE,
            lease_token="tok",
            kind=TaskKind.WORKFLOW,
            goal="g",
            workflow="w",
            payload={"a": [1, 2.5, None, {"b": "c"}]},
            ack_deadline=1700000001.25,
            lease_s=30.0,
        ),
        {
            "task_id": TASK,
            "attempt": 1,
            "device_id": "d1",
            "lease_id": LEASE,
            "lease_token": "tok",
            "kind": "workflow",
            "goal": "g",
            "workflow": "w",
            "payload": {"a": [1, 2.5, None, {"b": "c"}]},
            "ack_deadline": 1700000001.25,
            "lease_s": 30.0,
        },
    ),
    (
        wire.NoWork(),
        {},
    ),
    (
        wire.Ack(task_id=TASK, attempt=1, lease_token="tok"),
        {"task_id": TASK, "attempt": 1, "lease_token": "tok"},
    ),
    (
        wire.Renew(task_id=TASK, attempt=1, lease_token="tok"),
        {"task_id": TASK, "attempt": 1, "lease_token": "tok"},
    ),
    (
        wire.Progress(task_id=TASK, attempt=1, lease_token="tok", seq=7, message="half way"),
        {"task_id": TASK, "attempt": 1, "lease_token": "tok", "seq": 7, "message": "half way"},
    ),
    (
        wire.LeaseReply(
            task_id=TASK,
            attempt=1,
            state=TaskState.RUNNING,
            lease_expires_at=1700000030.0,
            cancel_requested=True,
        ),
        {
            "task_id": TASK,
            "attempt": 1,
            "state": "running",
            "lease_expires_at": 1700000030.0,
            "cancel_requested": True,
        },
    ),
    (
        wire.Result(
            task_id=TASK,
            attempt=1,
            lease_token="tok",
            outcome=Outcome.FAILED,
            retryable=True,
            reason="flaky",
            result={"exit": 1},
            fingerprint="fp1",
        ),
        {
            "task_id": TASK,
            "attempt": 1,
            "lease_token": "tok",
            "outcome": "failed",
            "retryable": True,
            "reason": "flaky",
            "result": {"exit": 1},
            "fingerprint": "fp1",
        },
    ),
    (
        wire.ResultReply(
            task_id=TASK,
            attempt=1,
            state=TaskState.RETRYING,
            outcome=Outcome.FAILED,
            fingerprint="fp1",
            replayed=True,
            retry_at=1700000060.0,
        ),
        {
            "task_id": TASK,
            "attempt": 1,
            "state": "retrying",
            "outcome": "failed",
            "fingerprint": "fp1",
            "replayed": True,
            "retry_at": 1700000060.0,
        },
    ),
    (
        wire.CancelPoll(task_id=TASK, attempt=1, lease_token="tok"),
        {"task_id": TASK, "attempt": 1, "lease_token": "tok"},
    ),
    (
        wire.CancelStatus(task_id=TASK, attempt=1, cancel_requested=True),
        {"task_id": TASK, "attempt": 1, "cancel_requested": True},
    ),
    (
        wire.LogAppend(task_id=TASK, attempt=1, first_seq=10, lines=["one", "two ü"]),
        {"task_id": TASK, "attempt": 1, "first_seq": 10, "lines": ["one", "two ü"]},
    ),
    (
        wire.ArtifactChunk(
            task_id=TASK,
            attempt=1,
            lease_token="tok",
            name="out.bin",
            offset=4096,
            data=b"\x00\x01\x02",
        ),
        {
            "task_id": TASK,
            "attempt": 1,
            "lease_token": "tok",
            "name": "out.bin",
            "offset": 4096,
            "data": b"\x00\x01\x02",
        },
    ),
    (
        wire.ArtifactCommit(
            task_id=TASK, attempt=1, lease_token="tok", name="out.bin", size=4099, sha256="ab" * 32
        ),
        {
            "task_id": TASK,
            "attempt": 1,
            "lease_token": "tok",
            "name": "out.bin",
            "size": 4099,
            "sha256": "ab" * 32,
        },
    ),
    (
        wire.OpsRequest(token="t" * 64, verb="submit", args={"goal": "g", "count": 2}),
        {"token": "t" * 64, "verb": "submit", "args": {"goal": "g", "count": 2}},
    ),
    (
        wire.OpsReply(data={"ids": [TASK], "n": 1}),
        {"data": {"ids": [TASK], "n": 1}},
    ),
    (
        wire.Error(code="conflict", message="already done"),
        {"code": "conflict", "message": "already done"},
    ),
]

#: Register carries a credential or a proof, never both: each sample leaves the
#: other's fields unset.
REGISTER_ALTERNATIVES = {"credential", "proof", "ts_ms", "nonce"}
#: A heartbeat carries a snapshot or says it is unchanged: each sample leaves
#: the other form's fields at their defaults.
HEARTBEAT_ALTERNATIVES = {"devices", "workflows", "goal_runner", "unchanged"}


def test_the_samples_cover_every_message_type() -> None:
    assert {m.TYPE for m, _ in FULL} == set(wire.MESSAGE_TYPES)


@pytest.mark.parametrize(("msg", "body"), FULL, ids=[m.TYPE for m, _ in FULL])
def test_every_field_is_set_away_from_its_default(msg: wire.Message, body: dict[str, Any]) -> None:
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if isinstance(msg, wire.Register) and f.name in REGISTER_ALTERNATIVES and value is None:
            continue
        if isinstance(msg, wire.Heartbeat) and f.name in HEARTBEAT_ALTERNATIVES:
            continue
        if f.default is not dataclasses.MISSING:
            assert value != f.default, f"{msg.TYPE}.{f.name} is its default"
        if f.default_factory is not dataclasses.MISSING:
            assert value != f.default_factory(), f"{msg.TYPE}.{f.name} is its default"


@pytest.mark.parametrize(("msg", "body"), FULL, ids=[m.TYPE for m, _ in FULL])
def test_each_message_encodes_to_its_body_and_decodes_back_equal(
    msg: wire.Message, body: dict[str, Any]
) -> None:
    encoded = wire.encode_body(msg)
    assert encoded == msgpack.packb(body, use_bin_type=True)
    env = wire.decode(wire.encode(msg))
    assert env.msg == msg
    assert type(env.msg) is type(msg)
    assert env.body == encoded
    assert wire.encode_body(env.msg) == encoded


def test_enum_fields_decode_to_their_enums() -> None:
    msgs = {m.TYPE: wire.decode(wire.encode(m)).msg for m, _ in FULL}
    assert isinstance(msgs["assignment"].kind, TaskKind)  # type: ignore[attr-defined]
    assert isinstance(msgs["lease_reply"].state, TaskState)  # type: ignore[attr-defined]
    assert isinstance(msgs["result"].outcome, Outcome)  # type: ignore[attr-defined]


def test_the_auth_map_uses_its_short_keys() -> None:
    auth = wire.Auth(host_id="h1", generation=4, ts_ms=1_700_000_000_123, nonce=b"n" * 16,
                     signature=b"s" * 32)  # fmt: skip
    data = wire.encode(wire.Ok(), auth)
    raw = msgpack.unpackb(data, raw=False)
    assert list(raw["a"]) == ["h", "g", "ts", "n", "s"]
    assert wire.decode(data).auth == auth
