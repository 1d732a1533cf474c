"""The expiry of broker authorizations and how a revocation reads CONNZ names
(pure logic; the behaviour against a real server is in
``tests/integration/test_security_revoke.py``)."""

from __future__ import annotations

import argparse
import time

import nkeys
import pytest

from fleetlease.ops.cli import CliError
from fleetlease.ops.commands.system import timings_from_args
from fleetlease.transport.broker_auth import (
    DEFAULT_JWT_EXPIRES_S,
    JWT_EXPIRY_JITTER,
    BrokerAuthService,
    SqlCredentialStore,
    _undecided,
    new_seed,
    public_key,
    user_claims,
)
from fleetlease.transport.subjects import Subjects


def _service(**kw: object) -> BrokerAuthService:
    return BrokerAuthService(
        nats_url="nats://127.0.0.1:1",
        store=SqlCredentialStore(None),  # type: ignore[arg-type]
        issuer_seed=new_seed(nkeys.PREFIX_BYTE_ACCOUNT),
        service_seed=new_seed(nkeys.PREFIX_BYTE_USER),
        **kw,  # type: ignore[arg-type]
    )


def test_claims_expire_no_sooner_than_asked() -> None:
    before = time.time()
    claims = user_claims(Subjects("p"), "host", "h1", "UXYZ", expires_s=2.5)
    assert claims["exp"] >= before + 2.5 and isinstance(claims["exp"], int)
    assert "exp" not in user_claims(Subjects("p"), "host", "h1", "UXYZ", expires_s=None)


def test_issued_lifetimes_default_short_and_jittered_downwards_only() -> None:
    service = _service()
    assert service.jwt_expires_s == DEFAULT_JWT_EXPIRES_S
    low = DEFAULT_JWT_EXPIRES_S * (1 - JWT_EXPIRY_JITTER)
    for _ in range(200):
        lifetime = service._jwt_lifetime()
        assert lifetime is not None and low <= lifetime <= DEFAULT_JWT_EXPIRES_S
    assert _service(jwt_expires_s=None)._jwt_lifetime() is None


@pytest.mark.parametrize("bad", [0.0, 0.5, -1.0, float("nan"), float("inf")])
def test_a_lifetime_below_a_second_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="jwt_expires_s"):
        _service(jwt_expires_s=bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_a_callout_timeout_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="callout_timeout_s"):
        _service(callout_timeout_s=bad)


def test_which_connz_names_are_still_waiting_for_the_callout() -> None:
    # Sent CONNECT, not yet named by the callout: the server shows the token so.
    assert _undecided("[REDACTED]")
    assert _undecided("someone")  # a user/password attempt, refused in time
    # Not yet sent CONNECT: its request comes after any revocation committed.
    assert not _undecided("")
    assert not _undecided(None)
    # Decided: a principal the callout named, or a control-plane nkey user.
    assert not _undecided("host:h1")
    assert not _undecided("user:alice")
    assert not _undecided(public_key(new_seed(nkeys.PREFIX_BYTE_USER)))


def test_serve_refuses_an_expiry_below_a_second() -> None:
    args = argparse.Namespace(
        lease_s=30.0, claim_s=30.0, ack_s=15.0, liveness_s=30.0, heartbeat_s=5.0
    )
    timings_from_args(argparse.Namespace(**vars(args), broker_jwt_expiry_s=300.0))
    with pytest.raises(CliError, match="broker-jwt-expiry-s"):
        timings_from_args(argparse.Namespace(**vars(args), broker_jwt_expiry_s=0.0))
