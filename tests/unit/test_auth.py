from __future__ import annotations

import dataclasses
import hmac
import os
import stat
from pathlib import Path

import pytest

from fleetlease.persistence.clock import ManualClock
from fleetlease.persistence.model import Outcome
from fleetlease.transport.auth import (
    AuthError,
    ServerSecret,
    ServerSecretError,
    Signer,
    Verifier,
    hash_secret,
    new_token,
    secrets_equal,
    session_key,
    sign,
)
from fleetlease.transport.subjects import Subjects
from fleetlease.transport.wire import (
    Ack,
    ArtifactChunk,
    Envelope,
    Heartbeat,
    Message,
    Renew,
    Result,
    decode,
    encode_body,
    encode_envelope,
)

SECRET = b"\x01" * 32
TASK = "0b4f6c1e-2a5d-4d0e-9a43-1f0c2b7e9d11"
S = Subjects()
ACK = Ack(task_id=TASK, attempt=1, lease_token="t" * 64)


def _pair(
    clock: ManualClock, *, host_id: str = "h1", generation: int = 4
) -> tuple[Signer, Verifier]:
    key = session_key(SECRET, host_id, generation)
    return Signer(host_id, generation, key, clock=clock), Verifier(SECRET, clock, window_s=30)


def _sealed(signer: Signer, subject: str) -> Envelope:
    return decode(signer.seal(subject, ACK))


def _reason(verifier: Verifier, subject: str, env: Envelope, generation: int | None = 4) -> str:
    with pytest.raises(AuthError) as info:
        verifier.verify_envelope(subject, env, generation)
    return info.value.reason


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def test_good_signature_verifies(clock: ManualClock) -> None:
    signer, verifier = _pair(clock)
    env = _sealed(signer, S.ack("h1"))
    verifier.verify_envelope(S.ack("h1"), env, 4)
    assert env.auth is not None and env.auth.host_id == "h1" and env.auth.generation == 4


def test_tampered_body_fails(clock: ManualClock) -> None:
    signer, verifier = _pair(clock)
    env = _sealed(signer, S.ack("h1"))
    forged = encode_body(Ack(task_id=TASK, attempt=2, lease_token="t" * 64))
    with pytest.raises(AuthError) as info:
        verifier.verify(S.ack("h1"), env.auth, forged, 4, msg_type="ack")
    assert (info.value.code, info.value.reason) == ("unauthorized", "bad_signature")


def test_tampered_subject_fails(clock: ManualClock) -> None:
    signer, verifier = _pair(clock)
    env = _sealed(signer, S.ack("h1"))
    assert _reason(verifier, S.renew("h1"), env) == "bad_signature"


def test_changed_type_fails_even_with_identical_body(clock: ManualClock) -> None:
    signer, verifier = _pair(clock)
    env = _sealed(signer, S.ack("h1"))
    assert env.body == encode_body(Renew(task_id=TASK, attempt=1, lease_token="t" * 64))
    with pytest.raises(AuthError) as info:
        verifier.verify(S.ack("h1"), env.auth, env.body, 4, msg_type="renew")
    assert info.value.reason == "bad_signature"


@pytest.mark.parametrize(
    "change",
    [
        {"ts_ms": 1},
        {"nonce": b"\x00" * 16},
        {"signature": b"\x00" * 32},
    ],
)
def test_tampered_auth_fields_fail(clock: ManualClock, change: dict[str, object]) -> None:
    signer, verifier = _pair(clock)
    env = _sealed(signer, S.ack("h1"))
    assert env.auth is not None
    changes = dict(change)
    if "ts_ms" in changes:
        changes["ts_ms"] = env.auth.ts_ms + 1
    forged = dataclasses.replace(env, auth=dataclasses.replace(env.auth, **changes))  # type: ignore[arg-type]
    assert _reason(verifier, S.ack("h1"), forged) == "bad_signature"


def test_replay_fails(clock: ManualClock) -> None:
    signer, verifier = _pair(clock)
    env = _sealed(signer, S.ack("h1"))
    verifier.verify_envelope(S.ack("h1"), env, 4)
    assert _reason(verifier, S.ack("h1"), env) == "replay"


def test_a_failed_signature_does_not_burn_the_nonce(clock: ManualClock) -> None:
    signer, verifier = _pair(clock)
    env = _sealed(signer, S.ack("h1"))
    assert _reason(verifier, S.renew("h1"), env) == "bad_signature"
    verifier.verify_envelope(S.ack("h1"), env, 4)


