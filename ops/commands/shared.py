"""What the user-API commands share: the client flags and settings, connecting
and running a command's body, printing its data (``--json`` or a table), the
argument types, and the terminal's progress bar and status line.

Each command is a request on ``{prefix}.ops.{user}.{verb}`` carrying the user
token (from ``--token``, ``FLEETLEASE_TOKEN`` or the context file written by
``fleetlease up``), answered by the user API (``ops/userapi``) in the control
plane. Output is a table, or with ``--json`` exactly the reply data (shapes in
docs/cli.md, "JSON output"). Errors become one line on stderr and the exit code
of their kind (``ops/cli.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Callable
from typing import Any

from fleetlease.ops import render
from fleetlease.ops.cli import EXIT_DENIED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, CliError
from fleetlease.ops.client import DEFAULT_TIMEOUT_S, OpsClient
from fleetlease.ops.config import Settings, from_args


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


def command_adder(sub: Any) -> Callable[..., Any]:
    """``cmd(name, help, func, parent=sub)``: adds a subcommand that takes the
    client flags and runs ``func(args)``."""

    def cmd(
        name: str, help: str, func: Callable[[argparse.Namespace], int], parent: Any = sub
    ) -> Any:
        p = parent.add_parser(name, help=help, description=help)
        add_client(p)
        p.set_defaults(func=func)
        return p

    return cmd


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


@contextlib.contextmanager
def progress_bar(description: str, total: int) -> Any:
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


def status_line() -> Callable[[str | None], None]:
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
