"""The NATS side of fleetlease: every subject (``subjects``), the wire messages
(``wire``), host signing and sessions (``auth``), the control plane's server
(``server``, with ``host_handlers``, ``replay``, ``artifacts``, ``ops_channel``,
``events``, ``admission`` and ``staging`` behind it), the host-side client
(``client``) and broker-level identities (``broker_auth``, ``broker_config``,
``broker_cluster``).

The names are imported on first use, so that a host agent importing its client
does not load the control plane's server."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetlease.transport.auth import AuthError, Verifier
    from fleetlease.transport.broker_auth import (
        BrokerAuthService,
        host_connect_options,
        user_connect_options,
    )
    from fleetlease.transport.client import HostClient, TransportError
    from fleetlease.transport.server import DEFAULT_CHANNELS, ChannelConfig, Server
    from fleetlease.transport.staging import StagingLimits
    from fleetlease.transport.subjects import Channel, Subjects

#: Public name -> the module that defines it.
_SOURCES = {
    "AuthError": "auth",
    "BrokerAuthService": "broker_auth",
    "Channel": "subjects",
    "ChannelConfig": "server",
    "DEFAULT_CHANNELS": "server",
    "HostClient": "client",
    "Server": "server",
    "StagingLimits": "staging",
    "Subjects": "subjects",
    "TransportError": "client",
    "Verifier": "auth",
    "host_connect_options": "broker_auth",
    "user_connect_options": "broker_auth",
}

__all__ = [
    "DEFAULT_CHANNELS",
    "AuthError",
    "BrokerAuthService",
    "Channel",
    "ChannelConfig",
    "HostClient",
    "Server",
    "StagingLimits",
    "Subjects",
    "TransportError",
    "Verifier",
    "host_connect_options",
    "user_connect_options",
]


def __getattr__(name: str) -> Any:
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
