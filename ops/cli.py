"""The ``fleetlease`` command line.

Each group of subcommands lives in a module of ``ops/commands`` exposing
``register(subparsers)``; a command is a function ``(args) -> int``.

Exit codes (also in ``fleetlease --help``)::

    0  success
    1  unexpected error
    2  usage error (bad flags or arguments)
    3  unauthorized or forbidden
    4  not found
    5  conflict (including gone)
    6  unavailable (database or NATS unreachable, a server already running)
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_DENIED = 3
EXIT_NOT_FOUND = 4
EXIT_CONFLICT = 5
EXIT_UNAVAILABLE = 6

#: The one map from an error's ``code`` (the user API's wire error codes, which
#: ``OpsError`` and the repository's errors carry) to the exit code. The API
#: client and the web console know nothing of exit codes; ``main`` maps them here.
EXIT_BY_CODE = {
    "bad_request": EXIT_USAGE,
    "unauthorized": EXIT_DENIED,
    "forbidden": EXIT_DENIED,
    "not_found": EXIT_NOT_FOUND,
    "conflict": EXIT_CONFLICT,
    "gone": EXIT_CONFLICT,
    "unavailable": EXIT_UNAVAILABLE,
}

COMMAND_MODULES = [
    "fleetlease.ops.commands.system",
    "fleetlease.ops.commands.agent",
    "fleetlease.ops.commands.user",
    "fleetlease.ops.commands.bench",
    "fleetlease.ops.commands.web",
    "fleetlease.ops.commands.soak",
    "fleetlease.ops.commands.status",
]

EPILOG = """exit codes:
  0 success, 1 unexpected error, 2 usage error, 3 unauthorized or forbidden,
  4 not found, 5 conflict, 6 unavailable (database/NATS unreachable, already running)
"""


class CliError(Exception):
    """A failure to report as one line on stderr with a given exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        help="PostgreSQL URL (env FLEETLEASE_DATABASE_URL); embedded server when not given",
    )
    parser.add_argument(
        "--nats-url", help="NATS URL (env FLEETLEASE_NATS_URL); embedded server when not given"
    )
    parser.add_argument(
        "--state-dir",
        help="state directory (env FLEETLEASE_STATE_DIR, default ~/.local/share/fleetlease)",
    )
    parser.add_argument("--prefix", help="NATS subject prefix (env FLEETLEASE_PREFIX)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"fleetlease: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fleetlease",
        description="Lease tasks onto devices of remote hosts.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except CliError as exc:
        if getattr(args, "debug", False):
            raise
        print(f"fleetlease: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # the one place that turns any failure into one line
        if getattr(args, "debug", False):
            raise
        message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        print(f"fleetlease: {message}", file=sys.stderr)
        return exit_code_for(exc)


def exit_code_for(exc: BaseException) -> int:
    """The exit code of a failure: its ``code`` through ``EXIT_BY_CODE``, else 1."""
    code = getattr(exc, "code", None)
    return EXIT_BY_CODE.get(code, EXIT_ERROR) if isinstance(code, str) else EXIT_ERROR


if __name__ == "__main__":
    # Run through the package module so that exception classes are the ones the
    # command modules import (``python -m ops.cli`` would load this file twice).
    from fleetlease.ops.cli import main as _main

    raise SystemExit(_main())
