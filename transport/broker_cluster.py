"""The nats-server configurations of a secured NATS cluster.

Every member runs the secure-mode config of ``transport/broker_config.py``
unchanged (the same accounts, the same auth callout issuer, the same
control-plane nkeys) plus what makes it a member::

    server_name: n1                      # unique, JetStream's name for it
    listen: "0.0.0.0:4222"               # clients
    ping_interval: "10s", ping_max: 3    # a silent member is dropped in ~30 s
    jetstream { store_dir: "..." }       # optional; else from the command line
    cluster {
      name: fleetlease
      listen: "0.0.0.0:6222"             # routes from the other members
      authorization { user: route, password: <route secret>, timeout: 5 }
      routes: [ "nats-route://route:<route secret>@n2.example:6222", ... ]
      tls { ... verify: true }           # when TLS files are given
    }

Routes carry every account's traffic and are not subject to the accounts'
permissions: a server that completes a route is a full member of the broker.
They therefore have their own credential, the **route secret** (32 random
bytes, hex, ``<state dir>/broker/route.secret``, mode 0600), which every member
requires of an incoming route and presents on its outgoing ones; with TLS files
and a CA the routes are also encrypted and each side verifies the other's
certificate against the CA. The generated configs hold that secret: they are written
0600 and must be handled like the seeds.

The auth callout works across the cluster: a member that receives a connect
publishes its authorization request into the ``AUTH`` account, whose
subscriptions the routes propagate, so the control plane's callout service
answers logins on every member while connected to any of them. It holds a
connection to more than one member (``BrokerAuthService``), so that the loss
of one member never leaves the others without a callout while the service
reconnects. The server hands each request to any subscriber of the queue
group, local or across a route: until the others drop a dead member's routes
(at once when its process dies, within ``PING_INTERVAL_S * PING_MAX`` when its
machine stops answering) some requests go to its callout connection, get no
answer, and those logins are refused after the authorization timeout and
retried by their clients.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from fleetlease.transport.broker_auth import DEFAULT_CALLOUT_TIMEOUT_S
from fleetlease.transport.broker_config import (
    BrokerConfigError,
    BrokerKeys,
    TlsFiles,
    _write_private,
    secure_config,
)
from fleetlease.transport.subjects import Subjects

#: The name of the route user every member requires of an incoming route.
ROUTE_USER = "route"
#: The cluster's name when none is given.
DEFAULT_CLUSTER_NAME = "fleetlease"
DEFAULT_CLIENT_PORT = 4222
DEFAULT_ROUTE_PORT = 6222
#: How often a member pings its routes and clients (seconds), and how many
#: unanswered pings make it close the connection as stale.
PING_INTERVAL_S = 10
PING_MAX = 3
#: Seconds a member gives an incoming route to authenticate.
_ROUTE_AUTH_TIMEOUT_S = 5.0
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_SECRET = re.compile(r"[0-9a-f]{64}")
#: A well-formed route secret that is nobody's, to check a spec before the real
#: one is read or created.
PLACEHOLDER_SECRET = "0" * 64
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


@dataclass(frozen=True)
class Member:
    """One member of the cluster: its server name and the address the other
    members open routes to."""

    name: str
    host: str
    route_port: int = DEFAULT_ROUTE_PORT

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise BrokerConfigError(
                f"member name {self.name!r}: letters, digits, '-' and '_', at most 64"
            )
        if not _valid_host(self.host):
            raise BrokerConfigError(f"member {self.name}: {self.host!r} is not a host name or IP")
        if not 0 < self.route_port < 65536:
            raise BrokerConfigError(f"member {self.name}: route port {self.route_port} is invalid")

    def route_address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.route_port}"


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return bool(_HOST.fullmatch(host))
    return True


def parse_members(text: str) -> tuple[Member, ...]:
    """``n1=nats-1.example:6222,n2=nats-2.example,n3=10.0.0.3:6222`` (the route
    port defaults to 6222). At least two members, names and addresses unique."""
    members: list[Member] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, address = part.partition("=")
        if not sep or not name.strip() or not address.strip():
            raise BrokerConfigError(f"cluster member {part!r}: expected NAME=HOST[:PORT]")
        members.append(_member(name.strip(), address.strip()))
    if len(members) < 2:
        raise BrokerConfigError("a cluster has at least two members")
    if len({m.name for m in members}) != len(members):
        raise BrokerConfigError("cluster member names must be unique")
    if len({m.route_address() for m in members}) != len(members):
        raise BrokerConfigError("cluster member addresses must be unique")
    return tuple(members)


def _member(name: str, address: str) -> Member:
    host, port = address, DEFAULT_ROUTE_PORT
    if address.startswith("["):  # [IPv6]:port
        host, _, rest = address[1:].partition("]")
        if rest:
            port = _port(name, rest.removeprefix(":"))
    elif address.count(":") == 1:
        host, _, text = address.partition(":")
        port = _port(name, text)
    return Member(name, host, port)


def _port(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise BrokerConfigError(f"member {name}: port {text!r} is not a number") from None


def load_or_create_route_secret(directory: str | os.PathLike[str]) -> str:
    """The cluster's route secret, created once under ``directory`` (0600)."""
    path = Path(directory) / "route.secret"
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write_private(path, secrets.token_hex(32) + "\n")
    if os.stat(path).st_mode & 0o077:
        raise BrokerConfigError(f"{path} is accessible to other users; chmod 600 it")
    secret = path.read_text().strip()
    if not _SECRET.fullmatch(secret):
        raise BrokerConfigError(f"{path} does not hold a route secret (64 hex characters)")
    return secret


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """The members and what every member shares: the cluster's name, the route
    secret and, optionally, TLS for clients and routes."""

    members: tuple[Member, ...]
    route_secret: str = field(repr=False)
    name: str = DEFAULT_CLUSTER_NAME
    #: The interface members listen on, for clients and for routes.
    listen_host: str = "0.0.0.0"
    client_port: int = DEFAULT_CLIENT_PORT
    #: JetStream's directory on each member (None: given on its command line).
    store_dir: str | None = None
    tls: TlsFiles | None = None

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise BrokerConfigError(f"cluster name {self.name!r}: letters, digits, '-', '_'")
        if not _SECRET.fullmatch(self.route_secret):
            raise BrokerConfigError("the route secret is 64 hex characters")
        if not _valid_host(self.listen_host):
            raise BrokerConfigError(f"listen host {self.listen_host!r} is not a host name or IP")

    def member(self, name: str) -> Member:
        for m in self.members:
            if m.name == name:
                return m
        raise BrokerConfigError(f"no cluster member named {name!r}")


