"""What a scrape reads at the moment it happens.

The HTTP listener runs on a thread of its own; everything here is read on the
process's event loop (``asyncio.run_coroutine_threadsafe``), where the control
plane and the agent keep their state, and a scrape waits for it at most
``timeout_s``. A scrape never slows a request: the database gauges are one
``GROUP BY`` statement with a ``statement_timeout``, on a pooled connection, only
when Prometheus asks; a database that does not answer in time gives
``fleetlease_database_up 0`` and no task, host or device gauges, never a hung scrape.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import sqlalchemy as sa
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = structlog.get_logger("fleetlease.observe")

T = TypeVar("T")

#: The one statement of a scrape: tasks that are not finished by state and
#: project (through the status index, so its cost follows the tasks in flight,
#: not the history: finished tasks are counted by
#: ``fleetlease_task_transitions_total``), devices by state, hosts by state
#: (revoked; live: seen within the liveness window; stale).
STATE_COUNTS = sa.text(
    """
    SELECT 'task' AS what, status AS state, project, count(*) AS n
      FROM tasks
     WHERE status IN ('queued', 'retrying', 'assigned', 'dispatched', 'running')
     GROUP BY status, project
    UNION ALL
    SELECT 'device', state, '', count(*) FROM devices GROUP BY state
    UNION ALL
    SELECT 'host', s, '', count(*) FROM (
        SELECT CASE
            WHEN revoked_at IS NOT NULL THEN 'revoked'
            WHEN last_seen >= now() - make_interval(secs => :liveness_s) THEN 'live'
            ELSE 'stale' END AS s
          FROM hosts) h
     GROUP BY s
    """
)


def on_loop(
    loop: asyncio.AbstractEventLoop, make: Callable[[], Awaitable[T]], timeout_s: float
) -> T:
    """Run ``make()`` on ``loop`` from another thread; ``TimeoutError`` after
    ``timeout_s`` (the coroutine is cancelled then)."""

    async def bounded() -> T:
        async with asyncio.timeout(timeout_s):
            return await make()

    future = asyncio.run_coroutine_threadsafe(bounded(), loop)
    try:
        return future.result(timeout_s + 0.5)
    except TimeoutError:
        future.cancel()
        raise


async def state_counts(engine: Any, liveness_s: float, timeout_ms: int) -> list[tuple[Any, ...]]:
    async with engine.connect() as conn:
        await conn.execute(sa.text(f"SET LOCAL statement_timeout = {int(timeout_ms)}"))
        result = await conn.execute(STATE_COUNTS, {"liveness_s": float(liveness_s)})
        rows = [tuple(r) for r in result]
        await conn.rollback()
        return rows


class ControlPlaneCollector(Collector):
    """The gauges of a running ``ControlPlaneService`` read at scrape time."""

    def __init__(
        self, service: Any, loop: asyncio.AbstractEventLoop, timeout_s: float = 2.0
    ) -> None:
        self.service = service
        self.loop = loop
        self.timeout_s = timeout_s

    def describe(self) -> list[Metric]:
        return []  # read at scrape time; never collected at registration

    async def _read(self) -> tuple[dict[str, Any], list[tuple[Any, ...]] | None]:
        cp = self.service.control_plane
        memory: dict[str, Any] = {}
        if cp is not None:
            m = cp.metrics
            memory["lease_actors"] = m.get("lease_actors", 0)
            memory["renewals"] = m.get("renewals_batched", 0)
            memory["inflight"] = m.get("inflight", 0)
            memory["parked"] = cp.parked_claims
            feed = getattr(self.service.ops, "feed", None)
            memory["parked_events"] = feed.parked if feed is not None else 0
        gc = getattr(self.service, "gc", None)
        if gc is not None:
            memory["gc"] = gc.counters()
        broker = self.service.broker_auth
        if broker is not None:
            memory["broker"] = {"granted": broker.granted, "refused": broker.refused}
        rows: list[tuple[Any, ...]] | None = None
        engine = self.service.engine
        if engine is not None:
            try:
                rows = await state_counts(
                    engine, self.service.timings.liveness_s, int(self.timeout_s * 1000)
                )
            except Exception as exc:
                log.warning("metrics_database_failed", error=str(exc) or type(exc).__name__)
        return memory, rows

    def collect(self) -> Iterator[Metric]:
        try:
            memory, rows = on_loop(self.loop, self._read, self.timeout_s)
        except Exception as exc:
            log.warning("metrics_scrape_failed", error=str(exc) or type(exc).__name__)
            memory, rows = {}, None
        up = GaugeMetricFamily(
            "fleetlease_database_up",
            "1 when the scrape's database query answered in time, else 0.",
        )
        up.add_metric([], 1.0 if rows is not None else 0.0)
        yield up
        if memory:
            yield _gauge(
                "fleetlease_active_leases",
                "Lease actors of this process (one per assigned, dispatched or running task).",
                memory["lease_actors"],
            )
            parked = GaugeMetricFamily(
                "fleetlease_parked_long_polls",
                "Long-polls parked in this process: host claims waiting for work (claim), "
                "user event feeds waiting for events (events).",
                labels=["kind"],
            )
            parked.add_metric(["claim"], memory["parked"])
            parked.add_metric(["events"], memory["parked_events"])
            yield parked
            yield _gauge(
                "fleetlease_requests_in_flight",
                "Host requests the control plane of this process is handling.",
                memory["inflight"],
            )
            renewals = CounterMetricFamily(
                "fleetlease_lease_renewals",
                "Lease renewals (and cancel polls) group-committed by this process.",
            )
            renewals.add_metric([], memory["renewals"])
            yield renewals
        if "broker" in memory:
            decisions = CounterMetricFamily(
                "fleetlease_broker_auth_decisions",
                "Connections the NATS auth callout of this process decided, by decision "
                "(a refused one is an unknown, revoked or wrong host or user).",
                labels=["decision"],
            )
            for decision, n in sorted(memory["broker"].items()):
                decisions.add_metric([decision], n)
            yield decisions
        if "gc" in memory:
            deleted = CounterMetricFamily(
                "fleetlease_gc_deleted",
                "What this process's retention passes deleted, by what: finished tasks, "
                "attempts, log lines and bytes, artifacts and bytes, objects (and "
                "objects_failed: left in the object store after their rows went).",
                labels=["what"],
            )
            for what, n in sorted(memory["gc"].items()):
                deleted.add_metric([what], n)
            yield deleted
        if rows is None:
            return
        tasks = GaugeMetricFamily(
            "fleetlease_tasks",
            "Tasks not finished (queued, retrying, assigned, dispatched, running), "
            "by state and project.",
            labels=["state", "project"],
        )
        hosts = GaugeMetricFamily("fleetlease_hosts", "Hosts by state.", labels=["state"])
        devices = GaugeMetricFamily("fleetlease_devices", "Devices by state.", labels=["state"])
        for what, state, project, n in rows:
            if what == "task":
                tasks.add_metric([state, project], n)
            elif what == "host":
                hosts.add_metric([state], n)
            else:
                devices.add_metric([state], n)
        yield tasks
        yield hosts
        yield devices


class AgentCollector(Collector):
    """An agent's state, read at scrape time."""

    def __init__(self, agent: Any, loop: asyncio.AbstractEventLoop, timeout_s: float = 2.0) -> None:
        self.agent = agent
        self.loop = loop
        self.timeout_s = timeout_s

    def describe(self) -> list[Metric]:
        return []

    async def _read(self) -> dict[str, Any]:
        agent = self.agent
        devices: dict[str, int] = {}
        for d in agent.devices.snapshot():
            state = str(getattr(d, "state", "unknown"))
            devices[state] = devices.get(state, 0) + 1
        return {
            "registered": agent.registered,
            "attempts": len(agent.running_attempts),
            "stats": dataclasses.asdict(agent.stats),
            "devices": devices,
        }

    def collect(self) -> Iterator[Metric]:
        try:
            data = on_loop(self.loop, self._read, self.timeout_s)
        except Exception as exc:
            log.warning("metrics_scrape_failed", error=str(exc) or type(exc).__name__)
            return
        yield _gauge(
            "fleetlease_agent_registered",
            "1 while the agent has a registered, reconciled session.",
            1.0 if data["registered"] else 0.0,
        )
        yield _gauge(
            "fleetlease_agent_attempts",
            "Attempts the agent holds (acked or running).",
            data["attempts"],
        )
        devices = GaugeMetricFamily(
            "fleetlease_agent_devices", "The agent's devices, by state.", labels=["state"]
        )
        for state, n in sorted(data["devices"].items()):
            devices.add_metric([state], n)
        yield devices
        for name, value in data["stats"].items():
            if isinstance(value, int):
                c = CounterMetricFamily(f"fleetlease_agent_{name}", _AGENT_HELP.get(name, name))
                c.add_metric([], value)
                yield c


_AGENT_HELP = {
    "registrations": "Registrations (sessions opened).",
    "heartbeats_sent": "Heartbeats sent.",
    "assignments": "Assignments claimed.",
    "results_reported": "Results the control plane accepted.",
    "results_rejected": "Results the control plane refused.",
    "leases_lost": "Attempts whose lease was lost.",
    "acks_given_up": "Acks given up at their deadline.",
    "handed_back": "Attempts handed back at shutdown.",
    "handovers_waited": "Assignments that waited for the device's previous report.",
    "log_lines_sent": "Log lines shipped.",
    "logs_dropped": "Log lines dropped (queue full).",
    "artifacts_sent": "Artifacts shipped.",
    "artifacts_dropped": "Artifacts dropped (queue full).",
}


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, documentation)
    g.add_metric([], value)
    return g
