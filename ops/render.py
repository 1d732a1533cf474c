"""How the ops commands print: rich tables for people, exact JSON for scripts.

Every function takes the data exactly as the user API returned it (the shapes
documented in docs/cli.md, "JSON output") and never adds anything to the JSON form. Tables are
built at call time on the current ``sys.stdout`` so that tests capturing output
see them; when stdout is not a terminal, rich renders plain text at a fixed wide
width so that ids are never cut.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

STATE_STYLES = {
    "queued": "white",
    "assigned": "blue",
    "dispatched": "blue",
    "running": "cyan",
    "retrying": "magenta",
    "done": "green",
    "failed": "red",
    "cancelled": "yellow",
}


def is_tty(stream: Any = None) -> bool:
    stream = stream if stream is not None else sys.stdout
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def console(*, stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    if is_tty(stream):
        return Console(file=stream, highlight=False)
    return Console(file=stream, width=240, highlight=False, no_color=True, soft_wrap=False)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def print_json_line(data: Any) -> None:
    sys.stdout.write(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n")
    sys.stdout.flush()


# --- cells ------------------------------------------------------------------------


def when(value: Any) -> str:
    """An ISO timestamp as local-free, second-resolution UTC text."""
    if not value:
        return "-"
    try:
        dt = datetime.fromisoformat(str(value))
    except ValueError:
        return str(value)
    if dt.tzinfo is not None:
        dt = dt.astimezone(UTC)
    return dt.strftime("%Y-%m-%d %H:%M:%S")


def state_text(state: Any) -> Text:
    s = str(state or "-")
    return Text(s, style=STATE_STYLES.get(s, ""))


def cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
    return str(value)


def short(value: Any, width: int = 40) -> str:
    s = cell(value)
    return s if len(s) <= width else s[: width - 1] + "…"


def what(task: Mapping[str, Any]) -> str:
    if task.get("goal"):
        return short(task["goal"])
    if task.get("workflow"):
        return "workflow " + short(task["workflow"], 30)
    return "-"


def _table(*columns: str, title: str | None = None) -> Table:
    table = Table(title=title, show_edge=False, pad_edge=False, header_style="bold")
    for name in columns:
        if name in ("ID", "TASK"):
            table.add_column(name, no_wrap=True, min_width=36)
        else:
            table.add_column(name, overflow="fold")
    return table


# --- tables -----------------------------------------------------------------------


def tasks_table(
    tasks: Sequence[Mapping[str, Any]], *, title: str | None = None, compact: bool = False
) -> Table:
    """The task list. ``compact`` (live views): short ids, times of day, no owner
    or project, so that it fits an 80-column terminal."""
    # `tasks` rows carry no placement; rows built from events (watch) do.
    placed = any(t.get("host_id") for t in tasks)
    columns = ["TASK" if compact else "ID", "STATE", "WHAT", "TRY" if compact else "ATTEMPT"]
    with_device = any(t.get("device_id") for t in tasks)
    columns += ["HOST"] if placed else []
    columns += ["DEVICE"] if with_device else []
    columns += ["UPDATED"] if compact else ["OWNER", "PROJECT", "UPDATED"]
    table = Table(title=title, show_edge=False, pad_edge=False, header_style="bold")
    for name in columns:
        if name == "ID":
            table.add_column(name, no_wrap=True, min_width=36)
        elif name in ("TASK", "STATE", "UPDATED"):
            table.add_column(name, no_wrap=True, min_width=8)
        elif name == "WHAT":
            table.add_column(
                name, no_wrap=True, overflow="ellipsis", max_width=18 if compact else 40
            )
        else:
            table.add_column(name, no_wrap=True)
    for t in tasks:
        task_id = cell(t.get("id"))
        row: list[str | Text] = [
            task_id[:8] if compact else task_id,
            state_text(t.get("state")),
            escape(what(t)),
            f"{cell(t.get('attempt'))}/{cell(t.get('max_attempts'))}",
        ]
        if placed:
            row.append(cell(t.get("host_id")))
        if with_device:
            row.append(cell(t.get("device_id")))
        if compact:
            row.append(when(t.get("updated_at"))[-8:])
        else:
            row += [cell(t.get("owner")), cell(t.get("project")), when(t.get("updated_at"))]
        table.add_row(*row)
    return table


def print_tasks(tasks: Sequence[Mapping[str, Any]]) -> None:
    out = console()
    if not tasks:
        out.print("no tasks")
        return
    out.print(tasks_table(tasks))


def print_task(task: Mapping[str, Any]) -> None:
    out = console()
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    cancel = task.get("cancel") or {}
    reconcile = task.get("reconcile") or {}
    rows: list[tuple[str, Any]] = [
        ("id", cell(task.get("id"))),
        ("state", state_text(task.get("state"))),
        ("kind", cell(task.get("kind"))),
        (
            "goal" if task.get("goal") else "workflow",
            escape(cell(task.get("goal") or task.get("workflow"))),
        ),
        ("project / owner", f"{cell(task.get('project'))} / {cell(task.get('owner'))}"),
        ("priority", cell(task.get("priority"))),
        ("attempt", f"{cell(task.get('attempt'))} of {cell(task.get('max_attempts'))}"),
        ("retry at", when(task.get("retry_at"))),
        (
            "cancel",
            f"requested by {cell(cancel.get('by'))} at {when(cancel.get('at'))}"
            if cancel.get("requested")
            else "not requested",
        ),
        (
            "reconcile",
            f"{cell(reconcile.get('outcome'))} at {when(reconcile.get('at'))}"
            if reconcile
            else "-",
        ),
        ("terminal reason", escape(cell(task.get("terminal_reason")))),
        ("created", when(task.get("created_at"))),
        ("updated", when(task.get("updated_at"))),
        ("finished", when(task.get("finished_at"))),
    ]
    if task.get("waiting_reason"):
        rows.append(("waiting", escape(cell(task.get("waiting_reason")))))
    if task.get("selector"):
        rows.append(("selector", escape(cell(task.get("selector")))))
    if task.get("payload"):
        rows.append(("payload", escape(json.dumps(task.get("payload"), ensure_ascii=False))))
    rows.append(
        (
            "result",
            escape(json.dumps(task.get("result"), ensure_ascii=False))
            if task.get("result") is not None
            else "-",
        )
    )
    for name, value in rows:
        grid.add_row(name, value)
    out.print(grid)
    attempts = task.get("attempts") or []
    if attempts:
        table = _table("#", "HOST", "DEVICE", "LEASE", "STARTED", "ENDED", "END REASON")
        for a in attempts:
            table.add_row(
                cell(a.get("number")),
                cell(a.get("host_id")),
                cell(a.get("device_id")),
                cell(a.get("lease_id")),
                when(a.get("started_at") or a.get("assigned_at")),
                when(a.get("ended_at")),
                cell(a.get("end_reason")),
            )
        out.print()
        out.print(table)
    else:
        out.print("\nno attempts yet")


def print_cancel(rec: Mapping[str, Any]) -> None:
    cancel = rec.get("cancel") or {}
    state = cell(rec.get("state"))
    requested = (
        f"requested by {cell(cancel.get('by'))} at {when(cancel.get('at'))}"
        if cancel.get("requested")
        else ""
    )
    if rec.get("already_ended"):
        # Nothing was written: the task had ended before this request.
        extra = f" (a cancel was {requested})" if requested else ""
        console().print(f"task {cell(rec.get('id'))} already {state}: nothing to cancel{extra}")
        return
    tail = "cancelled" if rec.get("completed") else f"{state}: stopping the running attempt"
    console().print(f"cancel of {cell(rec.get('id'))} {requested}: {tail}")


def print_hosts(hosts: Sequence[Mapping[str, Any]], *, show_revoked: bool = False) -> None:
    out = console()
    if not hosts:
        out.print("no hosts")
        return
    columns = [
        "HOST",
        "LIVE",
        "LAST SEEN",
        "GENERATION",
        "DEVICES",
        "WORKFLOWS",
        "GOAL RUNNER",
        "DRAIN",
    ]
    if show_revoked:
        columns += ["REVOKED"]
    table = _table(*columns)
    for h in hosts:
        row: list[str | Text] = [
            cell(h.get("host_id")),
            Text("live", style="green") if h.get("live") else Text("down", style="red"),
            when(h.get("last_seen")),
            cell(h.get("session_generation")),
            cell(h.get("devices")),
            _workflows_cell(h.get("workflows")),
            cell(h.get("goal_runner") or "-"),
            _drain_cell(h.get("drain")),
        ]
        if show_revoked:
            row.append(cell(bool(h.get("revoked"))))
        table.add_row(*row)
    out.print(table)


def _drain_cell(drain: Any) -> Text:
    """A host's drain: ``-``, or ``drained`` with its deadline if it has one."""
    if not isinstance(drain, Mapping):
        return Text("-")
    deadline = drain.get("deadline")
    text = f"drained, deadline {when(deadline)}" if deadline else "drained"
    return Text(text, style="yellow")


