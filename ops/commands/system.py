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

from ops.cli import EXIT_OK, EXIT_UNAVAILABLE, CliError, add_common
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
