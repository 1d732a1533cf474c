"""``fleetlease migrate``, ``up`` and ``serve``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import secrets
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from fleetlease.ops import eventloop, interpreter
from fleetlease.ops.cli import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, CliError, add_common
from fleetlease.ops.commands import retention
from fleetlease.ops.commands.status import add_metrics_flag, metrics_from_args
from fleetlease.ops.config import (
    ENV_BROKER_SECURITY,
    ENV_JS_REPLICAS,
    ConfigError,
    broker_security,
    ensure_state_dir,
    from_args,
    js_replicas,
    write_context,
)
from fleetlease.ops.logging import configure_file_logging, configure_logging
from fleetlease.ops.system import (
    AlreadyRunning,
    Services,
    Unreachable,
    check_database,
    single_instance,
)
from fleetlease.persistence.db import redact

log = structlog.get_logger("fleetlease.cli")


def register(sub: Any) -> None:
    p = sub.add_parser("migrate", help="apply the database schema (Alembic)")
    add_common(p)
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("up", help="run the whole system locally on embedded defaults")
    add_common(p)
    p.add_argument(
        "--devices",
        default="4",
        help="the local agent's devices: N simulated devices, or a device source as for "
        "`fleetlease agent --devices` (e.g. local:2, or local:2,command:/path; default 4)",
    )
    p.add_argument(
        "--workflows",
        metavar="DIR",
        help="the local agent serves the workflow definitions of DIR (see docs/workflows.md)",
    )
    p.add_argument("--goal-command", metavar="CMD", help="the local agent runs goal tasks with CMD")
    p.add_argument("--demo", action="store_true", help="keep submitting a mix of demo tasks")
    p.add_argument(
        "--web",
        default="127.0.0.1:8080",
        metavar="HOST:PORT",
        help="where to serve the web console (default 127.0.0.1:8080; 'off' for none)",
    )
    add_metrics_flag(p, default_on=True)
    retention.add_retain_flag(p)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("serve", help="run the control plane (actors + NATS handlers)")
    add_common(p)
    p.add_argument("--lease-s", type=float, default=30.0, help="execution lease period")
    p.add_argument("--claim-s", type=float, default=30.0, help="time a host has to claim")
    p.add_argument("--ack-s", type=float, default=15.0, help="time a host has to ack")
    p.add_argument(
        "--liveness-s", type=float, default=30.0, help="a host unseen this long gets no new work"
    )
    p.add_argument(
        "--heartbeat-s",
        type=float,
        default=5.0,
        help="heartbeat period told to hosts at registration (must be below --liveness-s)",
    )
    p.add_argument(
        "--broker-jwt-expiry-s",
        type=float,
        default=300.0,
        help="secured broker: lifetime of the NATS authorizations the callout issues; "
        "every connection re-proves its host or user this often (default 300)",
    )
    p.add_argument(
        "--broker-security",
        action="store_true",
        help="the NATS of --nats-url runs the secured config of `fleetlease broker config` "
        "for this state dir's broker keys: serve its auth callout (one server or a cluster; "
        f"env {ENV_BROKER_SECURITY}=1)",
    )
    p.add_argument(
        "--js-replicas",
        default=None,
        help="replica count of the JetStream assets (artifact store, staging stream); "
        f"up to the size of a NATS cluster (env {ENV_JS_REPLICAS}; default 1)",
    )
    add_metrics_flag(p, default_on=True)
    retention.add_retain_flag(p)
    p.set_defaults(func=cmd_serve)


def _migrate(url: str) -> None:
    from fleetlease.persistence.migrate import upgrade

    async def run() -> None:
        await check_database(url)
        await upgrade(url)

    asyncio.run(run())


def cmd_migrate(args: argparse.Namespace) -> int:
    settings = from_args(args)
    configure_logging(debug=settings.debug)
    if settings.database_url:
        try:
            _migrate(settings.database_url)
        except Unreachable as exc:
            raise CliError(exc.message, EXIT_UNAVAILABLE) from exc
        print(f"schema up to date on {redact(settings.database_url)}")
        return EXIT_OK
    ensure_state_dir(settings.state_dir)
    with Services(settings, need_nats=False) as services:
        _migrate(services.database_url)
        print(f"schema up to date on the embedded PostgreSQL in {settings.state_dir}")
    return EXIT_OK


@contextlib.contextmanager
def stop_signals() -> Iterator[threading.Event]:
    """An event set by SIGINT, SIGTERM or SIGHUP (the terminal went away: without
    a handler Python would die at once and orphan its children). The handlers
    stay in place until the block ends, so a second Ctrl-C during shutdown does
    not abandon children."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            with contextlib.suppress(OSError):
                print("fleetlease: already stopping", flush=True)
        stop.set()

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield stop
    finally:
        for s, previous in old.items():
            signal.signal(s, previous)


