"""The task commands: ``submit``, ``tasks``, ``task show``, ``cancel``, ``logs`` and
``artifacts`` (the bulk ``cancel --project`` is in ``bulk.py``)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path
from typing import Any

from fleetlease.ops import render
from fleetlease.ops.cli import EXIT_CONFLICT, EXIT_OK, EXIT_USAGE, CliError
from fleetlease.ops.client import OpsClient, OpsError
from fleetlease.ops.commands.bulk import add_bulk_cancel_args
from fleetlease.ops.commands.shared import (
    command_adder,
    json_object,
    key_value,
    output,
    positive_int,
    progress_bar,
    run,
    status_line,
)

SUBMIT_CHUNK = 100
#: The most tasks one ``submit --count`` makes without ``--allow-large``, and with it.
MAX_SUBMIT_COUNT = 10_000
MAX_SUBMIT_COUNT_LARGE = 1_000_000
#: The longest page of ``tasks`` the control plane returns.
MAX_LIST_PAGE = 1000
SUBMIT_RETRY_PAUSE_S = 0.5
FOLLOW_POLL_S = 0.5
LOG_PAGE = 1000

TASK_STATES = (
    "queued",
    "assigned",
    "dispatched",
    "running",
    "retrying",
    "done",
    "failed",
    "cancelled",
)


def register(sub: Any) -> None:
    cmd = command_adder(sub)

    p = cmd("submit", "submit a task (prints its id)", cmd_submit)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--goal", help="a goal in plain words, for a goal runner")
    what.add_argument("--workflow", help="the name of a workflow")
    p.add_argument("--payload", type=json_object, help="a JSON object handed to the runner")
    p.add_argument(
        "--selector",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="device capability the task needs (repeatable)",
    )
    p.add_argument("--priority", type=int, help="higher runs first within a project (default 0)")
    p.add_argument("--max-attempts", type=positive_int, help="attempts before failing (default 3)")
    p.add_argument("--backoff", type=float, help="retry backoff base in seconds (default 1)")
    p.add_argument("--project", help="project (default: default)")
    p.add_argument(
        "--count",
        type=positive_int,
        help=f"submit N identical tasks (at most {MAX_SUBMIT_COUNT} without --allow-large)",
    )
    p.add_argument(
        "--allow-large",
        action="store_true",
        help=f"allow --count above {MAX_SUBMIT_COUNT} (up to {MAX_SUBMIT_COUNT_LARGE})",
    )
    p.add_argument(
        "--request-id",
        help="idempotency key: repeating a submit with it returns the first task(s) instead "
        "of making more (default: a random one, used for the automatic retry)",
    )

    p = cmd("tasks", "list the tasks you may see", cmd_tasks)
    p.add_argument("--state", action="append", choices=TASK_STATES, default=[], help="repeatable")
    p.add_argument("--host", help="only tasks whose current attempt is on this host")
    p.add_argument("--project", help="only tasks of this project")
    p.add_argument(
        "--request-id", help="only the tasks one submit made (its request id, printed first)"
    )
    p.add_argument(
        "--limit",
        type=positive_int,
        default=100,
        help=f"at most N, up to {MAX_LIST_PAGE} (default 100)",
    )
    p.add_argument(
        "--cursor", help="start after the task with this cursor (printed when more remain)"
    )

    task = sub.add_parser("task", help="one task").add_subparsers(
        dest="task_command", metavar="COMMAND", required=True
    )
    p = cmd(
        "show", "a task with its attempts, retry, cancel and reconcile status", cmd_task_show, task
    )
    p.add_argument("id", help="task id")

    p = cmd(
        "cancel",
        "cancel a task (idempotent), or every waiting task of a project matching the filters",
        cmd_cancel,
    )
    p.add_argument("id", nargs="?", help="task id (or, instead, --project and filters)")
    add_bulk_cancel_args(p)

    p = cmd("logs", "a task's log lines", cmd_logs)
    p.add_argument("id", help="task id")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the task ends")

    p = cmd("artifacts", "a task's artifacts (list, or download one)", cmd_artifacts)
    p.add_argument("id", help="task id")
    p.add_argument("--get", metavar="NAME", help="download the artifact NAME")
    p.add_argument("--attempt", type=positive_int, help="of this attempt (default: the latest)")
    p.add_argument("--output", "-o", help="file to write (default: NAME in the current dir)")


def cmd_submit(args: argparse.Namespace) -> int:
    request: dict[str, Any] = {
        "goal": args.goal,
        "workflow": args.workflow,
        "payload": args.payload,
        "selector": dict(args.selector) or None,
        "priority": args.priority,
        "max_attempts": args.max_attempts,
        "backoff_base_s": args.backoff,
        "project": args.project,
    }
    count = args.count or 1
    limit = MAX_SUBMIT_COUNT_LARGE if args.allow_large else MAX_SUBMIT_COUNT
    if count > limit:
        more = "" if args.allow_large else " (pass --allow-large for more)"
        raise CliError(f"--count must be at most {limit}{more}", EXIT_USAGE)
    request_id = args.request_id or uuid.uuid4().hex

    async def submit(client: OpsClient, **more: Any) -> Any:
        # With the request id a submit whose reply was lost (a timeout, the
        # control plane or its database failing over) is safe to send again: it
        # returns the first task. One automatic retry; then say how to repeat it.
        for retry in (False, True):
            try:
                return await client.call("submit", **request, **more)
            except OpsError as exc:
                if exc.code != "unavailable":
                    raise
                if retry:
                    raise OpsError(
                        f"{exc}; the submit may or may not have been made: repeat it with "
                        f"--request-id {request_id} to get its task(s) without making more",
                        exc.code,
                    ) from None
                await asyncio.sleep(SUBMIT_RETRY_PAUSE_S)
        raise AssertionError("unreachable")  # pragma: no cover

    async def single(client: OpsClient) -> None:
        data = await submit(client, request_id=request_id)
        if args.json:
            render.print_json(data)
        else:
            print(data["id"])

    async def batch(client: OpsClient) -> None:
        # First, so that an interrupted submit can be found and repeated.
        print(
            f"request id {request_id}: `fleetlease tasks --request-id {request_id}` lists "
            f"its tasks; repeating the submit with --request-id {request_id} makes only "
            "the missing ones",
            file=sys.stderr,
            flush=True,
        )
        ids: list[str] = []
        with progress_bar(f"submitting {count} tasks", count) as advance:
            while len(ids) < count:
                n = min(SUBMIT_CHUNK, count - len(ids))
                # Each chunk its own key; the same chunks on a repeat.
                data = await submit(client, count=n, request_id=f"{request_id}@{len(ids)}")
                ids.extend(data["ids"])
                advance(n)
        if args.json:
            render.print_json({"ids": ids, "request_id": request_id})
        else:
            for task_id in ids:
                print(task_id)

    return run(args, single if args.count is None else batch)


def cmd_tasks(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        query: dict[str, Any] = {
            "states": args.state or None,
            "host": args.host,
            "project": args.project,
            "request_id": args.request_id,
        }
        data = await client.call("tasks", **query, limit=args.limit, cursor=args.cursor)
        rest: list[Any] = []
        output(args, data, render.print_tasks)
        if data and len(data) < args.limit:
            # A short page is the end, or was cut at the reply's size: ask for one more.
            rest = await client.call("tasks", **{**query, "limit": 1, "cursor": data[-1]["cursor"]})
        if data and (len(data) == args.limit or rest):
            # stderr: stdout stays exactly the data.
            print(f"more tasks: --cursor {data[-1]['cursor']}", file=sys.stderr)

    return run(args, body)


def cmd_task_show(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        output(args, await client.call("task_show", id=args.id), render.print_task)

    return run(args, body)


def cmd_cancel(args: argparse.Namespace) -> int:
    bulk = bool(args.state or args.project or args.host or args.older_than is not None)
    if args.id is not None and bulk:
        raise CliError("give a task id or bulk filters (--project ...), not both", EXIT_USAGE)
    if args.id is None and not args.project:
        raise CliError("give a task id, or --project P to cancel its waiting tasks", EXIT_USAGE)
    if bulk:
        from fleetlease.ops.commands.bulk import cmd_cancel_many

        return cmd_cancel_many(args)

    async def body(client: OpsClient) -> int:
        rec = await client.call("cancel", id=args.id)
        output(args, rec, render.print_cancel)
        # A task that had ended answers with its terminal state, as a conflict.
        return EXIT_CONFLICT if rec.get("already_ended") else EXIT_OK

    return run(args, body)


def cmd_logs(args: argparse.Namespace) -> int:
    async def once(client: OpsClient) -> None:
        after = 0
        page: dict[str, Any] = {}
        lines: list[dict[str, Any]] = []
        while True:
            page = await client.call("logs", id=args.id, after_id=after, limit=LOG_PAGE)
            lines.extend(page["lines"])
            after = page["next_after_id"]
            if len(page["lines"]) < LOG_PAGE:
                break
        if args.json:
            render.print_json({**page, "lines": lines})
        elif lines:
            render.print_log_lines(lines)
        else:
            print(f"no log lines (task {page.get('state')})", file=sys.stderr)

    async def follow(client: OpsClient) -> None:
        after = 0
        status = status_line()
        try:
            while True:
                page = await client.call("logs", id=args.id, after_id=after, limit=LOG_PAGE)
                for line in page["lines"]:
                    if args.json:
                        render.print_json_line(line)
                    else:
                        render.print_log_lines([line])
                after = page["next_after_id"]
                status(f"task {page['state']}, following its logs (Ctrl-C to stop)")
                if page["terminal"] and not page["lines"]:
                    break
                if len(page["lines"]) < LOG_PAGE:
                    await asyncio.sleep(FOLLOW_POLL_S)
        finally:
            status(None)
        if not args.json:
            print(f"task {page['state']}", file=sys.stderr)

    return run(args, follow if args.follow else once)


def cmd_artifacts(args: argparse.Namespace) -> int:
    async def listing(client: OpsClient) -> None:
        output(args, await client.call("artifacts", id=args.id), render.print_artifacts)

    async def download(client: OpsClient) -> None:
        target = Path(args.output or Path(args.get).name)
        chunks: list[bytes] = []
        offset = 0
        meta: dict[str, Any] = {}
        while True:
            meta = await client.call(
                "artifact_get", id=args.id, name=args.get, attempt=args.attempt, offset=offset
            )
            chunks.append(meta["data"])
            offset += len(meta["data"])
            if meta["eof"] or not meta["data"]:
                break
        await asyncio.to_thread(target.write_bytes, b"".join(chunks))
        info = {k: v for k, v in meta.items() if k not in ("data", "offset", "eof")}
        info["path"] = str(target)
        if args.json:
            render.print_json(info)
        else:
            print(f"wrote {offset} bytes to {target}")

    return run(args, download if args.get else listing)
