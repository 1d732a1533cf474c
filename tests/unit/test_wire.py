from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetlease.persistence.model import Outcome, TaskKind, TaskState
from fleetlease.transport import wire
from fleetlease.transport.wire import (
    MESSAGE_TYPES,
    Ack,
    ArtifactChunk,
    ArtifactCommit,
    Assignment,
    Auth,
    CancelPoll,
    CancelStatus,
    Claim,
    DecodeError,
    Device,
    Error,
    Heartbeat,
    LeaseReply,
    LogAppend,
    Message,
    NoWork,
    Ok,
    OpsReply,
    OpsRequest,
    Progress,
    Reconcile,
    ReconcileEntry,
    ReconcileResult,
    Register,
    RegisterOk,
    RemoteError,
    Renew,
    Result,
    ResultReply,
    Verdict,
    decode,
    decode_reply,
    encode,
    encode_reply,
    error_reply,
)

TASK = "0b4f6c1e-2a5d-4d0e-9a43-1f0c2b7e9d11"
LEASE = "6a1f0f5e-93a1-4b8c-8f0d-5c6c1a1d2e3f"
TOKEN = "ab" * 32
PROOF = {"host_id": "h1", "proof": b"p" * 64, "ts_ms": 1, "nonce": b"n" * 16}

SAMPLES: list[Message] = [
    Register(host_id="h1", credential="0f" * 32, agent_version="1.2.3"),
    RegisterOk(host_id="h1", generation=3, session_key=b"k" * 32, lease_s=30.0, heartbeat_s=5.0),
    Heartbeat(
        devices=[
            Device(device_id="emulator-5554", state="idle", capabilities={"os": "android"}),
            Device(device_id="192.168.1.5:5555", state="busy"),
        ]
    ),
    Reconcile(entries=[ReconcileEntry(task_id=TASK, attempt=2, lease_token=TOKEN)]),
    ReconcileResult(
        generation=3,
        verdicts=[
            Verdict(
                task_id=TASK,
                attempt=2,
                verdict="confirmed",
                reason="",
                cancel_requested=True,
                lease_expires_at=1_900_000_000.5,
            ),
            Verdict(task_id=TASK, attempt=1, verdict="discard", reason="stale attempt"),
        ],
    ),
    Ok(),
    Claim(wait_s=20.0, devices=["d1", "d2"]),
    Assignment(
        task_id=TASK,
        attempt=1,
        device_id="d1",
        lease_id=LEASE,
        lease_token=TOKEN,
        kind=TaskKind.GOAL,
        goal="open settings",
        workflow=None,
        payload={"n": 1, "nested": {"x": [1, 2.5, None, True, "s"]}},
        ack_deadline=1_900_000_015.0,
        lease_s=30.0,
    ),
    NoWork(),
    Ack(task_id=TASK, attempt=1, lease_token=TOKEN),
    Renew(task_id=TASK, attempt=1, lease_token=TOKEN),
    Progress(task_id=TASK, attempt=1, lease_token=TOKEN, seq=7, message="50%"),
    LeaseReply(
        task_id=TASK,
        attempt=1,
        state=TaskState.RUNNING,
        lease_expires_at=1_900_000_030.0,
        cancel_requested=False,
    ),
    Result(
        task_id=TASK,
        attempt=1,
        lease_token=TOKEN,
        outcome=Outcome.FAILED,
        retryable=True,
        reason="device vanished",
        result={"exit": 3},
        fingerprint="sha256:abc",
    ),
    ResultReply(
        task_id=TASK,
        attempt=1,
        state=TaskState.RETRYING,
        outcome=Outcome.FAILED,
        fingerprint="sha256:abc",
        replayed=False,
        retry_at=1_900_000_002.0,
    ),
    CancelPoll(task_id=TASK, attempt=1, lease_token=TOKEN),
    CancelStatus(task_id=TASK, attempt=1, cancel_requested=True),
    LogAppend(task_id=TASK, attempt=1, first_seq=10, lines=["a", "b", "ü"]),
    ArtifactChunk(
        task_id=TASK, attempt=1, lease_token=TOKEN, name="screen.png", offset=0, data=b"\x89PNG"
    ),
    ArtifactCommit(
        task_id=TASK, attempt=1, lease_token=TOKEN, name="screen.png", size=4, sha256="0" * 64
    ),
    OpsRequest(token=TOKEN, verb="submit", args={"kind": "goal", "goal": "x"}),
    OpsReply(data={"tasks": [{"id": TASK}], "blob": b"raw"}),
    Error(code="conflict", message="stale attempt"),
    Register(host_id="h1", proof=b"p" * 64, ts_ms=1_700_000_000_000, nonce=b"n" * 16),
]


