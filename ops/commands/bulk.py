"""Bulk operator commands: ``cancel --project P [--state S] [--host H]
[--older-than DURATION]``, the waiting tasks of a project cancelled a batch (one
transaction) per request, after a confirmation on a terminal (``--yes`` for
scripts). The single-task commands are in ``tasks.py``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from fleetlease.ops import render
from fleetlease.ops.cli import EXIT_USAGE, CliError


def add_bulk_cancel_args(p: argparse.ArgumentParser) -> None:
    """The bulk filters of ``cancel``."""
    p.add_argument(
        "--state",
        action="append",
        choices=("queued", "retrying"),
        default=[],
        help="bulk: tasks in this waiting state (repeatable; default queued)",
    )
    p.add_argument("--project", help="bulk: the project whose waiting tasks to cancel")
    p.add_argument("--host", help="bulk: only tasks whose latest attempt ran on this host")
    p.add_argument(
        "--older-than",
        type=duration,
        metavar="DURATION",
        help="bulk: only tasks submitted at least this long ago (90, 30s, 10m, 2h, 1d)",
    )
    p.add_argument("--yes", "-y", action="store_true", help="bulk: do not ask for confirmation")


def duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``10m``, ``2h`` or ``1d``."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a duration (90, 30s, 10m, 2h, 1d): {text!r}"
        ) from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be zero or more: {text!r}")
    return value


def cmd_cancel_many(args: argparse.Namespace) -> int:
    """Cancel the waiting tasks of a project that match the filters, a batch
    (one transaction) per request, after confirming on a terminal."""
    states = sorted(set(args.state or ["queued"]))
    filters: dict[str, Any] = {
        "project": args.project,
        "states": states,
        "host": args.host,
        "older_than_s": args.older_than,
    }
    if not args.yes and not (render.is_tty(sys.stdin) and render.is_tty(sys.stderr)):
        raise CliError("a bulk cancel needs --yes when not run on a terminal", EXIT_USAGE)

    from fleetlease.ops.client import OpsClient
    from fleetlease.ops.commands.shared import progress_bar, run

    async def body(client: OpsClient) -> None:
        probe = await client.call("cancel_many", **filters, dry_run=True)
        matched, bound = int(probe["matched"]), int(probe["bound"])
        what = f"{' or '.join(states)} task(s) of project {args.project}"
        if args.host:
            what += f" last on host {args.host}"
        if matched and not args.yes:
            answer = await asyncio.to_thread(_ask, f"cancel {matched} {what}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("nothing cancelled", file=sys.stderr)
                return
        ids: list[str] = []
        with progress_bar(f"cancelling {matched} tasks", matched) as advance:
            while matched:
                data = await client.call("cancel_many", **filters, bound=bound)
                ids.extend(data["ids"])
                advance(int(data["cancelled"]))
                if not data["more"] or not data["cancelled"]:
                    break
        if args.json:
            render.print_json({"cancelled": len(ids), "ids": ids})
        else:
            print(f"cancelled {len(ids)} {what}")

    return run(args, body)


def _ask(prompt: str) -> str:
    print(prompt, end="", file=sys.stderr, flush=True)
    return sys.stdin.readline()