def test_stale_and_future_timestamps_fail(clock: ManualClock) -> None:
    signer, verifier = _pair(clock)
    old = _sealed(signer, S.ack("h1"))
    clock.advance(30.001)
    assert _reason(verifier, S.ack("h1"), old) == "stale"
    future = _sealed(signer, S.ack("h1"))
    clock.advance(-30.002)
    assert _reason(verifier, S.ack("h1"), future) == "future"


def test_timestamps_within_the_window_pass(clock: ManualClock) -> None:
    signer, verifier = _pair(clock)
    env = _sealed(signer, S.ack("h1"))
    clock.advance(29.9)
    verifier.verify_envelope(S.ack("h1"), env, 4)


def test_replay_cache_forgets_entries_once_their_timestamp_is_stale(clock: ManualClock) -> None:
    signer, verifier = _pair(clock)
    for _ in range(5):
        verifier.verify_envelope(S.ack("h1"), _sealed(signer, S.ack("h1")), 4)
    assert len(verifier) == 5
    clock.advance(31)
    verifier.verify_envelope(S.ack("h1"), _sealed(signer, S.ack("h1")), 4)
    assert len(verifier) == 1


def test_full_replay_cache_refuses_rather_than_evicting(clock: ManualClock) -> None:
    signer, _ = _pair(clock)
    verifier = Verifier(SECRET, clock, max_entries=2)
    first = _sealed(signer, S.ack("h1"))
    verifier.verify_envelope(S.ack("h1"), first, 4)
    verifier.verify_envelope(S.ack("h1"), _sealed(signer, S.ack("h1")), 4)
    with pytest.raises(AuthError) as info:
        verifier.verify_envelope(S.ack("h1"), _sealed(signer, S.ack("h1")), 4)
    assert (info.value.code, info.value.retryable) == ("unavailable", True)
    assert _reason(verifier, S.ack("h1"), first) == "replay"


def test_wrong_generation_fails(clock: ManualClock) -> None:
    signer, verifier = _pair(clock, generation=4)
    env = _sealed(signer, S.ack("h1"))
    assert _reason(verifier, S.ack("h1"), env, generation=5) == "generation"
    assert _reason(verifier, S.ack("h1"), env, generation=None) == "no_session"


def test_old_generation_key_cannot_sign_for_the_current_generation(clock: ManualClock) -> None:
    old_key = session_key(SECRET, "h1", 3)
    signer = Signer("h1", 4, old_key, clock=clock)
    verifier = Verifier(SECRET, clock)
    assert _reason(verifier, S.ack("h1"), _sealed(signer, S.ack("h1"))) == "bad_signature"


def test_host_mismatch_is_forbidden(clock: ManualClock) -> None:
    signer, verifier = _pair(clock, host_id="h1")
    env = _sealed(signer, S.ack("h2"))
    with pytest.raises(AuthError) as info:
        verifier.verify_envelope(S.ack("h2"), env, 4)
    assert (info.value.code, info.value.reason) == ("forbidden", "host_mismatch")


def test_non_host_subject_is_forbidden(clock: ManualClock) -> None:
    signer, verifier = _pair(clock)
    env = _sealed(signer, S.ops("alice", "submit"))
    with pytest.raises(AuthError) as info:
        verifier.verify_envelope(S.ops("alice", "submit"), env, 4)
    assert info.value.code == "forbidden"


def test_unsigned_message_is_unauthorized(clock: ManualClock) -> None:
    _, verifier = _pair(clock)
    with pytest.raises(AuthError) as info:
        verifier.verify(S.ack("h1"), None, encode_body(ACK), 4, msg_type="ack")
    assert (info.value.code, info.value.reason) == ("unauthorized", "missing")


def test_session_key_is_deterministic_and_differs_per_generation_host_and_secret() -> None:
    key = session_key(SECRET, "h1", 1)
    assert len(key) == 32
    assert key == session_key(ServerSecret(value=SECRET), "h1", 1)
    assert key != session_key(SECRET, "h1", 2)
    assert key != session_key(SECRET, "h2", 1)
    assert key != session_key(b"\x02" * 32, "h1", 1)


def test_session_key_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="server_secret"):
        session_key(b"short", "h1", 1)
    with pytest.raises(ValueError, match="host_id"):
        session_key(SECRET, "h.1", 1)
    with pytest.raises(ValueError, match="generation"):
        session_key(SECRET, "h1", -1)