def _workflows_cell(workflows: Any) -> str:
    """A host's workflows: ``any`` when it takes every workflow (null)."""
    if workflows is None:
        return "any"
    return ", ".join(str(w) for w in workflows) if workflows else "none"


def print_devices(devices: Sequence[Mapping[str, Any]]) -> None:
    out = console()
    if not devices:
        out.print("no devices")
        return
    table = _table("HOST", "DEVICE", "STATE", "CAPABILITIES", "TASK", "NOTE")
    for d in devices:
        # The state is the control plane's (a reservation means busy); a host
        # report that disagrees is shown, not hidden.
        note = d.get("disagreement")
        if d.get("drained"):
            note = f"drained; {note}" if note else "drained"
        table.add_row(
            cell(d.get("host_id")),
            cell(d.get("device_id")),
            cell(d.get("state")),
            escape(cell(d.get("capabilities"))),
            cell(d.get("task_id")),
            Text(str(note), style="yellow") if note else Text(""),
        )
    out.print(table)


def print_artifacts(artifacts: Sequence[Mapping[str, Any]]) -> None:
    out = console()
    if not artifacts:
        out.print("no artifacts")
        return
    table = _table("ATTEMPT", "NAME", "SIZE", "SHA256", "CREATED")
    for a in artifacts:
        table.add_row(
            cell(a.get("attempt")),
            escape(cell(a.get("name"))),
            cell(a.get("size")),
            cell(a.get("sha256")),
            when(a.get("created_at")),
        )
    out.print(table)


def log_line_text(line: Mapping[str, Any]) -> str:
    return f"[attempt {cell(line.get('attempt'))}] {when(line.get('ts'))}  {line.get('line', '')}"


def print_log_lines(lines: Iterable[Mapping[str, Any]]) -> None:
    for line in lines:
        sys.stdout.write(log_line_text(line) + "\n")
    sys.stdout.flush()


def print_kv(pairs: Iterable[tuple[str, Any]]) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    for k, v in pairs:
        grid.add_row(k, escape(cell(v)))
    console().print(grid)


def event_line(event: Mapping[str, Any]) -> str:
    where = cell(event.get("host_id"))
    if event.get("device_id"):
        where += f"/{event['device_id']}"
    return (
        f"{when(event.get('at'))}  {cell(event.get('task_id'))}  "
        f"{cell(event.get('state')):<10}  attempt {cell(event.get('attempt'))}  {where}"
    )
