"""The host agent: runs leased attempts on this host's devices, over outbound
NATS connections only.

The public surface is named here; the modules behind it each hold one role
(``agent`` the lifecycle, ``config``, ``session``, ``claims``, ``attempts``,
``shipping``, ``retry``, ``state``, ``errors``; ``journal``, ``devices`` and
``runners`` beside them)."""

from __future__ import annotations

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
