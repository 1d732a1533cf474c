"""Starting the listener for a running control plane or agent."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from fleetlease.ops.observe.collectors import AgentCollector, ControlPlaneCollector
from fleetlease.ops.observe.health import agent_readiness, service_readiness
from fleetlease.ops.observe.http import ListenError, MetricsListener
from fleetlease.ops.observe.metrics import EventMetrics

log = structlog.get_logger("fleetlease.observe")


def for_service(service: Any, address: str, *, optional: bool = False) -> MetricsListener | None:
    """Serve the metrics, ``/healthz`` and ``/readyz`` of a started
    ``ControlPlaneService`` on ``address``, and count its task events. A bind
    failure raises ``ListenError`` (exit code 6), unless ``optional`` (the default address of
    ``serve`` and ``up``, which a second process on the machine may hold): then
    it is logged and the process runs without the listener."""
    loop = asyncio.get_running_loop()
    listener = MetricsListener(
        address,
        collectors=[ControlPlaneCollector(service, loop)],
        readiness=lambda: service_readiness(service, loop),
    )
    try:
        listener.start()
    except ListenError as exc:
        if not optional:
            raise
        log.warning("metrics_not_listening", address=address, error=str(exc))
        return None
    service.control_plane.add_listener(EventMetrics())
    return listener


def for_agent(agent: Any, address: str, loop: asyncio.AbstractEventLoop) -> MetricsListener:
    """Serve an agent's metrics, ``/healthz`` and ``/readyz`` (``ListenError`` when
    the address cannot be bound)."""
    return MetricsListener(
        address,
        collectors=[AgentCollector(agent, loop)],
        readiness=lambda: agent_readiness(agent, loop),
    ).start()