def cluster_block(spec: ClusterSpec, me: Member) -> str:
    """The ``cluster {}`` block of member ``me``: routes to every other member,
    the route credential required of incoming ones."""
    routes = [
        _q(f"nats-route://{ROUTE_USER}:{spec.route_secret}@{m.route_address()}")
        for m in spec.members
        if m.name != me.name
    ]
    lines = [
        f"  name: {_q(spec.name)}",
        f"  listen: {_q(f'{_listen(spec.listen_host)}:{me.route_port}')}",
        "  authorization {",
        f"    user: {_q(ROUTE_USER)}",
        f"    password: {_q(spec.route_secret)}",
        f"    timeout: {_ROUTE_AUTH_TIMEOUT_S}",
        "  }",
        "  routes: [",
        *(f"    {r}" for r in routes),
        "  ]",
    ]
    if spec.tls is not None:
        route_tls = TlsFiles(
            cert_file=spec.tls.cert_file,
            key_file=spec.tls.key_file,
            ca_file=spec.tls.ca_file,
            # Routes verify each other whenever there is a CA to verify against.
            verify=spec.tls.ca_file is not None,
            timeout_s=spec.tls.timeout_s,
        )
        lines.extend("  " + line for line in route_tls.render().splitlines())
    return "cluster {\n" + "\n".join(lines) + "\n}\n"


def member_config(
    keys: BrokerKeys,
    spec: ClusterSpec,
    name: str,
    *,
    subjects: Subjects | None = None,
    auth_timeout_s: float = DEFAULT_CALLOUT_TIMEOUT_S,
) -> str:
    """The whole config of member ``name``: secure mode plus its place in the cluster."""
    me = spec.member(name)
    text = secure_config(
        keys, tls=spec.tls, auth_timeout_s=auth_timeout_s, server_name=me.name, subjects=subjects
    )
    text += listen_block(spec.listen_host, spec.client_port, spec.store_dir)
    # Routes (and clients) are pinged this often; a member that stops answering
    # (a crash of its machine, a partition: no connection reset) is dropped by
    # the others after ping_max missed pings, instead of after minutes, so that
    # no login request is routed to its callout connection meanwhile.
    text += f"ping_interval: {_q(f'{PING_INTERVAL_S}s')}\nping_max: {PING_MAX}\n"
    return text + cluster_block(spec, me)


def listen_block(host: str, port: int, store_dir: str | None = None) -> str:
    """Where a server listens for clients and, optionally, its JetStream directory."""
    if not _valid_host(host):
        raise BrokerConfigError(f"listen host {host!r} is not a host name or IP")
    if not 0 < port < 65536:
        raise BrokerConfigError(f"client port {port} is invalid")
    text = f"listen: {_q(f'{_listen(host)}:{port}')}\n"
    if store_dir is not None:
        text += f"jetstream {{ store_dir: {_q(store_dir)} }}\n"
    return text


def cluster_configs(
    keys: BrokerKeys,
    spec: ClusterSpec,
    *,
    subjects: Subjects | None = None,
    auth_timeout_s: float = DEFAULT_CALLOUT_TIMEOUT_S,
) -> dict[str, str]:
    """Every member's config, by member name."""
    return {
        m.name: member_config(keys, spec, m.name, subjects=subjects, auth_timeout_s=auth_timeout_s)
        for m in spec.members
    }


def client_urls(spec: ClusterSpec) -> str:
    """The ``--nats-url`` naming every member (``tls://`` with TLS files)."""
    scheme = "tls" if spec.tls is not None else "nats"
    return ",".join(f"{scheme}://{_listen(m.host)}:{spec.client_port}" for m in spec.members)


def _listen(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _q(value: str) -> str:
    return json.dumps(value)
