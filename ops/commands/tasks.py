"""The operator commands: ``submit``, ``tasks``, ``task show``, ``cancel``, ``logs``,
``artifacts``, ``hosts``, ``devices``, ``host add|revoke|list``, ``user add``,
``project add``, ``whoami`` and ``watch``.

Each one is a request on ``{prefix}.ops.{user}.{verb}`` carrying the user token (from
``--token``, ``FLEETLEASE_TOKEN`` or the context file written by ``fleetlease
up``), answered by ``ops/api.py`` in the control plane. Output is a table, or
with ``--json`` exactly the reply data (shapes in the README). Errors become one
line on stderr and the exit code of their kind (``ops/cli.py``).

``user add`` and ``project add`` also have a ``--direct`` mode that writes to the
database without a token: how the first platform admin of a system not started
by ``fleetlease up`` is made.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from fleetlease.ops import render
from fleetlease.ops.cli import (
    EXIT_CONFLICT,
    EXIT_DENIED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
)
from fleetlease.ops.client import (
    DEFAULT_TIMEOUT_S,
    OpsClient,
    OpsError,
    normalize_event,
    task_events,
)
from fleetlease.ops.commands.bulk import add_bulk_cancel_args
from fleetlease.ops.config import Settings, from_args, read_context
from fleetlease.ops.logging import configure_logging
from fleetlease.transport import wire

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


# --- the client ---------------------------------------------------------------------


def client_settings(args: argparse.Namespace) -> Settings:
    settings = from_args(args).with_context()
    if not settings.nats_url:
        raise CliError(
            "no NATS URL: start `fleetlease up`, or pass --nats-url / set FLEETLEASE_NATS_URL",
            EXIT_UNAVAILABLE,
        )
    if settings.token is not None and not settings.token.strip():
        raise CliError(
            "empty user token: pass a token with --token or FLEETLEASE_TOKEN, or unset "
            "both to use the admin token of `fleetlease up`",
            EXIT_USAGE,
        )
    if not settings.token:
        raise CliError(
            "no user token: pass --token, set FLEETLEASE_TOKEN, or start `fleetlease up` "
            "(it writes the admin token into the context file)",
            EXIT_DENIED,
        )
    return settings


def run(args: argparse.Namespace, body: Callable[[OpsClient], Any]) -> int:
    """Connect, run ``body(client)`` (a coroutine function), close."""
    settings = client_settings(args)

    async def main() -> int:
        async with OpsClient.from_settings(settings, args.timeout) as client:
            result = await body(client)
            return EXIT_OK if result is None else int(result)

    return asyncio.run(main())


def output(args: argparse.Namespace, data: Any, table: Callable[[Any], None]) -> None:
    if args.json:
        render.print_json(data)
    else:
        table(data)


# --- argument parsing -----------------------------------------------------------------


def add_client(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats-url", help="NATS URL (env FLEETLEASE_NATS_URL; else the context file)"
    )
    parser.add_argument("--prefix", help="NATS subject prefix (env FLEETLEASE_PREFIX)")
    parser.add_argument(
        "--state-dir",
        help="where `fleetlease up` wrote context.json (env FLEETLEASE_STATE_DIR, "
        "default ~/.local/share/fleetlease)",
    )
    parser.add_argument(
        "--token", help="user token (env FLEETLEASE_TOKEN; else the admin token of `up`)"
    )
    parser.add_argument(
        "--user",
        help="the user the token belongs to: its NATS identity on a secured broker such as "
        "`up`'s (env FLEETLEASE_USER; the admin's with the admin token of `up`)",
    )
    parser.add_argument("--json", action="store_true", help="print exact JSON (stable shapes)")
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for each reply (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key, value


def register(sub: Any) -> None:
    def cmd(
        name: str, help: str, func: Callable[[argparse.Namespace], int], parent: Any = sub
    ) -> Any:
        p = parent.add_parser(name, help=help, description=help)
        add_client(p)
        p.set_defaults(func=func)
        return p

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

    cmd("hosts", "hosts of the fleet", cmd_hosts)
    p = cmd("devices", "devices of the fleet", cmd_devices)
    p.add_argument("--host", help="only this host's devices")

    host = sub.add_parser("host", help="host credentials (platform admin)").add_subparsers(
        dest="host_command", metavar="COMMAND", required=True
    )
    p = cmd("add", "create a host and print its credential once", cmd_host_add, host)
    p.add_argument("host_id")
    p.add_argument("--credential-file", help="also write the credential to this file (mode 0600)")
    p = cmd("revoke", "revoke a host: its sessions die and its attempts end", cmd_host_revoke, host)
    p.add_argument("host_id")
    cmd("list", "every host, revoked ones too", cmd_host_list, host)

    user = sub.add_parser("user", help="users (platform admin)").add_subparsers(
        dest="user_command", metavar="COMMAND", required=True
    )
    p = cmd("add", "create a user and print their token once", cmd_user_add, user)
    p.add_argument("name")
    p.add_argument("--platform-admin", action="store_true", help="may do everything")
    add_direct(p)

    project = sub.add_parser("project", help="projects (platform admin)").add_subparsers(
        dest="project_command", metavar="COMMAND", required=True
    )
    p = cmd("add", "create a project", cmd_project_add, project)
    p.add_argument("name")
    p.add_argument("--owner", required=True, help="the owning user")
    p.add_argument(
        "--admin", action="append", default=[], metavar="USER", help="a project admin (repeatable)"
    )
    add_direct(p)

    cmd("whoami", "who the token belongs to", cmd_whoami)

    p = cmd("watch", "a live view of tasks changing state", cmd_watch)
    p.add_argument("--limit", type=positive_int, default=30, help="rows in the live table")
    p.add_argument("--max-events", type=positive_int, help="exit after N state changes")
    p.add_argument("--for", dest="duration", type=positive_float, help="exit after S seconds")


def add_direct(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--direct",
        action="store_true",
        help="write to the database directly, without a token (bootstrapping the first admin)",
    )
    p.add_argument(
        "--database-url",
        help="PostgreSQL URL for --direct (env FLEETLEASE_DATABASE_URL; else the context "
        "file, else the embedded PostgreSQL of the state dir); implies --direct",
    )


# --- commands -----------------------------------------------------------------------


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
        with _progress(f"submitting {count} tasks", count) as advance:
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


@contextlib.contextmanager
def _progress(description: str, total: int) -> Any:
    """A progress bar on a terminal (stderr, so stdout stays the data); nothing
    otherwise."""
    if not (render.is_tty(sys.stderr) and render.is_tty(sys.stdout)):
        yield lambda n: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=render.console(stderr=True),
        transient=True,
    ) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


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
        status = _status_line()
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


def _status_line() -> Callable[[str | None], None]:
    """A spinner with a message on a terminal's stderr; a no-op when piped."""
    if not render.is_tty(sys.stderr):
        return lambda message: None
    status = render.console(stderr=True).status("")
    started = False

    def update(message: str | None) -> None:
        nonlocal started
        if message is None:
            if started:
                status.stop()
            return
        status.update(message)
        if not started:
            status.start()
            started = True

    return update


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


