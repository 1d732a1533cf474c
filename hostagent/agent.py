"""The host agent: outbound-only execution of leased attempts on local devices.

One asyncio process per host. It makes outbound NATS connections only (through
:class:`transport.client.HostClient`, one connection per channel) and never
listens on anything.

Lifecycle::

    connect -> register -> reconcile the journal -> heartbeat -> claim work
                  ^                                                  |
                  +-- NATS reconnect, or a request answered ---------+
                      "unauthorized" (session superseded)

:class:`Agent` owns this lifecycle and wires its collaborators together; each
lives in a module of its own:

- :mod:`~fleetlease.hostagent.config`: :class:`AgentConfig` and its defaults,
  the credential file, the failpoints;
- :mod:`~fleetlease.hostagent.session`: connect, register, reconcile, resync,
  heartbeat, and every request on the current session;
- :mod:`~fleetlease.hostagent.claims`: the long-poll claims covering the idle
  devices, and accepting their assignments;
- :mod:`~fleetlease.hostagent.attempts`: ack, run, renew, record and report
  each attempt; settle the reconciliation's verdicts;
- :mod:`~fleetlease.hostagent.shipping`: the log and artifact queues and the
  tasks that send them;
- :mod:`~fleetlease.hostagent.retry`: backoff and the drop-oldest queue;
- :mod:`~fleetlease.hostagent.state`: what these share.

Shutdown (SIGTERM via the CLI, or :meth:`Agent.stop`): claiming stops at once
(outstanding long-polls are abandoned), running attempts get ``grace_s`` to
finish and report. Attempts still running after that are *handed back*: the
runner is stopped and the attempt is reported as a retryable failure
(``reason="handed back: agent shutting down"``), so the control plane applies
the task's retry policy at once instead of waiting for the lease to expire.
Reporting ``cancelled`` instead would be wrong: a cancelled task is terminal,
and an operator restarting an agent must not cancel users' work. If the user
had requested a cancel, ``cancelled`` is reported as usual. A report that
cannot be delivered before the end of the shutdown stays in the journal and is
reconciled by the next start.

Fatal errors: :class:`RegistrationRefused` when the control plane refuses the
credential, :class:`BrokerRefused` when the NATS server keeps refusing the
host's authorization (see :mod:`~fleetlease.hostagent.session`).

Test hook: ``FLEETLEASE_AGENT_FAILPOINTS`` (comma-separated names of
:data:`FAILPOINTS`) makes the agent SIGKILL itself at that point, so crash
tests need no timing.

Secrets: the host credential, the session key and lease tokens are never
logged; :class:`AgentConfig` and journal records hide them from ``repr``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Mapping, Sequence

import structlog

from fleetlease.hostagent.attempts import HANDBACK_REASON, Attempts
from fleetlease.hostagent.claims import Claims
from fleetlease.hostagent.config import (
    AGENT_VERSION,
    FAILPOINTS,
    FAILPOINTS_ENV,
    AgentConfig,
    load_credential,
    parse_failpoints,
)
from fleetlease.hostagent.devices import DeviceManager
from fleetlease.hostagent.errors import AgentError, BrokerRefused, RegistrationRefused
from fleetlease.hostagent.journal import Journal, JournalError, JournalRecord
from fleetlease.hostagent.retry import Backoff, DropOldestQueue
from fleetlease.hostagent.runners import RunnerFactory, guard, load_runners
from fleetlease.hostagent.runners.base import GuardedRunner
from fleetlease.hostagent.session import Session
from fleetlease.hostagent.shipping import Shipping
from fleetlease.hostagent.state import AgentState, AgentStats
from fleetlease.persistence.model import TaskKind
from fleetlease.transport import wire
from fleetlease.transport.client import HostClient

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
    "load_credential",
    "parse_failpoints",
]

log = structlog.get_logger("fleetlease.agent")


def build_runners(
    config: AgentConfig, runners: Mapping[str, RunnerFactory] | None = None
) -> dict[TaskKind, GuardedRunner]:
    """The guarded runner of each task kind, as the configuration names them
    (from ``runners``, else the installed entry points); ValueError for a
    name not found."""
    available = dict(runners) if runners is not None else load_runners()
    chosen: dict[TaskKind, GuardedRunner] = {}
    for kind, name in (
        (TaskKind.GOAL, config.goal_runner),
        (TaskKind.WORKFLOW, config.workflow_runner),
    ):
        factory = available.get(name)
        if factory is None:
            raise ValueError(
                f"{kind.value} runner {name!r} not found; available: {sorted(available)}"
            )
        chosen[kind] = guard(factory())
    return chosen


class Agent:
    """The host agent. ``await agent.run()`` until :meth:`stop` (or a fatal error:
    ``RegistrationRefused`` when the credential is refused)."""

    def __init__(
        self,
        config: AgentConfig,
        devices: DeviceManager,
        *,
        runners: Mapping[str, RunnerFactory] | None = None,
        journal: Journal | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.devices = devices
        self._runners = build_runners(config, runners)
        self._owns_journal = journal is None
        self.state = AgentState(config, devices, journal=journal, rng=rng or random.Random())
        self.stats = self.state.stats
        self.session = Session(self.state, settle=self._settle)
        self.shipping = Shipping(self.state, self.session)
        self.attempts = Attempts(self.state, self.session, self.shipping, self._runners)
        self.claims = Claims(self.state, self.session, start=self.attempts.start)
        self._dispatcher: asyncio.Task[None] | None = None

    # --- public -----------------------------------------------------------------------
    @property
    def client(self) -> HostClient | None:
        return self.session.client

    @property
    def registered(self) -> bool:
        """Whether a session is established and reconciled."""
        return self.session.ready.is_set()

    @property
    def started(self) -> asyncio.Event:
        """Set once the first registration and reconciliation are done."""
        return self.session.started

    @property
    def generation(self) -> int | None:
        client = self.session.client
        return client.generation if client is not None else None

    @property
    def running_attempts(self) -> list[tuple[str, int]]:
        return sorted(self.state.attempts)

    def record_process_group(
        self, task_id: str, attempt: int, pgid: int, start: int | None
    ) -> None:
        """A runner started a process group for an attempt: journal it (see
        ``hostagent.execution``). Called on the event loop."""
        journal = self.state.journal
        if journal is None:
            return
        calls = self.state.journal_calls

        async def record() -> None:
            try:
                await calls.call(journal.add_group, task_id, attempt, pgid, start)
            except JournalError as exc:
                log.warning("process_group_not_journaled", task_id=task_id, attempt=attempt,
                            pgid=pgid, error=exc.message)  # fmt: skip

        self.state.spawn(record(), "record_group")

    def stop(self) -> None:
        """Ask the agent to shut down (stop claiming, finish or hand back running
        attempts within ``grace_s``). Safe from any thread and from a signal
        handler installed with ``loop.add_signal_handler``."""
        loop = self.state.loop
        if loop is None or self.state.on_loop_thread():
            self.state.set_stopping()
        else:
            loop.call_soon_threadsafe(self.state.set_stopping)

    async def run(self) -> None:
        """Run until stopped. Raises ``RegistrationRefused`` if the control plane
        refuses the credential (at start or at any later registration), and
        ``BrokerRefused`` if the NATS server keeps refusing the host's
        authorization."""
        state = self.state
        state.bind_loop()
        cfg = self.config
        log.info(
            "agent_starting",
            host_id=cfg.host_id,
            prefix=cfg.prefix,
            devices=len(self.devices.snapshot()),
            goal_runner=cfg.goal_runner,
            workflow_runner=cfg.workflow_runner,
        )
        if state.journal is None:
            state.journal = await asyncio.to_thread(Journal.in_state_dir, cfg.state_dir)
        unsubscribe = self.devices.on_change(self._on_devices_changed_threadsafe)
        try:
            await self.devices_refresh()
            if not await self._until_stopped(self.session.connect()) or self.client is None:
                return  # stopped before the first connection
            if not await self._until_stopped(self.session.resync("start", jitter=False)):
                return  # stopped while the control plane was unreachable
            self.session.started.set()
            state.spawn(self.session.heartbeat_loop(self.devices_refresh), "heartbeat")
            state.spawn(self.shipping.ship_logs(), "log_shipper")
            state.spawn(self.shipping.ship_artifacts(), "artifact_shipper")
            self._dispatcher = state.spawn(self.claims.dispatch(), "claim_dispatcher")
            stop_wait = asyncio.ensure_future(state.stopping.wait())
            fatal_wait = asyncio.ensure_future(state.fatal_event.wait())
            try:
                await asyncio.wait({stop_wait, fatal_wait}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop_wait.cancel()
                fatal_wait.cancel()
            if state.fatal is not None:
                raise state.fatal
            await self._shutdown()
        finally:
            unsubscribe()
            await self._teardown()

    async def _until_stopped(self, coro: Awaitable[None]) -> bool:
        """Run ``coro`` unless a stop comes first (then cancel it, return False)."""
        state = self.state
        work = asyncio.ensure_future(coro)
        stop_wait = asyncio.ensure_future(state.stopping.wait())
        fatal_wait = asyncio.ensure_future(state.fatal_event.wait())
        try:
            await asyncio.wait({work, stop_wait, fatal_wait}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
            fatal_wait.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            if state.fatal is not None:
                raise state.fatal
            return False
        work.result()  # raises what it raised
        return True

    async def devices_refresh(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.devices.refresh)

    # --- wiring -------------------------------------------------------------------------
    async def _settle(
        self,
        entries: Sequence[JournalRecord],
        verdicts: Mapping[tuple[str, int], wire.Verdict],
    ) -> tuple[int, int, int]:
        """The session's reconciliation hands its verdicts to the attempts."""
        return await self.attempts.settle(entries, verdicts)

    def _on_devices_changed_threadsafe(self) -> None:
        loop = self.state.loop
        if loop is None or loop.is_closed():
            return
        if self.state.on_loop_thread():
            self._on_devices_changed()
        else:
            loop.call_soon_threadsafe(self._on_devices_changed)

    def _on_devices_changed(self) -> None:
        if not self.state.lease_flip:
            self.state.devices_changed.set()
        self.state.wake.set()

    # --- shutdown ---------------------------------------------------------------------------
    async def _shutdown(self) -> None:
        cfg = self.config
        attempts = self.state.attempts
        log.info("agent_stopping", host_id=cfg.host_id, running=len(attempts))
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            await asyncio.gather(self._dispatcher, return_exceptions=True)
        await self.claims.cancel_polls()
        if self.session.ready.is_set():
            await self.session.send_heartbeat()  # every device offline from now on
        pending = [a.task for a in attempts.values() if a.task is not None]
        if pending:
            await asyncio.wait(pending, timeout=cfg.grace_s)
        late = [a for a in attempts.values() if a.task is not None and not a.task.done()]
        for att in late:
            self.attempts.hand_back(att)
        tasks = [a.task for a in late if a.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=cfg.cancel_timeout_s + cfg.handback_timeout_s)
            for t in tasks:
                if not t.done():
                    # Its journal entry stays: the next start reconciles it.
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.shipping.flush(cfg.flush_timeout_s)

    async def _teardown(self) -> None:
        state = self.state
        for att in list(state.attempts.values()):
            if att.task is not None and not att.task.done():
                att.task.cancel()
        tasks = [a.task for a in state.attempts.values() if a.task is not None]
        background = list(state.background)
        for t in background:
            t.cancel()
        await self.claims.cancel_polls()
        await asyncio.gather(*tasks, *background, return_exceptions=True)
        await self.session.close()
        await state.journal_calls.stop()
        if self._owns_journal and state.journal is not None:
            state.journal.close()
        log.info(
            "agent_stopped",
            host_id=self.config.host_id,
            results_reported=self.stats.results_reported,
            leases_lost=self.stats.leases_lost,
            handed_back=self.stats.handed_back,
            logs_dropped=self.shipping.logs.dropped,
            artifacts_dropped=self.shipping.artifacts.dropped,
        )
