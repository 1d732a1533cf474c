"""``fleetlease soak``: run the whole system (its own embedded PostgreSQL and
NATS, serve and agent processes) under a seeded fault schedule and report tasks,
faults, invariant violations and recovery times (``ops/testing/soak.py``). Exit 0 when
every task finished and no invariant was violated, 1 otherwise."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import structlog

from fleetlease.ops.cli import EXIT_ERROR, EXIT_OK, EXIT_USAGE, CliError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "soak",
        help="run the whole system under a seeded fault schedule and report",
        description=__doc__,
    )
    p.add_argument("--minutes", type=float, default=1.0, help="length of the fault phase")
    p.add_argument("--seed", type=int, default=1, help="seed of the task mix and the faults")
    p.add_argument("--hosts", type=int, default=3, help="simulated hosts (agent processes)")
    p.add_argument("--devices", type=int, default=3, help="simulated devices per host")
    p.add_argument("--serves", type=int, default=2, help="serve processes sharing the work")
    p.add_argument("--rate", type=float, default=3.0, help="tasks submitted per second")
    p.add_argument("--dir", help="work directory (default: a temporary one, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=cmd_soak)


def cmd_soak(args: argparse.Namespace) -> int:
    from fleetlease.ops.testing.soak import SoakConfig, run_soak

    if not args.minutes > 0:
        raise CliError("--minutes must be positive", EXIT_USAGE)
    for name in ("hosts", "devices", "serves"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name} must be at least 1", EXIT_USAGE)
    if not args.rate > 0:
        raise CliError("--rate must be positive", EXIT_USAGE)
    config = SoakConfig(
        minutes=args.minutes,
        seed=args.seed,
        hosts=args.hosts,
        devices=args.devices,
        serves=args.serves,
        rate=args.rate,
    )
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fleetlease-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    keep = args.keep or bool(args.dir)
    # The harness logs (and the children's logs) go to files; stdout is the report.
    with open(work / "soak.log", "a") as log_file:
        structlog.configure(
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.JSONRenderer(),
            ],
            logger_factory=structlog.PrintLoggerFactory(file=log_file),
        )
        if not args.json:
            print(f"fleetlease soak: seed {args.seed}, {args.minutes:g} min, logs in {work}")
        try:
            report = asyncio.run(run_soak(config, work / "cluster"))
        finally:
            structlog.reset_defaults()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.render())
    if report.ok and not keep:
        shutil.rmtree(work, ignore_errors=True)
    return EXIT_OK if report.ok else EXIT_ERROR
