"""The host agent: runs leased attempts on this host's devices, over outbound
NATS connections only.

The public surface is named here; the modules behind it each hold one role
(``agent`` the lifecycle, ``config``, ``session``, ``claims``, ``attempts``,
``shipping``, ``retry``, ``state``, ``errors``; ``journal``, ``devices`` and
``runners`` beside them).

The names are imported on first use, so that importing one light module (the
CLI's option parser reads :mod:`~fleetlease.hostagent.config`) does not load
the agent and its NATS client."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetlease.hostagent.agent import Agent
    from fleetlease.hostagent.attempts import HANDBACK_REASON
    from fleetlease.hostagent.config import (
        AGENT_VERSION,
        FAILPOINTS,
        FAILPOINTS_ENV,
        AgentConfig,
        config_default,
        load_credential,
        parse_failpoints,
    )
    from fleetlease.hostagent.errors import AgentError, BrokerRefused, RegistrationRefused
    from fleetlease.hostagent.retry import Backoff, DropOldestQueue
    from fleetlease.hostagent.state import AgentStats

#: Public name -> the module that defines it.
_SOURCES = {
    "AGENT_VERSION": "config",
    "FAILPOINTS": "config",
    "FAILPOINTS_ENV": "config",
    "HANDBACK_REASON": "attempts",
    "Agent": "agent",
    "AgentConfig": "config",
    "AgentError": "errors",
    "AgentStats": "state",
    "Backoff": "retry",
    "BrokerRefused": "errors",
    "DropOldestQueue": "retry",
    "RegistrationRefused": "errors",
    "config_default": "config",
    "load_credential": "config",
    "parse_failpoints": "config",
}

__all__ = [
    "AGENT_VERSION",
    "FAILPOINTS",
    "FAILPOINTS_ENV",
    "HANDBACK_REASON",
    "Agent",
    "AgentConfig",
    "AgentError",
    "AgentStats",
    "Backoff",
    "BrokerRefused",
    "DropOldestQueue",
    "RegistrationRefused",
    "config_default",
    "load_credential",
    "parse_failpoints",
]


def __getattr__(name: str) -> Any:
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
