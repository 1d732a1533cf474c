"""Retention commands (a platform admin's): ``gc [--dry-run]``, a retention
pass now or what it would delete, and ``project set-retention NAME
DURATION|default`` (registered by ``admin.py`` under ``project``)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape
from rich.table import Table

from fleetlease.ops import render
from fleetlease.ops.cli import EXIT_USAGE, CliError
from fleetlease.ops.client import OpsClient
from fleetlease.ops.commands.shared import command_adder, run
from fleetlease.persistence.errors import Invalid
from fleetlease.persistence.retention import parse_retention

#: ``gc`` requests one pass after another until the control plane reports
#: nothing expired left, at most this many (each deletes a bounded number).
MAX_REQUESTS = 1000

_COLUMNS = ("tasks", "attempts", "log_lines", "log_bytes", "artifacts", "artifact_bytes")


def register(sub: Any) -> None:
    cmd = command_adder(sub)
    p = cmd(
        "gc",
        "delete finished tasks older than their project's retention (platform admin)",
        cmd_gc,
    )
    p.add_argument(
        "--dry-run", action="store_true", help="show what would be deleted, delete nothing"
    )


def add_set_retention(project: Any, cmd: Any) -> None:
    p = cmd(
        "set-retention",
        "how long the project's finished tasks are kept (DURATION: 30d, 12h, 90m, 45s, "
        "none = forever; default = the control plane's --retain)",
        cmd_project_set_retention,
        project,
    )
    p.add_argument("name")
    p.add_argument("duration", metavar="DURATION|default")


def _merge(total: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    if not total:
        return data
    for project, usage in data["projects"].items():
        into = total["projects"].setdefault(project, dict.fromkeys(_COLUMNS, 0))
        for k, v in usage.items():
            into[k] = into.get(k, 0) + v
    for k, v in data["total"].items():
        total["total"][k] = total["total"].get(k, 0) + v
    total["batches"] += data["batches"]
    total["objects_deleted"] += data["objects_deleted"]
    total["objects_failed"] += data["objects_failed"]
    total["complete"] = data["complete"]
    return total


def _print_gc(data: dict[str, Any]) -> None:
    verb = "would delete" if data["dry_run"] else "deleted"
    rows = [{"project": project, **usage} for project, usage in sorted(data["projects"].items())]
    if rows:
        rows.append({"project": "TOTAL", **data["total"]})
        table = Table(show_edge=False, pad_edge=False, header_style="bold")
        for name in ("project", *_COLUMNS):
            table.add_column(
                name.upper().replace("_", " "), justify="left" if name == "project" else "right"
            )
        for row in rows:
            table.add_row(escape(str(row["project"])), *(str(row.get(c, 0)) for c in _COLUMNS))
        render.console().print(table)
    total = data["total"]
    line = (
        f"{verb} {total['tasks']} finished task(s), {total['attempts']} attempt(s), "
        f"{total['log_lines']} log line(s), {total['artifacts']} artifact(s) "
        f"({total['artifact_bytes']} bytes); default retention {data['default_retain']}"
    )
    print(line)
    if not data["dry_run"]:
        print(
            f"{len(data['batches'])} batch(es); {data['objects_deleted']} object(s) deleted"
            + (f", {data['objects_failed']} failed" if data["objects_failed"] else "")
        )


def cmd_gc(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        total: dict[str, Any] = {}
        for _ in range(MAX_REQUESTS):
            data = await client.call("gc", dry_run=args.dry_run or None)
            total = _merge(total, data)
            if args.dry_run or data["complete"]:
                break
        if args.json:
            render.print_json(total)
        else:
            _print_gc(total)

    return run(args, body)


def cmd_project_set_retention(args: argparse.Namespace) -> int:
    retain_s: int | None = None
    if args.duration.strip().lower() != "default":
        try:
            retain_s = parse_retention(args.duration, field_name="DURATION")
        except Invalid as exc:
            raise CliError(exc.message, EXIT_USAGE) from exc

    async def body(client: OpsClient) -> None:
        data = await client.call("project_set_retention", name=args.name, retain_s=retain_s)
        if args.json:
            render.print_json(data)
            return
        print(
            f"project {data['name']}: finished tasks kept {data['effective']}"
            + (" (the default)" if data["retain_s"] is None else "")
        )

    return run(args, body)


RETAIN_ENV = "FLEETLEASE_RETAIN"


def add_retain_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--retain",
        metavar="DURATION",
        help=f"keep finished tasks, their logs and artifacts this long (30d, 12h, ...; "
        f"none = forever, the default) unless their project sets its own "
        f"(env {RETAIN_ENV})",
    )


def retain_from_args(args: argparse.Namespace, env: Any = None) -> int:
    """``--retain``, else ``FLEETLEASE_RETAIN``, else forever (0), as seconds."""
    import os

    text = getattr(args, "retain", None) or (os.environ if env is None else env).get(RETAIN_ENV)
    if not text:
        return 0
    try:
        return parse_retention(text, field_name="--retain")
    except Invalid as exc:
        raise CliError(exc.message, EXIT_USAGE) from exc