def cmd_hosts(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        output(args, await client.call("hosts"), render.print_hosts)

    return run(args, body)


def cmd_host_list(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        output(
            args,
            await client.call("host_list"),
            lambda data: render.print_hosts(data, show_revoked=True),
        )

    return run(args, body)


def cmd_devices(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        output(args, await client.call("devices", host=args.host), render.print_devices)

    return run(args, body)


def write_secret(path: Path, value: str) -> None:
    """Write a secret to a file only its owner can read."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.replace(tmp, path)


def cmd_host_add(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        data = await client.call("host_add", host_id=args.host_id)
        if args.credential_file:
            write_secret(Path(args.credential_file), data["token"])
        if args.json:
            render.print_json(data)
            return
        print(f"host {data['host_id']} created; its credential (shown this once):")
        print(data["token"])
        if args.credential_file:
            print(f"(also written to {args.credential_file})")

    return run(args, body)


def cmd_host_revoke(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        data = await client.call("host_revoke", host_id=args.host_id)
        if args.json:
            render.print_json(data)
            return
        print(f"host {data['host_id']} revoked; {len(data['ended'])} active attempt(s) ended")
        for e in data["ended"]:
            print(f"  {e['task_id']} attempt {e['attempt']} -> {e['state']} ({e['end_reason']})")

    return run(args, body)


def _print_user(args: argparse.Namespace, data: dict[str, Any]) -> None:
    if args.json:
        render.print_json(data)
        return
    role = " (platform admin)" if data.get("platform_admin") else ""
    print(f"user {data['name']}{role} created; their token (shown this once):")
    print(data["token"])


def _print_project(args: argparse.Namespace, data: dict[str, Any]) -> None:
    if args.json:
        render.print_json(data)
        return
    admins = ", ".join(data["admins"]) or "none"
    print(f"project {data['name']} created; owner {data['owner']}, admins: {admins}")


def cmd_user_add(args: argparse.Namespace) -> int:
    if args.direct or args.database_url:

        async def direct(repo: Any) -> dict[str, Any]:
            from fleetlease.ops.userapi import Args

            name = Args({"name": args.name}, ("name",)).name("name", required=True)
            token = await repo.add_user(name, platform_admin=args.platform_admin)
            return {"name": name, "platform_admin": args.platform_admin, "token": token}

        _print_user(args, run_direct(args, direct))
        return EXIT_OK

    async def body(client: OpsClient) -> None:
        data = await client.call(
            "user_add", name=args.name, platform_admin=args.platform_admin or None
        )
        _print_user(args, data)

    return run(args, body)


def cmd_project_add(args: argparse.Namespace) -> int:
    if args.direct or args.database_url:

        async def direct(repo: Any) -> dict[str, Any]:
            from fleetlease.ops.userapi import Args

            a = Args(
                {"name": args.name, "owner": args.owner, "admins": args.admin},
                ("name", "owner", "admins"),
            )
            name, owner = a.name("name", required=True), a.name("owner", required=True)
            admins = a.names("admins")
            await repo.add_project(name, owner=owner, admins=admins)
            return {"name": name, "owner": owner, "admins": admins}

        _print_project(args, run_direct(args, direct))
        return EXIT_OK

    async def body(client: OpsClient) -> None:
        data = await client.call(
            "project_add", name=args.name, owner=args.owner, admins=args.admin or None
        )
        _print_project(args, data)

    return run(args, body)


def run_direct(args: argparse.Namespace, body: Callable[[Any], Any]) -> Any:
    """Run ``body(repository)`` against the database directly (no token)."""
    from fleetlease.ops.system import (
        AlreadyRunning,
        Services,
        Unreachable,
        check_database,
        single_instance,
    )

    settings = from_args(args)
    configure_logging(debug=settings.debug)
    if not settings.debug:
        # stdout is the data; embedded-server chatter stays out of the way.
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    async def with_repo(url: str) -> Any:
        from fleetlease.persistence.db import create_engine
        from fleetlease.persistence.migrate import upgrade_engine
        from fleetlease.persistence.repository import Repository

        engine = create_engine(url, pool_size=2, max_overflow=0)
        try:
            await upgrade_engine(engine)
            return await body(Repository(engine))
        finally:
            await engine.dispose()

    try:
        url = settings.database_url
        if not url:
            ctx_url = read_context(settings.state_dir).get("database_url")
            if isinstance(ctx_url, str) and ctx_url:
                try:
                    asyncio.run(check_database(ctx_url, timeout=3.0))
                    url = ctx_url
                except Unreachable:
                    url = None
        if url:
            asyncio.run(check_database(url))
            return asyncio.run(with_repo(url))
        with (
            single_instance(settings.state_dir),
            Services(replace(settings, nats_url=None), need_nats=False) as services,
        ):
            return asyncio.run(with_repo(services.database_url))
    except (AlreadyRunning, Unreachable) as exc:
        raise CliError(exc.message, EXIT_UNAVAILABLE) from exc


def cmd_whoami(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        data = await client.call("whoami")
        output(
            args,
            data,
            lambda d: print(f"{d['name']}" + (" (platform admin)" if d["platform_admin"] else "")),
        )

    return run(args, body)


# --- watch --------------------------------------------------------------------------


def cmd_watch(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        deadline = time.monotonic() + args.duration if args.duration else None
        live = render.is_tty(sys.stdout) and not args.json
        rows: dict[str, dict[str, Any]] = {}
        if live:
            for t in await client.call("tasks", limit=args.limit):
                rows[t["id"]] = t
        seen = 0
        events = task_events(client)
        display = _LiveTasks(rows, args.limit) if live else None
        stale = asyncio.Event()

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
    """The redrawn-in-place table of ``watch`` (and of ``up --demo``)."""

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


__all__ = [
    "EXIT_USAGE",
    "OpsClient",
    "OpsError",
    "normalize_event",
    "register",
    "task_events",
]
