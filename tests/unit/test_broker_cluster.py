"""The secured cluster's member configs (``transport/broker_cluster.py``) and
``fleetlease broker config``: members parsed strictly, every member routing to
every other with the route secret, bad input refused before anything is written."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fleetlease.ops.cli import main
from fleetlease.transport.broker_cluster import (
    ClusterSpec,
    Member,
    client_urls,
    cluster_configs,
    load_or_create_route_secret,
    member_config,
    parse_members,
)
from fleetlease.transport.broker_config import BrokerConfigError, BrokerKeys, TlsFiles

SECRET = "ab" * 32


def test_members_parse_with_the_default_route_port_and_ipv6() -> None:
    members = parse_members(" n1=nats-1.example:7000, n2=nats-2.example ,n3=[::1]:6300")
    assert members == (
        Member("n1", "nats-1.example", 7000),
        Member("n2", "nats-2.example", 6222),
        Member("n3", "::1", 6300),
    )
    assert members[2].route_address() == "[::1]:6300"


@pytest.mark.parametrize(
    "text",
    [
        "n1=a:6222",  # one member is no cluster
        "",
        "n1=a,n1=b",  # names repeat
        "n1=a:6222,n2=a",  # the same address twice
        "n1=a:x,n2=b",  # a port that is no number
        "n1=a:0,n2=b",
        "n1=a:70000,n2=b",
        "n1,n2=b",  # no address
        "=a,n2=b",
        "n 1=a,n2=b",  # a name that is no token
        "n1=a b,n2=c",  # a host that is no host
        "n1=-a,n2=c",
        "n\n1=a,n2=b",  # a line break in a name or a host
        "n1=a\nb,n2=c",
    ],
)
def test_bad_members_are_refused(text: str) -> None:
    with pytest.raises(BrokerConfigError):
        parse_members(text)


def test_a_spec_needs_a_well_formed_route_secret() -> None:
    members = parse_members("a=h1,b=h2")
    with pytest.raises(BrokerConfigError):
        ClusterSpec(members=members, route_secret="short")
    with pytest.raises(BrokerConfigError):
        ClusterSpec(members=members, route_secret=SECRET, name="two words")
    assert SECRET not in repr(ClusterSpec(members=members, route_secret=SECRET))


def test_each_member_routes_to_the_others_with_the_route_secret(tmp_path: Path) -> None:
    keys = BrokerKeys.load_or_create(tmp_path / "broker")
    spec = ClusterSpec(members=parse_members("a=h1:6001,b=h2:6002,c=h3:6003"), route_secret=SECRET)
    configs = cluster_configs(keys, spec)
    assert set(configs) == {"a", "b", "c"}
    for name, text in configs.items():
        me = spec.member(name)
        assert f'server_name: "{name}"' in text
        assert f'listen: "0.0.0.0:{me.route_port}"' in text  # the route listener
        assert 'listen: "0.0.0.0:4222"' in text  # the clients'
        for other in spec.members:
            route = f"nats-route://route:{SECRET}@{other.route_address()}"
            assert (route in text) == (other.name != name), (name, other)
        # A member that stops answering is dropped in seconds, not minutes.
        assert 'ping_interval: "10s"' in text and "ping_max: 3" in text
        # The same accounts and callout issuer on every member.
        assert keys.issuer in text and "auth_callout" in text and "system_account: SYS" in text
    assert client_urls(spec) == "nats://h1:4222,nats://h2:4222,nats://h3:4222"
    with pytest.raises(BrokerConfigError):
        member_config(keys, spec, "nobody")


def test_with_a_ca_the_routes_verify_each_other(tmp_path: Path) -> None:
    for name in ("crt", "key", "ca"):
        (tmp_path / name).write_text("-")
    tls = TlsFiles(cert_file=tmp_path / "crt", key_file=tmp_path / "key", ca_file=tmp_path / "ca")
    keys = BrokerKeys.load_or_create(tmp_path / "broker")
    spec = ClusterSpec(members=parse_members("a=h1,b=h2"), route_secret=SECRET, tls=tls)
    text = member_config(keys, spec, "a")
    cluster = text[text.index("cluster {") :]
    assert "verify: true" in cluster and str(tmp_path / "ca") in cluster
    assert "verify" not in text[: text.index("cluster {")]  # clients: no certificate asked
    assert client_urls(spec).startswith("tls://h1:4222")


def test_the_route_secret_is_created_once_and_private(tmp_path: Path) -> None:
    first = load_or_create_route_secret(tmp_path / "broker")
    assert load_or_create_route_secret(tmp_path / "broker") == first
    path = tmp_path / "broker" / "route.secret"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    path.chmod(0o640)
    with pytest.raises(BrokerConfigError):
        load_or_create_route_secret(tmp_path / "broker")


def test_broker_config_writes_one_private_file_per_member(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state, out = tmp_path / "state", tmp_path / "conf"
    argv = ["broker", "config", "--state-dir", str(state), "--out", str(out)]
    assert main([*argv, "--cluster", "n1=127.0.0.1:6001,n2=127.0.0.1:6002"]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["n1.conf", "n2.conf"]
    secret = (state / "broker" / "route.secret").read_text().strip()
    for name in files:
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o600
        assert secret in (out / name).read_text()
    printed = capsys.readouterr().out
    assert "--broker-security" in printed and "nats://127.0.0.1:4222" in printed
    assert secret not in printed
    # Again: the same keys and secret, so the same configs.
    before = {n: (out / n).read_text() for n in files}
    assert main([*argv, "--cluster", "n1=127.0.0.1:6001,n2=127.0.0.1:6002"]) == 0
    assert {n: (out / n).read_text() for n in files} == before


@pytest.mark.parametrize(
    "extra",
    [
        ["--cluster", "n1=a"],
        ["--cluster", "n1=a,n2=b", "--cluster-name", "bad name"],
        ["--listen", "not a host"],
        ["--port", "0"],
        ["--tls-cert", "/nonexistent.crt"],
        ["--tls-cert", "/nonexistent.crt", "--tls-key", "/nonexistent.key"],
        ["--tls-ca", "/nonexistent.ca"],
    ],
)
def test_broker_config_refuses_bad_input_and_writes_nothing(
    tmp_path: Path, extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    state, out = tmp_path / "state", tmp_path / "conf"
    code = main(["broker", "config", "--state-dir", str(state), "--out", str(out), *extra])
    assert code == 2, capsys.readouterr()
    assert not out.exists()
    assert not (state / "broker").exists()


SERVE = [
    "serve",
    "--nats-url",
    "nats://127.0.0.1:1",
    "--database-url",
    "postgresql://x@127.0.0.1:1/x",
]


@pytest.mark.parametrize(("flag", "env"), [(True, None), (False, "1"), (False, "yes")])
def test_serve_with_broker_security_needs_the_broker_keys(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flag: bool,
    env: str | None,
) -> None:
    if env is not None:
        monkeypatch.setenv("FLEETLEASE_BROKER_SECURITY", env)
    argv = [*SERVE, "--state-dir", str(tmp_path / "state")]
    code = main([*argv, "--broker-security"] if flag else argv)
    assert code == 2
    assert "fleetlease broker config" in capsys.readouterr().err
    assert not (tmp_path / "state" / "broker").exists()


def test_a_bad_broker_security_setting_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETLEASE_BROKER_SECURITY", "maybe")
    assert main([*SERVE, "--state-dir", str(tmp_path / "state")]) == 2
    assert "FLEETLEASE_BROKER_SECURITY" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


def test_broker_config_without_cluster_writes_one_server_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state, out = tmp_path / "state", tmp_path / "nats.conf"
    argv = ["broker", "config", "--state-dir", str(state), "--out", str(out)]
    assert main([*argv, "--listen", "10.0.0.5", "--store-dir", "/var/lib/nats"]) == 0
    text = out.read_text()
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert 'listen: "10.0.0.5:4222"' in text and '"/var/lib/nats"' in text
    assert "auth_callout" in text and "cluster {" not in text
    assert BrokerKeys.load_or_create(state / "broker").issuer in text
    assert not (state / "broker" / "route.secret").exists()
    assert "--broker-security" in capsys.readouterr().out