def wait(stop: threading.Event) -> None:
    while not stop.wait(3600):
        pass


def up_devices(value: str) -> tuple[str | None, int]:
    """``up --devices``: a count of simulated devices, or a device source spec
    (then the count is the devices the local agent is waited for: those of
    its ``simulated:N`` / ``local:N`` parts, at least 1)."""
    text = value.strip()
    if text.lstrip("-").isdigit():
        n = int(text)
        if n < 0:
            raise CliError("--devices must be 0 or more", EXIT_USAGE)
        return None, n
    count = 0
    for part in text.split(","):
        kind, _, arg = part.strip().partition(":")
        if kind in ("simulated", "local") and arg.strip().isdigit():
            count += int(arg)
    return text, max(count, 1)


def cmd_up(args: argparse.Namespace) -> int:
    """The whole system on one machine: PostgreSQL and NATS (embedded unless given),
    the control plane in this process, one local agent with simulated devices as a
    child process, an admin user and a default project; ``--demo`` adds a stream of
    demo tasks in a live table. Ctrl-C stops everything in reverse order."""
    eventloop.checked_factory(_usage_error)
    settings = from_args(args)
    device_spec, device_count = up_devices(str(args.devices))
    if device_spec is not None:
        from fleetlease.hostagent.sources import device_manager_from_specs

        try:
            device_manager_from_specs([device_spec])  # checks the spec; runs nothing
        except ValueError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    workflows = str(Path(args.workflows).resolve()) if args.workflows else None
    if workflows is not None and not Path(workflows).is_dir():
        raise CliError(f"--workflows {args.workflows}: not a directory", EXIT_USAGE)
    metrics, metrics_optional = metrics_from_args(args, default_on=True)
    retain_s = retention.retain_from_args(args)
    try:
        ensure_state_dir(settings.state_dir)
        log_dir = settings.state_dir / "logs"
        log_dir.mkdir(exist_ok=True, mode=0o700)
        # The control plane logs every transition: to a file, unless --debug.
        # Rotated by size (``ops/logging.py``): a flood of refused requests
        # cannot fill the disk.
        log_file = None if settings.debug else configure_file_logging(log_dir / "up.log")
        if log_file is None:
            configure_logging(debug=settings.debug)
        try:
            with (
                stop_signals() as stop,
                single_instance(settings.state_dir),
                Services(settings) as services,
            ):
                _migrate(services.database_url)
                system = LocalSystem(
                    settings=settings,
                    services=services,
                    devices=device_count,
                    device_spec=device_spec,
                    workflows=workflows,
                    goal_command=args.goal_command,
                    demo=args.demo,
                    stop=stop,
                    log_dir=log_dir,
                    web=None if args.web == "off" else args.web,
                    metrics=metrics,
                    metrics_optional=metrics_optional,
                    retain_s=retain_s,
                )
                try:
                    interpreter.tune()
                    eventloop.run(system.run())
                finally:
                    stop.set()
                _say("fleetlease up: stopped")
        finally:
            if log_file is not None:
                configure_logging(debug=settings.debug)
                log_file.close()
    except (AlreadyRunning, Unreachable) as exc:
        raise CliError(exc.message, EXIT_UNAVAILABLE) from exc
    return EXIT_OK


ADMIN_USER = "admin"
DEFAULT_PROJECT = "default"
LOCAL_HOST = "local"
AGENT_STOP_GRACE_S = 30.0
HOST_LIVE_TIMEOUT_S = 30.0
HANG_GOAL = "wait for a dialog that never comes"


def _say(text: str, *, err: bool = False) -> None:
    """Print, unless the terminal is gone (SIGHUP): stopping must go on regardless."""
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr if err else sys.stdout, flush=True)


def _write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.replace(tmp, path)