def _env(t: str, body: Any, **extra: Any) -> bytes:
    env = {"v": 1, "t": t, "b": msgpack.packb(body, use_bin_type=True), **extra}
    return bytes(msgpack.packb(env, use_bin_type=True))


def _decode_error(data: bytes) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        decode(data)
    assert info.value.code == "bad_request"
    return info.value


def test_samples_cover_every_message_type() -> None:
    assert {m.TYPE for m in SAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TYPE)
def test_every_message_type_round_trips(msg: Message) -> None:
    env = decode(encode(msg))
    assert env.version == 1
    assert env.msg == msg
    assert type(env.msg) is type(msg)
    assert env.auth is None
    assert env.body == wire.encode_body(msg)


def test_envelope_carries_the_body_as_bytes_and_auth_when_given() -> None:
    auth = Auth(host_id="h1", generation=2, ts_ms=123, nonce=b"n" * 16, signature=b"s" * 32)
    data = encode(Ack(task_id=TASK, attempt=1, lease_token=TOKEN), auth=auth)
    raw = msgpack.unpackb(data, raw=False)
    assert raw["v"] == 1 and raw["t"] == "ack" and isinstance(raw["b"], bytes)
    assert decode(data).auth == auth


def test_enums_decode_as_enum_members() -> None:
    msg = decode(encode(SAMPLES[12])).msg
    assert isinstance(msg, LeaseReply)
    assert msg.state is TaskState.RUNNING


def test_task_ids_are_normalised_to_lowercase() -> None:
    msg = decode(_env("ack", {"task_id": TASK.upper(), "attempt": 1, "lease_token": "t"})).msg
    assert isinstance(msg, Ack) and msg.task_id == TASK


def test_unknown_fields_are_ignored() -> None:
    body = {"task_id": TASK, "attempt": 1, "lease_token": "t", "future_field": [1, 2]}
    data = _env("renew", body, future_envelope_field="x")
    assert decode(data).msg == Renew(task_id=TASK, attempt=1, lease_token="t")


def test_optional_fields_take_their_defaults() -> None:
    body = {"task_id": TASK, "attempt": 1, "lease_token": "t", "seq": 0}
    assert decode(_env("progress", body)).msg == Progress(
        task_id=TASK, attempt=1, lease_token="t", seq=0, message=""
    )
    assert decode(_env("claim", {})).msg == Claim(wait_s=0.0, devices=[])


@pytest.mark.parametrize(
    ("data", "reason", "field"),
    [
        (b"", "not_msgpack", None),
        (b"\xc1", "not_msgpack", None),
        (msgpack.packb([1, 2]), "not_a_map", None),
        (msgpack.packb({"v": 1}) + b"\x00", "trailing_data", None),
        (msgpack.packb({"t": "ok", "b": b"\x80"}), "missing_field", "v"),
        (msgpack.packb({"v": 2, "t": "ok", "b": b"\x80"}), "wrong_version", "v"),
        (msgpack.packb({"v": True, "t": "ok", "b": b"\x80"}), "wrong_type", "v"),
        (msgpack.packb({"v": 1, "t": "nope", "b": b"\x80"}), "unknown_type", "t"),
        (msgpack.packb({"v": 1, "t": 5, "b": b"\x80"}), "wrong_type", "t"),
        (msgpack.packb({"v": 1, "t": "ok"}), "missing_field", "b"),
        (msgpack.packb({"v": 1, "t": "ok", "b": {}}, use_bin_type=True), "wrong_type", "b"),
        (msgpack.packb({"v": 1, "t": "ok", "b": b"\x90"}), "not_a_map", "b"),
        (msgpack.packb({"v": 1, "t": "ok", "b": b"\x80\x00"}), "trailing_data", "b"),
        (msgpack.packb({"v": 1, "t": "ok", "b": b"\xc1"}), "not_msgpack", "b"),
        (msgpack.packb({1: 1}), "not_msgpack", None),
        (msgpack.packb(msgpack.ExtType(5, b"")), "not_msgpack", None),
        (msgpack.packb({"v": 1, "t": "ok", "b": b"\x80", "a": {}}), "missing_field", "a.h"),
    ],
)
def test_malformed_envelopes_are_rejected_with_a_reason(
    data: bytes, reason: str, field: str | None
) -> None:
    err = _decode_error(data)
    assert (err.reason, err.field) == (reason, field)


