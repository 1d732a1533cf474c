"""The nats-server configuration of a secured fleet.

Secure mode (nats-server 2.10 or newer, the default of ``fleetlease up``)::

    accounts {
      AUTH  { users: [ {nkey: <callout service>} ] }             # runs the callout
      FLEET { jetstream: enabled, users: [
                {nkey: <control plane, serving>, permissions: <replies only>},
                {nkey: <control plane, storage>, permissions: <no client subjects>} ] }
      SYS   { users: [ {nkey: <control plane, system>} ] }      # CONNZ / KICK
    }
    system_account: SYS
    authorization { auth_callout { issuer: <account nkey>, account: AUTH,
                                   auth_users: [ <the four nkeys above> ] } }

The four control-plane users log in by nkey challenge-response (their seeds stay
in ``<state>/broker/``, mode 0600; the config holds only public keys) and bypass
the callout; every other connection - hosts, ops users, anonymous - goes to the
callout (``transport/broker_auth.py``), which places it in ``FLEET`` with its own
permissions or refuses it. No permission is granted to clients in the config: a
user the callout did not vouch for has none. The control plane's own users are
split by role: the serving connections (they answer requests) may publish only
into the fleet's client inboxes and the control plane's own subjects, so a
request naming ``$JS.API...`` (or any other subject) as its reply can never make
them act there; JetStream goes through the storage user, which subscribes to no
request subject and so never answers a client.

Production: add TLS (:class:`TlsFiles`; clients then use ``tls://`` URLs and an
``ssl.SSLContext`` trusting the CA) and bind to the interface the hosts reach.
The embedded default stays on 127.0.0.1 without TLS. A NATS cluster's members
run this same config plus their place in the cluster
(``transport/broker_cluster.py``); ``fleetlease broker config`` writes either.

Fallback for servers older than 2.10 (no auth callout): :func:`fallback_config`
lists every principal as an nkey user with its permissions inline, generated
from PostgreSQL and reloaded (``nats-server --signal reload`` or SIGHUP) after
every ``host add`` / ``host revoke`` / ``user add``; a reload closes the
connections of users that are no longer listed. The nkey of a principal is
derived from its stored SHA-256 (:func:`fallback_seed`), so a process that can
read the database could log in to the broker as any host. That is weaker than
the callout (which needs the credential itself); the application layer still
needs the raw credential to open a session, and the fallback is only for
operators who cannot upgrade.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import signal
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nkeys

from fleetlease.transport.broker_auth import (
    AUTH_ACCOUNT,
    DEFAULT_CALLOUT_TIMEOUT_S,
    FLEET_ACCOUNT,
    SYS_ACCOUNT,
    Kind,
    identity,
    permissions,
    public_key,
    seed_from_raw,
)
from fleetlease.transport.subjects import Subjects

_SEED_FILES = {
    "issuer": nkeys.PREFIX_BYTE_ACCOUNT,
    "callout": nkeys.PREFIX_BYTE_USER,
    "control_plane": nkeys.PREFIX_BYTE_USER,
    "system": nkeys.PREFIX_BYTE_USER,
    "storage": nkeys.PREFIX_BYTE_USER,
}
_FALLBACK_DOMAIN = b"fleetlease-fallback-nkey-v1"


class BrokerConfigError(Exception):
    """A key file or TLS file cannot be used."""


def _write_private(path: Path, data: str) -> None:
    """Create ``path`` (0600) atomically; the first writer wins a race."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)  # the first writer wins a concurrent first start
    finally:
        tmp.unlink(missing_ok=True)


def _load_or_create_seed(path: Path, prefix: int) -> str:
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write_private(path, seed_from_raw(prefix, secrets.token_bytes(32)))
    if os.stat(path).st_mode & 0o077:
        raise BrokerConfigError(f"{path} is accessible to other users; chmod 600 it")
    seed = path.read_text().strip()
    try:
        public_key(seed)
    except Exception as exc:
        raise BrokerConfigError(f"{path} does not hold an nkey seed") from exc
    return seed


@dataclass(frozen=True, kw_only=True)
class BrokerKeys:
    """The control plane's broker keys: callout issuer (account key), callout
    service user, control-plane user, system user."""

    issuer_seed: str = field(repr=False)
    callout_seed: str = field(repr=False)
    control_plane_seed: str = field(repr=False)
    system_seed: str = field(repr=False)
    storage_seed: str = field(repr=False)

    @classmethod
    def load_or_create(cls, directory: str | os.PathLike[str]) -> BrokerKeys:
        d = Path(directory)
        seeds = {name: _load_or_create_seed(d / f"{name}.nk", p) for name, p in _SEED_FILES.items()}
        return cls(
            issuer_seed=seeds["issuer"],
            callout_seed=seeds["callout"],
            control_plane_seed=seeds["control_plane"],
            system_seed=seeds["system"],
            storage_seed=seeds["storage"],
        )

    @property
    def issuer(self) -> str:
        return public_key(self.issuer_seed)

    def control_plane_connect_options(self) -> dict[str, Any]:
        """``connect_options`` for ``transport.server.Server``'s serving
        connections: they may publish replies into client inboxes and the control
        plane's own subjects, nothing else (:func:`control_plane_permissions`)."""
        return {"nkeys_seed_str": self.control_plane_seed}

    def storage_connect_options(self) -> dict[str, Any]:
        """``storage_connect_options`` for ``transport.server.Server``: the
        connection that uses JetStream (staging stream, object store) and never
        answers a client."""
        return {"nkeys_seed_str": self.storage_seed}


