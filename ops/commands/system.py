"""``fleetlease migrate``, ``up`` and ``serve``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import structlog

from ops.cli import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, CliError, add_common
from ops.config import ensure_state_dir, from_args, write_context
from ops.logging import configure_logging
from ops.system import AlreadyRunning, Services, Unreachable, check_database, single_instance
from persistence.db import redact

log = structlog.get_logger("fleetlease.cli")


def register(sub: Any) -> None:
    p = sub.add_parser("migrate", help="apply the database schema (Alembic)")
    add_common(p)
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("up", help="run the whole system locally on embedded defaults")
    add_common(p)
    p.add_argument("--devices", type=int, default=4, help="simulated devices of the local agent")
    p.add_argument("--demo", action="store_true", help="keep submitting a mix of demo tasks")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("serve", help="run the control plane (actors + NATS handlers)")
    add_common(p)
    p.add_argument("--lease-s", type=float, default=30.0, help="execution lease period")
    p.add_argument("--claim-s", type=float, default=30.0, help="time a host has to claim")
    p.add_argument("--ack-s", type=float, default=15.0, help="time a host has to ack")
    p.add_argument(
        "--liveness-s", type=float, default=30.0, help="a host unseen this long gets no new work"
    )
    p.set_defaults(func=cmd_serve)


def _migrate(url: str) -> None:
    from persistence.migrate import upgrade

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
    """An event set by SIGINT or SIGTERM. The handlers stay in place until the
    block ends, so a second Ctrl-C during shutdown does not abandon children."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            print("fleetlease: already stopping", flush=True)
        stop.set()

    old_int = signal.signal(signal.SIGINT, handler)
    old_term = signal.signal(signal.SIGTERM, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def wait(stop: threading.Event) -> None:
    while not stop.wait(3600):
        pass


def cmd_up(args: argparse.Namespace) -> int:
    settings = from_args(args)
    configure_logging(debug=settings.debug)
    try:
        ensure_state_dir(settings.state_dir)
        with (
            stop_signals() as stop,
            single_instance(settings.state_dir),
            Services(settings) as services,
        ):
            _migrate(services.database_url)
            ctx: dict[str, Any] = {
                "database_url": services.database_url,
                "nats_url": services.nats_url,
                "nats_port": services.nats.port if services.nats else None,
                "prefix": settings.prefix,
            }
            path = write_context(settings.state_dir, ctx)
            print(f"fleetlease up: state in {settings.state_dir}")
            print(
                f"  PostgreSQL  {redact(services.database_url)}"
                + (" (embedded)" if services.pg else "")
            )
            print(f"  NATS        {services.nats_url}" + (" (embedded)" if services.nats else ""))
            print(f"  context     {path}")
            print("Ctrl-C stops everything.", flush=True)
            wait(stop)
            print("fleetlease up: stopping", flush=True)
    except (AlreadyRunning, Unreachable) as exc:
        raise CliError(exc.message, EXIT_UNAVAILABLE) from exc
    return EXIT_OK


def timings_from_args(args: argparse.Namespace) -> Any:
    from persistence.model import LeaseTimings

    for name in ("lease_s", "claim_s", "ack_s", "liveness_s"):
        value = getattr(args, name)
        if not value > 0:
            raise CliError(f"--{name.replace('_', '-')} must be positive", EXIT_USAGE)
    return LeaseTimings(
        claim_s=args.claim_s, ack_s=args.ack_s, lease_s=args.lease_s, liveness_s=args.liveness_s
    )


async def run_control_plane(
    settings: Any, services: Services, timings: Any, stop: threading.Event, on_ready: Any = None
) -> None:
    from ops.service import ControlPlaneService

    service = ControlPlaneService(
        database_url=services.database_url,
        nats_url=services.nats_url,
        state_dir=settings.state_dir,
        prefix=settings.prefix,
        timings=timings,
    )
    await service.start()
    try:
        if on_ready is not None:
            await on_ready(service)
        # The event is set by the SIGINT/SIGTERM handler on the main thread.
        await asyncio.to_thread(stop.wait)
    finally:
        await service.stop()


def cmd_serve(args: argparse.Namespace) -> int:
    settings = from_args(args)
    configure_logging(debug=settings.debug)
    timings = timings_from_args(args)
    try:
        ensure_state_dir(settings.state_dir)
        with stop_signals() as stop, Services(settings) as services:
            print(
                f"fleetlease serve: PostgreSQL {redact(services.database_url)}, "
                f"NATS {services.nats_url}, prefix {settings.prefix}",
                flush=True,
            )
            asyncio.run(run_control_plane(settings, services, timings, stop))
    except (AlreadyRunning, Unreachable) as exc:
        raise CliError(exc.message, EXIT_UNAVAILABLE) from exc
    return EXIT_OK