def test_non_bytes_input_is_rejected() -> None:
    with pytest.raises(DecodeError) as info:
        decode("text")  # type: ignore[arg-type]
    assert info.value.reason == "not_bytes"


def test_oversize_message_is_rejected_before_parsing() -> None:
    data = encode(
        ArtifactChunk(
            task_id=TASK, attempt=1, lease_token=TOKEN, name="a", offset=0, data=b"x" * 1000
        )
    )
    assert decode(data, max_size=len(data))
    with pytest.raises(DecodeError) as info:
        decode(data, max_size=len(data) - 1)
    assert info.value.reason == "too_big"


def test_timestamp_ext_type_is_rejected() -> None:
    data = _env("ok", {"when": msgpack.Timestamp(1, 0)})
    assert _decode_error(data).reason == "not_msgpack"


ACK = {"task_id": TASK, "attempt": 1, "lease_token": "t"}


@pytest.mark.parametrize(
    ("t", "body", "reason", "field"),
    [
        ("ack", {"attempt": 1, "lease_token": "t"}, "missing_field", "task_id"),
        ("ack", {**ACK, "task_id": "not-a-uuid"}, "out_of_range", "task_id"),
        ("ack", {**ACK, "task_id": 5}, "wrong_type", "task_id"),
        ("ack", {**ACK, "attempt": True}, "wrong_type", "attempt"),
        ("ack", {**ACK, "attempt": 1.0}, "wrong_type", "attempt"),
        ("ack", {**ACK, "attempt": "1"}, "wrong_type", "attempt"),
        ("ack", {**ACK, "attempt": 0}, "out_of_range", "attempt"),
        ("ack", {**ACK, "attempt": 2**31}, "out_of_range", "attempt"),
        ("ack", {**ACK, "lease_token": ""}, "out_of_range", "lease_token"),
        ("ack", {**ACK, "lease_token": b"t"}, "wrong_type", "lease_token"),
        ("progress", {**ACK, "seq": -1}, "out_of_range", "seq"),
        ("progress", {**ACK, "seq": False}, "wrong_type", "seq"),
        ("claim", {"wait_s": 61}, "out_of_range", "wait_s"),
        ("claim", {"wait_s": -0.1}, "out_of_range", "wait_s"),
        ("claim", {"wait_s": float("nan")}, "out_of_range", "wait_s"),
        ("claim", {"wait_s": True}, "wrong_type", "wait_s"),
        ("claim", {"devices": "d1"}, "wrong_type", "devices"),
        ("claim", {"devices": ["d1", 2]}, "wrong_type", "devices[1]"),
        ("register", {"host_id": "h.1", "credential": "0" * 64}, "out_of_range", "host_id"),
        ("register", {"host_id": "h1", "credential": "0" * 63}, "out_of_range", "credential"),
        ("register", {"host_id": "h1"}, "missing_field", "credential"),
        ("register", {**PROOF, "credential": "0" * 64}, "out_of_range", "credential"),
        ("register", {**PROOF, "proof": b"p" * 63}, "out_of_range", "proof"),
        ("register", {**PROOF, "proof": "p" * 64}, "wrong_type", "proof"),
        ("register", {**PROOF, "nonce": b"n" * 15}, "out_of_range", "nonce"),
        ("register", {"host_id": "h1", "proof": b"p" * 64, "nonce": b"n" * 16}, "missing_field",
         "ts_ms"),
        ("heartbeat", {"devices": [{"device_id": "d", "state": "on"}]}, "out_of_range",
         "devices[0].state"),
        ("heartbeat", {"devices": [{"state": "idle"}]}, "missing_field", "devices[0].device_id"),
        ("heartbeat", {"devices": [1]}, "wrong_type", "devices[0]"),
        ("heartbeat", {"devices": [{"device_id": "d", "state": "idle", "capabilities": {"a": 1}}]},
         "wrong_type", "devices[0].capabilities"),
        ("heartbeat", {"devices": [{"device_id": "d", "state": "idle"}] * 1025}, "out_of_range",
         "devices"),
        ("result", {**ACK, "outcome": "maybe", "fingerprint": "f"}, "out_of_range", "outcome"),
        ("result", {**ACK, "outcome": "done"}, "missing_field", "fingerprint"),
        ("result", {**ACK, "outcome": "done", "fingerprint": "f", "retryable": 1}, "wrong_type",
         "retryable"),
        ("result", {**ACK, "outcome": "done", "fingerprint": "f", "result": {"b": b"x"}},
         "wrong_type", "result"),
        ("result", {**ACK, "outcome": "done", "fingerprint": "f", "result": []}, "wrong_type",
         "result"),
        ("log_append", {"task_id": TASK, "attempt": 1, "first_seq": 0, "lines": ["x" * 8193]},
         "out_of_range", "lines[0]"),
        ("log_append", {"task_id": TASK, "attempt": 1, "first_seq": 0, "lines": ["€" * 4000]},
         "out_of_range", "lines[0]"),
        ("log_append", {"task_id": TASK, "attempt": 1, "first_seq": 0, "lines": ["x"] * 1001},
         "out_of_range", "lines"),
        ("artifact_chunk", {"task_id": TASK, "attempt": 1, "lease_token": TOKEN, "name": "a",
                            "offset": 0,
                            "data": "text"}, "wrong_type", "data"),
        ("artifact_commit", {"task_id": TASK, "attempt": 1, "lease_token": TOKEN, "name": "a",
                             "size": 1,
                             "sha256": "Z" * 64}, "out_of_range", "sha256"),
        ("lease_reply", {"task_id": TASK, "attempt": 1, "state": "sleeping",
                         "lease_expires_at": 1.0}, "out_of_range", "state"),
        ("error", {"code": "teapot", "message": ""}, "out_of_range", "code"),
        ("ops_request", {"token": "t", "verb": "a.b"}, "out_of_range", "verb"),
    ],
)  # fmt: skip
def test_bad_fields_are_rejected_naming_the_field(
    t: str, body: dict[str, Any], reason: str, field: str
) -> None:
    err = _decode_error(_env(t, body))
    assert (err.reason, err.field) == (reason, field)
    assert field in err.message