def control_plane_permissions(subjects: Subjects) -> dict[str, Any]:
    """What the serving connections may do. Publish: the fleet's client inboxes
    (replies; the server itself keeps each reply in its requester's own inbox),
    task events and the cross-process wake notices. Subscribe: the fleet's own
    subjects (requests, wake notices), never a client inbox. So a forged reply
    subject can never reach ``$JS``, ``$O``, ``$KV``, ``$SYS`` or any other
    subject of the account."""
    p = subjects.prefix
    return {
        "publish": {"allow": [*subjects.client_inbox_wildcards(), f"{p}.events.>", f"{p}._wake"]},
        "subscribe": {"allow": [f"{p}.>"]},
    }


def storage_permissions(subjects: Subjects) -> dict[str, Any]:
    """What the storage connection may do: publish anywhere in ``FLEET`` but its
    subscriptions are limited to its own ``_INBOX.>`` (JetStream API replies and
    object-store deliveries), so it can never take a client's request."""
    del subjects  # the default inbox is not under the prefix
    return {"subscribe": {"allow": ["_INBOX.>"]}}


def _perm_text(perms: dict[str, Any]) -> str:
    parts = [f"{kind}: {{ allow: {json.dumps(rule['allow'])} }}" for kind, rule in perms.items()]
    return "{ " + ", ".join(parts) + " }"


@dataclass(frozen=True, kw_only=True)
class TlsFiles:
    """Server-side TLS. ``ca_file`` + ``verify`` also require client certificates
    (mutual TLS); without ``verify`` clients only check the server."""

    cert_file: Path
    key_file: Path
    ca_file: Path | None = None
    verify: bool = False
    timeout_s: float = 5.0

    def render(self) -> str:
        for p in (self.cert_file, self.key_file, self.ca_file):
            if p is not None and not Path(p).is_file():
                raise BrokerConfigError(f"TLS file {p} does not exist")
        lines = [
            f"  cert_file: {_q(str(self.cert_file))}",
            f"  key_file: {_q(str(self.key_file))}",
            f"  timeout: {self.timeout_s}",
        ]
        if self.ca_file is not None:
            lines.append(f"  ca_file: {_q(str(self.ca_file))}")
        if self.verify:
            lines.append("  verify: true")
        return "tls {\n" + "\n".join(lines) + "\n}\n"


def _q(value: str) -> str:
    """A quoted config string (the nats config format accepts JSON strings)."""
    return json.dumps(value)


#: nats-server's ``max_pending``: how many bytes it buffers for one connection
#: that reads slower than it is written to before closing it as a slow consumer
#: (nats-server's default is 64 MiB). The control plane's subscriptions take a
#: burst of every client at once; a flood of ~100 MB of requests arrives faster
#: than a Python process reads it, so the buffer must hold such a burst. A
#: client's own connection never gets near it: what the control plane sends it
#: is bounded by its in-flight budget (``transport/admission.py``).
MAX_PENDING_BYTES = 512 * 1024 * 1024


def secure_config(
    keys: BrokerKeys,
    *,
    tls: TlsFiles | None = None,
    auth_timeout_s: float = DEFAULT_CALLOUT_TIMEOUT_S,
    server_name: str = "fleetlease",
    subjects: Subjects | None = None,
) -> str:
    """The nats-server config of secure mode (auth callout). Listen address, port
    and JetStream directory come from the command line (``ops/embedded.py``) or
    from the operator's own config, which can ``include`` this file. ``subjects``:
    the fleet's prefix, which the control plane's permissions name."""
    subjects = subjects or Subjects()
    cp = public_key(keys.control_plane_seed)
    callout = public_key(keys.callout_seed)
    system = public_key(keys.system_seed)
    storage = public_key(keys.storage_seed)
    text = f"""# Generated by fleetlease (transport/broker_config.py); do not edit.
server_name: {_q(server_name)}
max_pending: {MAX_PENDING_BYTES}
authorization {{
  timeout: {auth_timeout_s}
  auth_callout {{
    issuer: {keys.issuer}
    account: {AUTH_ACCOUNT}
    auth_users: [ {callout}, {cp}, {system}, {storage} ]
  }}
}}
accounts {{
  {AUTH_ACCOUNT} {{ users: [ {{ nkey: {callout} }} ] }}
  {FLEET_ACCOUNT} {{
    jetstream: enabled
    users: [
      {{ nkey: {cp}, permissions: {_perm_text(control_plane_permissions(subjects))} }}
      {{ nkey: {storage}, permissions: {_perm_text(storage_permissions(subjects))} }}
    ]
  }}
  {SYS_ACCOUNT} {{ users: [ {{ nkey: {system} }} ] }}
}}
system_account: {SYS_ACCOUNT}
"""
    if tls is not None:
        text += tls.render()
    return text