def _read_secret(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


@dataclass(kw_only=True)
class LocalSystem:
    """What ``fleetlease up`` runs on its asyncio loop: the control plane, the
    bootstrap of the admin, the default project and the local host, the agent
    child process (restarted if it dies) and, with ``--demo``, the demo."""

    settings: Any
    services: Services
    devices: int
    demo: bool
    stop: threading.Event
    #: The agent's ``--devices`` (default: ``simulated:<devices>``).
    device_spec: str | None = None
    workflows: str | None = None
    goal_command: str | None = None
    log_dir: Path
    service: Any = None
    agent: asyncio.subprocess.Process | None = None
    #: HOST:PORT of the web console (None: no console).
    web: str | None = None
    console: Any = None
    admin_token: str = ""
    admin_name: str = ADMIN_USER
    #: HOST:PORT of the metrics listener (None: none); see ``ops/observe``.
    metrics: str | None = None
    metrics_optional: bool = False
    #: Default retention of finished tasks, seconds (0: forever).
    retain_s: int = 0

    @property
    def state_dir(self) -> Path:
        return Path(self.settings.state_dir)

    @property
    def admin_token_path(self) -> Path:
        return self.state_dir / "admin.token"

    @property
    def credential_path(self) -> Path:
        return self.state_dir / "hosts" / f"{LOCAL_HOST}.credential"

    async def run(self) -> None:
        from fleetlease.ops.service import ControlPlaneService

        self.service = ControlPlaneService(
            database_url=self.services.database_url,
            nats_url=self.services.nats_url,
            state_dir=self.state_dir,
            prefix=self.settings.prefix,
            migrate=False,
            broker_security=self.services.broker_security,
            metrics=self.metrics,
            metrics_optional=self.metrics_optional,
            retain_s=self.retain_s,
        )
        stopped = asyncio.ensure_future(asyncio.to_thread(self.stop.wait))
        try:
            await self.service.start()
            await self.bootstrap()
            if self.devices > 0:
                await self.start_agent()
            context = self.write_context()
            await self.start_console()
            await self.announce(context)
            await self.supervise(stopped)
        finally:
            _say("fleetlease up: stopping")
            self.stop.set()
            if self.console is not None:
                await self.console.stop()
            await self.stop_agent()
            await self.service.stop()
            await stopped

    # --- first start / later starts -------------------------------------------------------
    async def bootstrap(self) -> None:
        """Create (first start) or find again (later starts) the platform admin, the
        default project and the local host with its credential file."""
        from fleetlease.persistence.errors import Conflict, Unauthorized

        repo = self.service.repo
        token = _read_secret(self.admin_token_path)
        user = None
        if token is not None:
            try:
                user = await repo.authenticate_user(token)
            except Unauthorized:
                user = None
        if user is None or not user.platform_admin:
            name = ADMIN_USER
            try:
                token = await repo.add_user(name, platform_admin=True)
            except Conflict:
                # "admin" exists but its token is lost (the file was removed):
                # make another platform admin rather than guess.
                name = f"{ADMIN_USER}-{secrets.token_hex(3)}"
                token = await repo.add_user(name, platform_admin=True)
            _write_secret(self.admin_token_path, token)
            log.info("up_admin_created", user=name)
            self.admin_name = name
        else:
            self.admin_name = user.name
        assert token is not None
        self.admin_token = token
        with contextlib.suppress(Conflict):
            await repo.add_project(DEFAULT_PROJECT, owner=self.admin_name)
        if self.devices > 0:
            await self._local_host()

    async def _local_host(self) -> None:
        from fleetlease.persistence.errors import Conflict, NotFound, Unauthorized

        repo = self.service.repo
        credential = _read_secret(self.credential_path)
        if credential is not None:
            try:
                # A registration proves the file matches the database; the agent's
                # own registration supersedes this session a moment later.
                await repo.register_session(LOCAL_HOST, credential)
                return
            except Unauthorized:
                pass
        try:
            credential = await repo.add_host(LOCAL_HOST)
        except Conflict:
            with contextlib.suppress(NotFound):
                await repo.revoke_host(LOCAL_HOST)
            credential = await repo.add_host(LOCAL_HOST)
        _write_secret(self.credential_path, credential)
        log.info("up_host_created", host_id=LOCAL_HOST)

    def write_context(self) -> Path:
        services = self.services
        return write_context(
            self.state_dir,
            {
                "database_url": services.database_url,
                "nats_url": services.nats_url,
                "nats_port": services.nats.port if services.nats else None,
                "prefix": self.settings.prefix,
                "admin_user": self.admin_name,
                "admin_token_path": str(self.admin_token_path),
                "pid": os.getpid(),
                "metrics_url": self.service.observer.url if self.service.observer else None,
            },
        )

    # --- the local agent --------------------------------------------------------------------
    def agent_command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "fleetlease.ops.cli",
            "agent",
            "--host-id",
            LOCAL_HOST,
            "--token-file",
            str(self.credential_path),
            "--nats-url",
            self.services.nats_url,
            "--devices",
            self.device_spec or f"simulated:{self.devices}",
            "--state-dir",
            str(self.state_dir),
            "--prefix",
            self.settings.prefix,
            *(["--workflows", self.workflows] if self.workflows else []),
            *(["--goal-command", self.goal_command] if self.goal_command else []),
        ]

    async def start_agent(self) -> None:
        env = dict(os.environ)
        env["FLEETLEASE_PREFIX"] = self.settings.prefix
        env.pop("FLEETLEASE_TOKEN", None)
        out = await asyncio.to_thread(open, self.log_dir / "agent.log", "ab")
        try:
            # Its own session: the terminal's Ctrl-C reaches only us, and we stop
            # the agent first, while the control plane can still take its reports.
            self.agent = await asyncio.create_subprocess_exec(
                *self.agent_command(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
                start_new_session=True,
            )
        finally:
            out.close()
        log.info("up_agent_started", pid=self.agent.pid)

    async def stop_agent(self) -> None:
        proc = self.agent
        self.agent = None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), AGENT_STOP_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def wait_host_live(self) -> dict[str, Any] | None:
        from fleetlease.ops.userapi import project_host

        loop = asyncio.get_running_loop()
        deadline = loop.time() + HOST_LIVE_TIMEOUT_S
        while loop.time() < deadline and not self.stop.is_set():
            for raw in await self.service.repo.list_hosts():
                h = project_host(raw)
                if h["host_id"] == LOCAL_HOST and h["live"] and h["devices"] >= self.devices:
                    return h
            if self.agent is not None and self.agent.returncode is not None:
                return None
            await asyncio.sleep(0.2)
        return None

    async def start_console(self) -> None:
        """The web console (``ops/web``), on the ops subjects like any user client.
        A port in use is reported, not fatal: the rest of the system is still useful."""
        if self.web is None:
            return
        from fleetlease.ops.client import OpsError
        from fleetlease.ops.web import WebSettings
        from fleetlease.ops.web.server import parse_listen, start_console

        try:
            host, port = parse_listen(self.web)
            self.console = await start_console(
                WebSettings(nats_url=self.services.nats_url, prefix=self.settings.prefix),
                host=host,
                port=port,
            )
        except (ValueError, OSError, OpsError) as exc:
            _say(f"fleetlease up: no web console on {self.web}: {exc}", err=True)

    async def announce(self, context: Path) -> None:
        services = self.services
        print(f"fleetlease up: state in {self.state_dir}")
        print(
            f"  PostgreSQL     {redact(services.database_url)}"
            + (" (embedded)" if services.pg else "")
        )
        print(f"  NATS           {services.nats_url}" + (" (embedded)" if services.nats else ""))
        print(f"  control plane  in this process, subjects {self.settings.prefix}.>")
        if self.agent is not None:
            host = await self.wait_host_live()
            status = f"live, {host['devices']} devices" if host else "not live yet (see its log)"
            print(f"  agent          host {LOCAL_HOST}, pid {self.agent.pid}, {status}")
        print(f"  admin          user {self.admin_name}, token in {self.admin_token_path}")
        if self.console is not None:
            print(f"  web console    {self.console.url} (sign in with the admin token)")
        if self.service.observer is not None:
            print(f"  metrics        {self.service.observer.url}/metrics (/healthz, /readyz)")
        print(f"  context        {context}")
        print(f"  logs           {self.log_dir}")
        if not self.demo:
            print('In another terminal: fleetlease submit --goal "open settings"; fleetlease tasks')
        print("Ctrl-C stops everything.", flush=True)

    async def supervise(self, stopped: asyncio.Future[Any]) -> None:
        """Run until Ctrl-C: restart the agent if it dies, run the demo if asked."""
        demo = asyncio.ensure_future(self.run_demo()) if self.demo else None
        delay = 1.0
        try:
            while not stopped.done():
                waits: list[asyncio.Future[Any]] = [stopped]
                if self.agent is not None:
                    exited = asyncio.ensure_future(self.agent.wait())
                    waits.append(exited)
                if demo is not None:
                    waits.append(demo)
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if demo is not None and demo.done():
                    demo.result()  # a crashed demo stops `up` with its error
                if stopped.done() or self.agent is None or self.agent.returncode is None:
                    continue
                code = self.agent.returncode
                _say(
                    f"fleetlease up: the agent exited ({code}); restarting it in {delay:g}s "
                    f"(log: {self.log_dir / 'agent.log'})",
                    err=True,
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(stopped), delay)
                if not stopped.done():
                    delay = min(delay * 2, 30.0)
                    await self.start_agent()
        finally:
            if demo is not None:
                demo.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await demo

    # --- the demo -----------------------------------------------------------------------
    async def run_demo(self) -> None:
        """Keep submitting a mix of demo tasks through the user API and show them
        in a live table (or as lines when stdout is not a terminal)."""
        from fleetlease.ops import render
        from fleetlease.persistence.errors import RepositoryError

        api = self.service.ops
        token = self.admin_token
        rng = random.Random()
        hanging: list[tuple[float, str]] = []
        submitted = 0
        loop = asyncio.get_running_loop()
        live = None
        if render.is_tty(sys.stdout):
            from rich.live import Live

            live = Live(console=render.console(), auto_refresh=False)
            live.start()
        else:
            self.service.control_plane.add_listener(lambda e: _say(render.event_line(e)))
        try:
            while True:
                try:
                    args = demo_task(rng, submitted)
                    submitted += 1
                    data = await api.handle("submit", token, args)
                    if args.get("goal") == HANG_GOAL:
                        hanging.append((loop.time() + 4.0, data["id"]))
                    now = loop.time()
                    for due, task_id in [h for h in hanging if h[0] <= now]:
                        hanging.remove((due, task_id))
                        await api.handle("cancel", token, {"id": task_id})
                    if live is not None:
                        rows = max(5, min(25, live.console.height - 6))
                        tasks = await api.handle("tasks", token, {"limit": rows})
                        live.update(
                            render.tasks_table(
                                tasks, title="fleetlease up --demo (Ctrl-C stops)", compact=True
                            ),
                            refresh=True,
                        )
                except RepositoryError as exc:
                    # A busy or restarting control plane: the demo just carries on.
                    log.warning("up_demo_request_failed", code=exc.code, error=exc.message)
                await asyncio.sleep(rng.uniform(0.3, 1.0))
        finally:
            if live is not None:
                with contextlib.suppress(OSError, ValueError):
                    live.stop()