def test_float_fields_accept_ints() -> None:
    body = {"task_id": TASK, "attempt": 1, "state": "running", "lease_expires_at": 1_900_000_000}
    msg = decode(_env("lease_reply", body)).msg
    assert isinstance(msg, LeaseReply)
    assert msg.lease_expires_at == 1_900_000_000.0
    assert isinstance(msg.lease_expires_at, float)


def test_deeply_nested_payload_is_rejected_not_crashed() -> None:
    deep: Any = {}
    for _ in range(200):
        deep = {"x": deep}
    body = {**ACK, "outcome": "done", "fingerprint": "f", "result": deep}
    assert _decode_error(_env("result", body)).field == "result"


def test_auth_fields_are_validated() -> None:
    good = {"h": "h1", "g": 1, "ts": 1, "n": b"n" * 16, "s": b"s" * 32}
    for key, value, reason in [
        ("n", b"short", "out_of_range"),
        ("s", b"s" * 31, "out_of_range"),
        ("g", True, "wrong_type"),
        ("h", "h*", "out_of_range"),
        ("ts", -1, "out_of_range"),
    ]:
        err = _decode_error(_env("ok", {}, a={**good, key: value}))
        assert (err.reason, err.field) == (reason, f"a.{key}")


def test_error_reply_and_decode_reply() -> None:
    data = error_reply("unavailable", "database down")
    with pytest.raises(RemoteError) as info:
        decode_reply(data, Ok)
    assert (info.value.code, info.value.message, info.value.retryable) == (
        "unavailable",
        "database down",
        True,
    )
    with pytest.raises(RemoteError) as info:
        decode_reply(error_reply("conflict", "x"), Ok)
    assert info.value.retryable is False