def test_signature_fields_are_length_prefixed() -> None:
    key = b"k" * 32
    base = sign(key, "ab", b"c", 1, b"n" * 16, msg_type="x")
    assert base != sign(key, "a", b"bc", 1, b"n" * 16, msg_type="x")
    assert base != sign(key, "ab", b"c", 1, b"n" * 16, msg_type="y")


def test_signature_compare_is_constant_time(
    clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = hmac.compare_digest
    calls: list[tuple[bytes, bytes]] = []

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    signer, verifier = _pair(clock)
    env = _sealed(signer, S.ack("h1"))
    verifier.verify_envelope(S.ack("h1"), env, 4)
    assert env.auth is not None
    assert calls == [(env.auth.signature, env.auth.signature)]


def test_secret_helpers() -> None:
    token = new_token()
    assert len(token) == 64 and int(token, 16) >= 0
    assert new_token() != token
    assert hash_secret("x") == hash_secret("x") != hash_secret("y")
    assert secrets_equal(hash_secret("x"), hash_secret("x"))
    assert not secrets_equal(hash_secret("x"), hash_secret("y"))


def test_server_secret_is_created_once_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "state" / "server.secret"
    first = ServerSecret.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == first.value and len(first.value) == 32
    assert ServerSecret.load_or_create(path) == first
    assert [p.name for p in path.parent.iterdir()] == ["server.secret"]
    assert first.value.hex() not in repr(first)


def test_server_secret_refuses_a_world_readable_or_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "server.secret"
    ServerSecret.load_or_create(path)
    os.chmod(path, 0o644)
    with pytest.raises(ServerSecretError, match="chmod"):
        ServerSecret.load_or_create(path)
    os.chmod(path, 0o600)
    path.write_bytes(b"short")
    with pytest.raises(ServerSecretError, match="bytes"):
        ServerSecret.load_or_create(path)


def test_signer_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="host_id"):
        Signer("h>", 1, b"k" * 32)
    with pytest.raises(ValueError, match="key"):
        Signer("h1", 1, b"k")
    with pytest.raises(ValueError, match="generation"):
        Signer("h1", True, b"k" * 32)


@pytest.mark.parametrize(
    "msg",
    [
        ACK,
        Renew(task_id=TASK, attempt=7, lease_token="r" * 43),
        Result(
            task_id=TASK,
            attempt=2,
            lease_token="t" * 43,
            outcome=Outcome.FAILED,
            retryable=True,
            reason="ünïcode",
            result={"big": "x" * 70_000},  # a bin32 body
            fingerprint="f" * 64,
        ),
        ArtifactChunk(
            task_id=TASK, attempt=1, lease_token="t" * 64, name="a", offset=0, data=b"\0" * 300
        ),  # bin16
        Heartbeat(devices=[]),
    ],
)
@pytest.mark.parametrize("clocked", [True, False])
def test_seal_is_exactly_the_envelope_of_sign(msg: Message, clocked: bool) -> None:
    """Signer.seal assembles the envelope from cached pieces: its bytes must be
    those of encode_envelope around sign()'s signature, whatever the body size,
    with the system clock and with an injected one, on every call."""
    key = session_key(SECRET, "h-7", 123_456)
    signer = Signer("h-7", 123_456, key, clock=ManualClock() if clocked else None)
    for subject in (S.ack("h-7"), S.result("h-7"), S.ack("h-7")):
        data = signer.seal(subject, msg)
        env = decode(data)
        auth = env.auth
        assert auth is not None
        body = encode_body(msg)
        assert env.body == body and env.msg == msg
        assert auth.host_id == "h-7" and auth.generation == 123_456
        assert auth.signature == sign(key, subject, body, auth.ts_ms, auth.nonce, msg_type=msg.TYPE)
        assert data == encode_envelope(msg.TYPE, body, auth)
        Verifier(SECRET, ManualClock(), window_s=1e9).verify_envelope(subject, env, 123_456)


def test_auth_signs_the_same_bytes_as_sign(clock: ManualClock) -> None:
    key = session_key(SECRET, "h1", 4)
    signer = Signer("h1", 4, key, clock=clock)
    auth = signer.auth(S.renew("h1"), "renew", b"body")
    assert auth.ts_ms == int(clock.now().timestamp() * 1000)
    assert auth.signature == sign(
        key, S.renew("h1"), b"body", auth.ts_ms, auth.nonce, msg_type="renew"
    )
    assert signer.auth(S.renew("h1"), "renew", b"body").nonce != auth.nonce
