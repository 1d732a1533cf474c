"""Database URLs: libpq's multi-host form with ``target_session_attrs`` is
accepted and converted to the asyncpg form the engine connects with; a bad
one is a ``ValueError`` naming what is wrong."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from fleetlease.persistence.db import (
    DEFAULT_CONNECT_TIMEOUT_S,
    async_url,
    connect_timeout,
    create_engine,
    redact,
)


def hosts(url: str) -> tuple[str, ...]:
    host = make_url(url).query["host"]
    return (host,) if isinstance(host, str) else tuple(host)


def test_the_libpq_multi_host_form_becomes_one_host_parameter_each() -> None:
    url = async_url(
        "postgresql://fl:s3cret@db1.example:5432,db2.example:6432/fleet"
        "?target_session_attrs=read-write&sslmode=require"
    )
    u = make_url(url)
    assert u.drivername == "postgresql+asyncpg"
    assert (u.username, u.password, u.database) == ("fl", "s3cret", "fleet")
    assert hosts(url) == ("db1.example:5432", "db2.example:6432")
    assert u.query["target_session_attrs"] == "read-write"
    assert u.query["sslmode"] == "require"


def test_a_host_without_a_port_gets_postgresqls_default() -> None:
    assert hosts(async_url("postgres://fl@db1,db2:5433/fleet")) == ("db1:5432", "db2:5433")


def test_the_engine_connects_to_every_host_in_order() -> None:
    engine = create_engine(
        "postgresql://fl@db1:5432,db2:5433/fleet?target_session_attrs=read-write"
    )
    _, params = engine.dialect.create_connect_args(engine.url)
    assert params["host"] == ["db1", "db2"]
    assert params["port"] == [5432, 5433]
    assert params["target_session_attrs"] == "read-write"


def test_one_host_urls_are_unchanged() -> None:
    assert async_url("postgresql://fl@db1:5432/fleet") == "postgresql+asyncpg://fl@db1:5432/fleet"
    assert make_url(async_url("postgresql://postgres:@/fl?host=/run/pg")).query["host"] == (
        "/run/pg"
    )


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql://fl@db1,db2/fleet?target_session_attrs=primary-ish", "target_session_attrs"),
        ("postgresql://fl@db1,db2/fleet?host=db3", "not both"),
        ("postgresql://fl@db1,,db2/fleet", "empty host"),
        ("postgresql://fl@db1:x,db2/fleet", "bad host:port"),
        ("postgresql://fl@[::1]:5432,db2/fleet", "IPv6"),
        ("mysql://fl@db1/fleet", "unsupported"),
        ("postgresql://fl@db1,db2/fleet?connect_timeout=0", "connect_timeout"),
        ("postgresql://fl@db1,db2/fleet?connect_timeout=soon", "connect_timeout"),
    ],
)
def test_a_bad_url_is_refused_with_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        async_url(url)


def test_redact_hides_the_password_of_a_multi_host_url() -> None:
    shown = redact("postgresql://fl:s3cret@db1:5432,db2:5432/fleet?target_session_attrs=read-write")
    assert "s3cret" not in shown
    assert "db1" in shown and "db2" in shown


def test_connect_timeout_is_per_host_seconds_and_left_out_of_the_driver_url() -> None:
    url = "postgresql://fl@db1,db2/fleet?connect_timeout=2.5&target_session_attrs=read-write"
    assert connect_timeout(url) == 2.5
    assert "connect_timeout" not in make_url(async_url(url)).query
    assert connect_timeout("postgresql://fl@db1/fleet") == DEFAULT_CONNECT_TIMEOUT_S