def test_decode_reply_checks_the_expected_type() -> None:
    assert decode_reply(encode_reply(Ok()), Ok) == Ok()
    assert decode_reply(encode_reply(NoWork()), (Assignment, NoWork)) == NoWork()
    with pytest.raises(DecodeError) as info:
        decode_reply(encode_reply(NoWork()), Ok)
    assert info.value.field == "t"


def test_error_code_must_be_known() -> None:
    with pytest.raises(ValueError, match="code"):
        error_reply("teapot", "short and stout")


def test_repr_hides_secrets() -> None:
    assert TOKEN not in repr(Ack(task_id=TASK, attempt=1, lease_token=TOKEN))
    assert "0f0f" not in repr(SAMPLES[0])


def test_decode_error_is_not_pickle() -> None:
    # A pickle stream is not msgpack; it must be refused, never unpickled.
    import pickle

    assert _decode_error(pickle.dumps({"v": 1})).reason in {
        "not_msgpack",
        "trailing_data",
        "not_a_map",
    }


@settings(max_examples=500)
@given(st.binary(max_size=512))
def test_decode_of_arbitrary_bytes_raises_only_decode_error(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode(data)


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)


def _containers(children: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    # A named function, not a lambda: hypothesis inspects the source of `extend`
    # to check it recurses, and a multi-line lambda's source is not always found.
    return st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=10), children, max_size=4),
    )


_values = st.recursive(_leaf, _containers, max_leaves=20)


@settings(max_examples=300)
@given(_values)
def test_decode_of_arbitrary_msgpack_raises_only_decode_error(value: Any) -> None:
    with contextlib.suppress(DecodeError):
        decode(msgpack.packb(value, use_bin_type=True))


@settings(max_examples=500)
@given(
    t=st.sampled_from(sorted(MESSAGE_TYPES)),
    body=st.dictionaries(
        st.sampled_from(
            [
                "task_id", "attempt", "lease_token", "host_id", "credential", "devices",
                "entries", "verdicts", "generation", "wait_s", "seq", "outcome", "fingerprint",
                "lines", "first_seq", "data", "name", "size", "sha256", "code", "message",
                "token", "verb", "args", "payload", "result", "state", "kind",
                "lease_expires_at", "session_key", "lease_s", "heartbeat_s", "ack_deadline",
                "device_id", "lease_id", "cancel_requested", "offset", "retry_at", "replayed",
            ]
        ),
        _values,
        max_size=12,
    ),
    auth=st.one_of(st.none(), _values),
)  # fmt: skip
def test_decode_of_typed_envelopes_with_arbitrary_bodies_raises_only_decode_error(
    t: str, body: dict[str, Any], auth: Any
) -> None:
    extra = {} if auth is None else {"a": auth}
    try:
        env = decode(_env(t, body, **extra))
    except DecodeError:
        return
    # Whatever was accepted re-encodes to something that decodes to the same message
    # (compared as bytes: a NaN anywhere in the data is never equal to itself).
    again = decode(encode(env.msg)).msg
    assert encode(again) == encode(env.msg)


def test_a_register_carries_exactly_one_of_credential_or_proof() -> None:
    with pytest.raises(ValueError):
        Register(host_id="h1")
    with pytest.raises(ValueError):
        Register(host_id="h1", credential="0f" * 32, proof=b"p" * 64, ts_ms=1, nonce=b"n" * 16)
    with pytest.raises(ValueError):
        Register(host_id="h1", proof=b"p" * 64)
    proof = Register(host_id="h1", proof=b"p" * 64, ts_ms=1, nonce=b"n" * 16)
    assert "credential" not in proof.to_body()
    assert "p" * 8 not in repr(proof)


def test_a_heartbeat_without_an_advert_decodes_as_any_workflow() -> None:
    from fleetlease.transport import wire

    old = wire.Heartbeat(devices=[])
    again = wire.decode(wire.encode(old)).msg
    assert isinstance(again, wire.Heartbeat)
    assert again.workflows is None and again.goal_runner == ""
    new = wire.Heartbeat(devices=[], workflows=["build", "smoke"], goal_runner="command-goal")
    back = wire.decode(wire.encode(new)).msg
    assert isinstance(back, wire.Heartbeat)
    assert (back.workflows, back.goal_runner) == (["build", "smoke"], "command-goal")
