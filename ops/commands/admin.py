"""The administrative commands: ``host add|revoke|list`` (``host drain|undrain``
are in ``drain.py``), ``user add``, ``project add`` and ``project set-retention``
(``retention.py``; a platform admin's), and ``whoami``.

``user add`` and ``project add`` also have a ``--direct`` mode that writes to the
database without a token: how the first platform admin of a system not started
by ``fleetlease up`` is made.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from fleetlease.ops import render
from fleetlease.ops.cli import EXIT_OK, EXIT_UNAVAILABLE, CliError
from fleetlease.ops.client import OpsClient
from fleetlease.ops.commands import drain, retention
from fleetlease.ops.commands.shared import command_adder, output, run
from fleetlease.ops.config import from_args, read_context
from fleetlease.ops.logging import configure_logging


def register(sub: Any) -> None:
    cmd = command_adder(sub)

    host = sub.add_parser("host", help="host credentials (platform admin)").add_subparsers(
        dest="host_command", metavar="COMMAND", required=True
    )
    p = cmd("add", "create a host and print its credential once", cmd_host_add, host)
    p.add_argument("host_id")
    p.add_argument("--credential-file", help="also write the credential to this file (mode 0600)")
    p = cmd("revoke", "revoke a host: its sessions die and its attempts end", cmd_host_revoke, host)
    p.add_argument("host_id")
    cmd("list", "every host, revoked ones too", cmd_host_list, host)
    drain.add_host_commands(cmd, host)

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
    retention.add_set_retention(project, cmd)

    cmd("whoami", "who the token belongs to", cmd_whoami)


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


def cmd_host_list(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        output(
            args,
            await client.call("host_list"),
            lambda data: render.print_hosts(data, show_revoked=True),
        )

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