#: The first demo tasks show one of each kind, so every outcome appears at once.
_FIRST_ROLLS = (0.0, 0.95, 0.7, 0.8, 0.55)


def demo_task(rng: random.Random, n: int = len(_FIRST_ROLLS)) -> dict[str, Any]:
    """The ``n``-th demo task: mostly quick successes, some workflows, failures,
    retries and hangs (cancelled a few seconds later)."""
    roll = _FIRST_ROLLS[n] if n < len(_FIRST_ROLLS) else rng.random()
    quick = {"duration_s": round(rng.uniform(0.5, 3.0), 1), "log_lines": 3}
    if roll < 0.5:
        return {"goal": "open settings", "payload": {"sim": quick}}
    if roll < 0.65:
        steps = [dict(quick, duration_s=round(rng.uniform(0.3, 1.0), 1)) for _ in range(3)]
        return {"workflow": "checkout", "payload": {"steps": steps}}
    if roll < 0.75:
        return {
            "goal": "tap a button that is not there",
            "payload": {"sim": dict(quick, outcome="failed")},
            "max_attempts": 1,
        }
    if roll < 0.9:
        return {
            "goal": "flaky network check",
            "payload": {"sim": dict(quick, outcome="retryable")},
            "max_attempts": 3,
            "backoff_base_s": 1.0,
        }
    return {"goal": HANG_GOAL, "payload": {"sim": {"outcome": "hang"}}}