def write_config(path: str | os.PathLike[str], text: str) -> Path:
    """Write a config file (0600) atomically, replacing any previous one."""
    p = Path(path)
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    return p


# -- fallback: static per-principal users, reloaded -----------------------------------


def fallback_seed(kind: Kind, name: str, stored_hash: bytes) -> str:
    """The nkey seed of a principal in fallback mode, derived from its stored
    SHA-256 (the host derives the same from its credential)."""
    raw = hmac.new(
        stored_hash, _FALLBACK_DOMAIN + b"\0" + identity(kind, name).encode(), hashlib.sha256
    ).digest()
    return seed_from_raw(nkeys.PREFIX_BYTE_USER, raw)


def fallback_connect_options(kind: Kind, name: str, secret: str) -> dict[str, Any]:
    """``connect_options`` for a host (or, with the user's inbox prefix, a user)
    on a fallback-mode broker: nkey challenge-response, nothing secret sent."""
    from fleetlease.persistence.secrets import hash_secret

    return {"nkeys_seed_str": fallback_seed(kind, name, hash_secret(secret))}


@dataclass(frozen=True)
class FallbackPrincipal:
    kind: Kind
    name: str
    stored_hash: bytes = field(repr=False)


def fallback_config(
    keys: BrokerKeys,
    principals: Iterable[FallbackPrincipal],
    *,
    subjects: Subjects,
    tls: TlsFiles | None = None,
) -> str:
    """A config for servers without auth callout: the control plane and every
    principal as nkey users of one account, permissions inline."""
    cp = public_key(keys.control_plane_seed)
    system = public_key(keys.system_seed)
    storage = public_key(keys.storage_seed)
    users = [
        f"      {{ nkey: {cp}, permissions: {_perm_text(control_plane_permissions(subjects))} }}",
        f"      {{ nkey: {storage}, permissions: {_perm_text(storage_permissions(subjects))} }}",
    ]
    for p in sorted(principals, key=lambda p: (p.kind, p.name)):
        nkey = public_key(fallback_seed(p.kind, p.name, p.stored_hash))
        perms = permissions(subjects, p.kind, p.name)
        users.append(
            f"      {{ nkey: {nkey}, permissions: {{"
            f" publish: {{ allow: {json.dumps(perms['pub']['allow'])} }},"
            f" subscribe: {{ allow: {json.dumps(perms['sub']['allow'])} }} }} }}"
            f"  # {identity(p.kind, p.name)}"
        )
    text = f"""# Generated by fleetlease (transport/broker_config.py, fallback mode); do not edit.
max_pending: {MAX_PENDING_BYTES}
accounts {{
  {FLEET_ACCOUNT} {{
    jetstream: enabled
    users: [
{chr(10).join(users)}
    ]
  }}
  {SYS_ACCOUNT} {{ users: [ {{ nkey: {system} }} ] }}
}}
system_account: {SYS_ACCOUNT}
"""
    if tls is not None:
        text += tls.render()
    return text


async def load_fallback_principals(engine: Any) -> list[FallbackPrincipal]:
    """Every unrevoked host and every user, from PostgreSQL."""
    from fleetlease.persistence.credentials import principals

    return [FallbackPrincipal(kind, name, h) for kind, name, h in await principals(engine)]


def reload_server(pid: int | None = None, *, binary: str | None = None) -> None:
    """Make a running nats-server re-read its config: SIGHUP to ``pid``, or
    ``nats-server --signal reload`` when only one server runs on the machine."""
    if pid is not None:
        os.kill(pid, signal.SIGHUP)
        return
    if binary is None:
        from fleetlease.ops.embedded import nats_server_binary

        binary = nats_server_binary()
    subprocess.run([binary, "--signal", "reload"], check=True, capture_output=True, timeout=30)


def embedded_args(config_path: str | os.PathLike[str]) -> Sequence[str]:
    """``extra_args`` for ``ops.embedded.EmbeddedNats``."""
    return ["-c", str(config_path)]


def secure_embedded_args(
    state_dir: str | os.PathLike[str],
    *,
    tls: TlsFiles | None = None,
    subjects: Subjects | None = None,
) -> list[str]:
    """Keys (created once under ``state_dir/broker``) and the secure-mode config
    (rewritten each start), as ``extra_args`` for ``ops.embedded.EmbeddedNats``.
    The control plane started with ``ControlPlaneService(broker_security=True)``
    on the same ``state_dir`` serves the callout for it."""
    keys = BrokerKeys.load_or_create(Path(state_dir) / "broker")
    path = write_config(
        Path(state_dir) / "broker" / "nats-secure.conf",
        secure_config(keys, tls=tls, subjects=subjects),
    )
    return list(embedded_args(path))
