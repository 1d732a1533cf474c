"""``watch``: a live view of tasks changing state, a table redrawn in place on a
terminal, else one line (or, with ``--json``, one JSON object) per change."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from typing import Any

from fleetlease.ops import render
from fleetlease.ops.cli import CliError
from fleetlease.ops.client import OpsClient, task_events
from fleetlease.ops.commands.shared import command_adder, positive_float, positive_int, run
from fleetlease.transport import wire


def register(sub: Any) -> None:
    cmd = command_adder(sub)

    p = cmd("watch", "a live view of tasks changing state", cmd_watch)
    p.add_argument("--limit", type=positive_int, default=30, help="rows in the live table")
    p.add_argument("--max-events", type=positive_int, help="exit after N state changes")
    p.add_argument("--for", dest="duration", type=positive_float, help="exit after S seconds")


def cmd_watch(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        deadline = time.monotonic() + args.duration if args.duration else None
        live = render.is_tty(sys.stdout) and not args.json
        rows: dict[str, dict[str, Any]] = {}
        if live:
            for t in await client.call("tasks", limit=args.limit):
                rows[t["id"]] = t
        seen = 0
        display = _LiveTasks(rows, args.limit) if live else None
        stale = asyncio.Event()

        async def on_gap() -> None:
            # No control plane could continue from where this view was: say so,
            # and re-read what the table shows.
            print("watch: some changes may have been missed", file=sys.stderr, flush=True)
            if display is not None:
                with contextlib.suppress(CliError):
                    display.replace(await client.call("tasks", limit=args.limit))
                stale.set()

        events = task_events(client, on_gap=on_gap)

        async def read_totals() -> None:
            # The title counts the fleet's tasks, not the rows loaded.
            assert display is not None
            with contextlib.suppress(CliError):
                counts = await client.call("fleet_counts")
                display.totals = {str(k): int(v) for k, v in counts.get("tasks", {}).items()}

        async def keep_totals() -> None:
            # Read them again after changes, at most once a second.
            assert display is not None
            while True:
                await stale.wait()
                stale.clear()
                await read_totals()
                display.refresh()
                await asyncio.sleep(1.0)

        totals: asyncio.Task[None] | None = None
        try:
            if display is not None:
                await read_totals()
                display.start()
                display.refresh()  # drawn with the totals
                totals = asyncio.create_task(keep_totals())
            while deadline is None or time.monotonic() < deadline:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    event = await asyncio.wait_for(anext(events), timeout)
                except TimeoutError:
                    break
                seen += 1
                if display is not None:
                    if event["task_id"] not in display.rows:
                        # A task new to the table: show what it is, not just its id.
                        with contextlib.suppress(CliError):
                            display.rows[event["task_id"]] = await client.call(
                                "task_show", id=event["task_id"]
                            )
                    display.apply(event)
                    stale.set()
                elif args.json:
                    render.print_json_line(event)
                else:
                    print(render.event_line(event), flush=True)
                if args.max_events and seen >= args.max_events:
                    break
        finally:
            if totals is not None:
                totals.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await totals
            if display is not None:
                display.stop()
            await events.aclose()

    return run(args, body)


class _LiveTasks:
    """The redrawn-in-place table of ``watch``."""

    def __init__(self, rows: dict[str, dict[str, Any]], limit: int, title: str = "tasks") -> None:
        from rich.live import Live

        self.rows = rows
        self.limit = limit
        self.title = title
        #: The fleet's task totals by state (``fleet_counts``); without them the
        #: summary counts the rows held.
        self.totals: dict[str, int] | None = None
        self.live: Live | None = None
        self.live = Live(self.render(), console=render.console(), auto_refresh=False)

    def render(self) -> Any:
        rows = max(5, min(self.limit, self.live.console.height - 6)) if self.live else self.limit
        ordered = sorted(
            self.rows.values(), key=lambda t: str(t.get("updated_at") or ""), reverse=True
        )[:rows]
        counts: dict[str, int] = {}
        if self.totals is not None:
            counts = {k: v for k, v in self.totals.items() if v}
        else:
            for t in self.rows.values():
                counts[str(t.get("state"))] = counts.get(str(t.get("state")), 0) + 1
        summary = "  ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        return render.tasks_table(ordered, title=f"{self.title}  ({summary})", compact=True)

    def apply(self, event: dict[str, Any]) -> None:
        row = self.rows.setdefault(event["task_id"], {"id": event["task_id"]})
        row["state"] = event["state"]
        for key in ("attempt", "host_id", "device_id"):
            if event.get(key) is not None:
                row[key] = event[key]
        row["updated_at"] = event.get("at") or wire.from_unix(time.time()).isoformat()
        self.refresh()

    def replace(self, tasks: list[dict[str, Any]]) -> None:
        for t in tasks:
            self.rows[t["id"]] = t
        self.refresh()

    def refresh(self) -> None:
        assert self.live is not None
        self.live.update(self.render(), refresh=True)

    def start(self) -> None:
        assert self.live is not None
        self.live.start()

    def stop(self) -> None:
        assert self.live is not None
        self.live.stop()
