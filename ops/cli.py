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
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

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
    "busy": EXIT_UNAVAILABLE,
}

COMMAND_MODULES = [
    "fleetlease.ops.commands.system",
    "fleetlease.ops.commands.agent",
    "fleetlease.ops.commands.tasks",
    "fleetlease.ops.commands.fleet",
    "fleetlease.ops.commands.admin",
    "fleetlease.ops.commands.drain",
    "fleetlease.ops.commands.watch",
    "fleetlease.ops.commands.bench",
    "fleetlease.ops.commands.web",
    "fleetlease.ops.commands.soak",
    "fleetlease.ops.commands.status",
    "fleetlease.ops.commands.retention",
    "fleetlease.ops.commands.broker",
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


def usage_error(prog: str, message: str) -> NoReturn:
    """Print a usage error as one line naming the (sub)command, exit 2."""
    print(f"{prog}: {message} (see {prog} --help)", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def _unknown(extras: Sequence[str]) -> str:
    flags = [e.split("=", 1)[0] for e in extras if e.startswith("-") and e != "-"]
    if flags:
        return f"unknown flag {flags[0]}" + (f" (and {len(flags) - 1} more)" if flags[1:] else "")
    return f"unexpected argument {extras[0]!r}"


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line naming the subcommand (``fleetlease submit:
    unknown flag --bogus (see fleetlease submit --help)``), not the usage text."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The deepest subcommand's defaults win: its name for unknown-flag errors,
        # which argparse raises on the top-level parser.
        self.set_defaults(_prog=self.prog)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
        return super().parse_known_args(args, namespace)

    def _knows(self, arg: str) -> bool:
        name = arg.split("=", 1)[0]
        return any(option.startswith(name) for option in self._option_string_actions)

    def error(self, message: str) -> NoReturn:
        # An unknown flag is the error to name, even when argparse stops first
        # at a missing argument (``submit --bogus`` lacks --goal too).
        argv = getattr(self, "_argv", [])
        unknown = [a for a in argv if a[:2] == "--" and len(a) > 2 and not self._knows(a)]
        prefix = "unrecognized arguments: "
        if unknown:
            message = _unknown(unknown)
        elif message.startswith(prefix):
            message = _unknown(message[len(prefix) :].split())
        usage_error(self.prog, message)


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


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what
    is still buffered for a closed pipe neither fails nor prints."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (captured): nothing is flushed to a pipe
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        usage_error(getattr(args, "_prog", parser.prog), _unknown(extras))
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (``fleetlease logs ID | head -1``): stop quietly.
        _discard_stdout()
        return EXIT_OK
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
