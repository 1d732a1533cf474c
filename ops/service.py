"""The control-plane process: repository, actor system, NATS server and user API,
started and stopped in order. ``fleetlease serve``, ``fleetlease up``, the
benchmarks and the end-to-end tests all build the system through this."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.ops.observe import attach as observe
from fleetlease.ops.observe.looplag import LoopLagProbe
from fleetlease.persistence.clock import Clock, SystemClock
from fleetlease.persistence.db import create_engine
from fleetlease.persistence.migrate import upgrade_engine
from fleetlease.persistence.model import LeaseTimings
from fleetlease.persistence.repository import Repository
from fleetlease.transport.auth import ServerSecret
from fleetlease.transport.subjects import Subjects

log = structlog.get_logger("fleetlease.service")

#: Chaos hook (``fleetlease soak``, fault tests): set, ``serve`` arms fail points
#: on SIGUSR1. Never set in production; unset, nothing is installed.
CHAOS_DIR_ENV = "FLEETLEASE_CHAOS_DIR"


def install_chaos_hook(
    loop: asyncio.AbstractEventLoop, env: Mapping[str, str] | None = None
) -> Callable[[], None] | None:
    """When ``FLEETLEASE_CHAOS_DIR`` is set: on SIGUSR1, read ``<dir>/arm`` (one
    line, ``actors.failpoints.arm_from_spec``: e.g. ``lease.after_commit_before_reply
    count=1 seed=5``) and arm that fail point, so that the next actor to pass it
    crashes (``actor.crash``, then ``supervisor.restarted``). The handler runs
    on the event loop (``loop.add_signal_handler``), not in signal context.
    Returns the uninstaller, or None when the variable is not set. Call it on
    the main thread before anyone may send the signal (SIGUSR1 kills a process
    without a handler)."""
    directory = (os.environ if env is None else env).get(CHAOS_DIR_ENV)
    if not directory:
        return None
    from fleetlease.actors import failpoints

    arm_file = Path(directory) / "arm"

    def on_sigusr1() -> None:
        try:
            text = arm_file.read_text(encoding="utf-8")
            point = failpoints.arm_from_spec(text)
        except (OSError, ValueError) as exc:
            log.warning("chaos_arm_failed", path=str(arm_file), error=str(exc))
            return
        log.warning("chaos_armed", point=point, spec=text.strip()[:200])

    loop.add_signal_handler(signal.SIGUSR1, on_sigusr1)
    log.warning("chaos_hook_installed", directory=directory)

    def uninstall() -> None:
        loop.remove_signal_handler(signal.SIGUSR1)

    return uninstall


@dataclass(kw_only=True)
class ControlPlaneService:
    database_url: str
    nats_url: str
    state_dir: Path
    prefix: str = "fleetlease"
    clock: Clock = field(default_factory=SystemClock)
    timings: LeaseTimings = field(default_factory=LeaseTimings)
    heartbeat_s: float = 5.0
    scheduler_interval_s: float = 1.0
    migrate: bool = True
    pool_size: int = 20
    #: Broker security: serve the NATS auth callout and connect as the
    #: control plane's nkey user. The nats-server must run the config of
    #: ``transport.broker_config.secure_config`` for the keys in ``state_dir/broker``.
    broker_security: bool = False
    #: Lifetime of the user JWTs the callout issues (seconds; ``None``: never
    #: expire). Every connection re-proves its principal this often, so a host
    #: or user revoked while a kick failed is out within one lifetime at most.
    broker_jwt_expires_s: float | None = 300.0
    #: Artifact staging limits (``transport.staging.StagingLimits``; its
    #: defaults when None).
    staging: Any = None
    #: Per-channel limits overriding ``transport.server.DEFAULT_CHANNELS``.
    channels: Mapping[Any, Any] | None = None
    #: HOST:PORT of ``/metrics``, ``/healthz`` and ``/readyz`` (``ops/observe``;
    #: None: no listener). ``metrics_optional``: a bind failure is logged, not raised.
    metrics: str | None = None
    metrics_optional: bool = False
    #: Default retention of finished tasks, seconds (``serve --retain``; 0 or
    #: None: forever); a project's own (``projects.retain_s``) overrides it.
    retain_s: int | None = None
    #: Seconds between retention passes (``ops.gc``); None: only on request.
    gc_interval_s: float | None = 300.0
    #: Expired tasks deleted per transaction.
    gc_batch: int = 500
    #: Seconds between the points of the fleet's history (``ops/observe/history.py``,
    #: the console's health page), which keeps the last hour of them.
    history_interval_s: float = 10.0

    engine: AsyncEngine | None = None
    #: The replay check's own small pool (``transport.replay``): its inserts
    #: commit without waiting for the WAL flush.
    replay_engine: AsyncEngine | None = None
    repo: Repository | None = None
    control_plane: Any = None
    server: Any = None
    ops: Any = None
    broker_auth: Any = None
    observer: Any = None
    loop_lag: LoopLagProbe | None = None
    gc: Any = None
    history: Any = None
    sampler: Any = None

    async def start(self) -> ControlPlaneService:
        from fleetlease.actors.runtime import ControlPlane
        from fleetlease.transport.server import Server

        try:
            # Every connection is kept (no overflow): SQLAlchemy closes an overflow
            # connection on check-in, and under load that meant a new PostgreSQL
            # session (connect, startup, type introspection) for most transactions.
            self.engine = create_engine(
                self.database_url, pool_size=2 * self.pool_size, max_overflow=0
            )
            if self.migrate:
                await upgrade_engine(self.engine)
            self.repo = Repository(self.engine, self.clock, self.timings)
            self.control_plane = ControlPlane(
                self.repo,
                loop=asyncio.get_running_loop(),
                clock=self.clock,
                timings=self.timings,
                scheduler_interval_s=self.scheduler_interval_s,
            )
            await self.control_plane.start()
            from fleetlease.transport.replay import RELAXED_COMMIT, SharedReplay

            self.replay_engine = create_engine(
                self.database_url,
                pool_size=SharedReplay.MAX_INFLIGHT + 1,  # the inserts and a prune
                max_overflow=0,
                connect_args={"server_settings": RELAXED_COMMIT},
            )
            secret = ServerSecret.load_or_create(self.state_dir / "server.secret")
            connect_options, storage_options = await self._start_broker_auth()
            self.ops = self._ops_api()
            if self.ops is not None:
                self.ops.start()
            self.server = Server(
                nats_url=self.nats_url,
                control_plane=self.control_plane,
                repo=self.repo,
                server_secret=secret.value,
                replay_ledger=Repository(self.replay_engine, self.clock, self.timings),
                subjects=Subjects(self.prefix),
                ops=self.ops,
                timings=self.timings,
                heartbeat_s=self.heartbeat_s,
                connect_options=connect_options,
                storage_connect_options=storage_options,
                staging=self.staging,
                channels=self.channels,
            )
            await self.server.start()
            self._start_gc()
            self._start_history()
            if self.metrics:
                self.observer = observe.for_service(
                    self, self.metrics, optional=self.metrics_optional
                )
                if self.observer is not None:
                    self.loop_lag = LoopLagProbe().start()
        except BaseException:
            await self.stop()
            raise
        log.info("control_plane_started", prefix=self.prefix)
        return self

    def _start_gc(self) -> None:
        from fleetlease.ops.gc import DEFAULT_INTERVAL_S, Collector
        from fleetlease.persistence.retention import Retention

        assert self.engine is not None
        retention = Retention(
            self.engine, default_s=self.retain_s, clock=self.clock, batch=self.gc_batch
        )
        self.gc = Collector(
            retention,
            getattr(self.server, "artifacts", None),
            interval_s=self.gc_interval_s or DEFAULT_INTERVAL_S,
        )
        if self.gc_interval_s is not None:
            self.gc.start()

    def _start_history(self) -> None:
        from fleetlease.ops.observe.history import FleetHistory, HistorySampler

        self.history = FleetHistory(interval_s=self.history_interval_s)
        # The deployment's committed changes, whichever process made them (the
        # actors' own events where there is no user API).
        feed = getattr(self.ops, "feed", None)
        if feed is not None:
            feed.add_listener(self.history.on_event)
        else:
            self.control_plane.add_listener(self.history.on_event)
        self.sampler = HistorySampler(self.history, self.engine).start()

    def _ops_api(self) -> Any:
        try:
            from fleetlease.ops.userapi import OpsApi
        except ModuleNotFoundError:
            return None
        assert self.repo is not None
        return OpsApi(repo=self.repo, control_plane=self.control_plane, service=self)

    async def _start_broker_auth(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The serving and the storage connections' options (see
        ``transport.broker_config``); empty on an open broker."""
        if not self.broker_security:
            return {}, {}
        from fleetlease.transport.broker_auth import BrokerAuthService, SqlCredentialStore
        from fleetlease.transport.broker_config import BrokerKeys

        keys = BrokerKeys.load_or_create(self.state_dir / "broker")
        assert self.engine is not None
        self.broker_auth = await BrokerAuthService(
            nats_url=self.nats_url,
            store=SqlCredentialStore(self.engine),
            issuer_seed=keys.issuer_seed,
            service_seed=keys.callout_seed,
            system_seed=keys.system_seed,
            subjects=Subjects(self.prefix),
            jwt_expires_s=self.broker_jwt_expires_s,
        ).start()
        return keys.control_plane_connect_options(), keys.storage_connect_options()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop in the order that loses nothing: the server takes no new requests
        (the queue group's other members get them); the control plane releases
        parked long-polls, lets the requests in flight commit and stops its
        actors; the server sends the last replies and closes its connections."""
        if self.loop_lag is not None:
            await self.loop_lag.stop()
            self.loop_lag = None
        if self.gc is not None:
            await self.gc.stop()  # after its current batch
            self.gc = None
        if self.ops is not None:
            await self.ops.stop()  # parked `events` long-polls answer now
        if self.server is not None:
            try:
                await self.server.drain(grace_s)
            except Exception:
                log.exception("server_drain_failed")
        if self.control_plane is not None:
            try:
                await self.control_plane.stop(grace_s)
            except Exception:
                log.exception("control_plane_stop_failed")
            self.control_plane = None
        if self.server is not None:
            try:
                await self.server.stop(grace_s)
            except Exception:
                log.exception("server_stop_failed")
            self.server = None
        if self.broker_auth is not None:
            with contextlib.suppress(Exception):
                await self.broker_auth.stop()
            self.broker_auth = None
        if self.observer is not None:
            # Last but the pool: while the rest stops, /readyz answers "not ready".
            await asyncio.to_thread(self.observer.stop)
            self.observer = None
        if self.sampler is not None:
            await self.sampler.stop()
            self.sampler = None
        if self.replay_engine is not None:
            await self.replay_engine.dispose()
            self.replay_engine = None
        if self.engine is not None:
            await self.engine.dispose()
            self.engine = None

    async def __aenter__(self) -> ControlPlaneService:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