def timings_from_args(args: argparse.Namespace) -> Any:
    from fleetlease.persistence.model import LeaseTimings

    for name in ("lease_s", "claim_s", "ack_s", "liveness_s"):
        value = getattr(args, name)
        if not value > 0:
            raise CliError(f"--{name.replace('_', '-')} must be positive", EXIT_USAGE)
    heartbeat_s = getattr(args, "heartbeat_s", 5.0)
    if not 0 < heartbeat_s < args.liveness_s:
        # A host beating slower than the liveness window drops in and out of "live"
        # and starves assignment.
        raise CliError("--heartbeat-s must be positive and below --liveness-s", EXIT_USAGE)
    expiry = getattr(args, "broker_jwt_expiry_s", None)
    if expiry is not None and not expiry >= 1:
        raise CliError("--broker-jwt-expiry-s must be at least 1 second", EXIT_USAGE)
    return LeaseTimings(
        claim_s=args.claim_s, ack_s=args.ack_s, lease_s=args.lease_s, liveness_s=args.liveness_s
    )


async def run_control_plane(
    settings: Any,
    services: Services,
    timings: Any,
    stop: threading.Event,
    on_ready: Any = None,
    heartbeat_s: float = 5.0,
    broker_jwt_expires_s: float = 300.0,
    metrics: tuple[str | None, bool] = (None, False),
    retain_s: int | None = None,
    js_replicas: int = 1,
) -> None:
    from fleetlease.ops.service import ControlPlaneService, install_chaos_hook
    from fleetlease.transport.staging import StagingLimits

    # Off unless FLEETLEASE_CHAOS_DIR is set (soak and fault tests only).
    uninstall_chaos = install_chaos_hook(asyncio.get_running_loop())
    service = ControlPlaneService(
        database_url=services.database_url,
        nats_url=services.nats_url,
        state_dir=settings.state_dir,
        prefix=settings.prefix,
        timings=timings,
        heartbeat_s=heartbeat_s,
        broker_security=services.broker_security,
        broker_jwt_expires_s=broker_jwt_expires_s,
        metrics=metrics[0],
        metrics_optional=metrics[1],
        retain_s=retain_s,
        staging=StagingLimits(replicas=js_replicas),
    )
    await service.start()
    try:
        if on_ready is not None:
            await on_ready(service)
        # The event is set by the SIGINT/SIGTERM handler on the main thread.
        await asyncio.to_thread(stop.wait)
    finally:
        await service.stop()
        if uninstall_chaos is not None:
            uninstall_chaos()


def _usage_error(message: str) -> CliError:
    return CliError(message, EXIT_USAGE)


async def _serve_precheck(
    settings: Any, timeout: float = 10.0, connect_options: dict[str, Any] | None = None
) -> None:
    """Reachability of the given servers, bounded: nats-py keeps retrying a
    refused first connect, so ``check_nats`` alone can wait forever."""
    from fleetlease.ops.system import check_nats

    if settings.database_url:
        await check_database(settings.database_url)
    if settings.nats_url:
        try:
            await asyncio.wait_for(
                check_nats(settings.nats_url, timeout=5.0, connect_options=connect_options),
                timeout,
            )
        except TimeoutError:
            raise Unreachable(f"cannot reach NATS at {settings.nats_url}: timed out") from None


def _broker_options(settings: Any, secured: bool) -> dict[str, Any] | None:
    """The control plane's connect options on a secured broker it was given."""
    if not secured:
        return None
    from fleetlease.transport.broker_config import BrokerConfigError, BrokerKeys

    directory = settings.state_dir / "broker"
    if not (directory / "issuer.nk").exists():
        raise CliError(
            f"--broker-security: no broker keys in {directory}; write the broker's config "
            "with `fleetlease broker config` on this state dir (or copy its broker/ here)",
            EXIT_USAGE,
        )
    try:
        keys = BrokerKeys.load_or_create(directory)
    except BrokerConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    return keys.control_plane_connect_options()


def cmd_serve(args: argparse.Namespace) -> int:
    eventloop.checked_factory(_usage_error)
    settings = from_args(args)
    configure_logging(debug=settings.debug, cache=True)
    timings = timings_from_args(args)
    metrics = metrics_from_args(args, default_on=True)
    retain_s = retention.retain_from_args(args)
    try:
        replicas = js_replicas(args.js_replicas)
        secured = broker_security(args.broker_security) and bool(settings.nats_url)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    try:
        ensure_state_dir(settings.state_dir)
        asyncio.run(_serve_precheck(settings, connect_options=_broker_options(settings, secured)))
        with stop_signals() as stop, Services(settings, secured=secured) as services:
            print(
                f"fleetlease serve: PostgreSQL {redact(services.database_url)}, "
                f"NATS {services.nats_url}, prefix {settings.prefix}, "
                f"event loop {eventloop.loop_name()}",
                flush=True,
            )
            interpreter.tune()
            eventloop.run(
                run_control_plane(
                    settings,
                    services,
                    timings,
                    stop,
                    heartbeat_s=args.heartbeat_s,
                    broker_jwt_expires_s=args.broker_jwt_expiry_s,
                    metrics=metrics,
                    retain_s=retain_s,
                    js_replicas=replicas,
                )
            )
    except (AlreadyRunning, Unreachable) as exc:
        raise CliError(exc.message, EXIT_UNAVAILABLE) from exc
    return EXIT_OK
