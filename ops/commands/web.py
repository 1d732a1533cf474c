"""``fleetlease web``: the web console (``ops/web``), on 127.0.0.1:8080 by default.

It needs only the NATS URL and prefix (flags, environment or the context file
of ``fleetlease up``); it never uses a token of its own: every page is fetched
with the token of the user signed in to it.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from fleetlease.ops.cli import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, CliError
from fleetlease.ops.client import DEFAULT_TIMEOUT_S
from fleetlease.ops.config import from_args

DEFAULT_LISTEN = "127.0.0.1:8080"


def register(sub: Any) -> None:
    help = "serve the web console (fleet, tasks, live updates)"
    p = sub.add_parser("web", help=help, description=__doc__.split("\n\n")[0] if __doc__ else help)
    p.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"where to serve it (default {DEFAULT_LISTEN}; port 0 picks a free one)",
    )
    p.add_argument("--nats-url", help="NATS URL (env FLEETLEASE_NATS_URL; else the context file)")
    p.add_argument("--prefix", help="NATS subject prefix (env FLEETLEASE_PREFIX)")
    p.add_argument(
        "--state-dir",
        help="where `fleetlease up` wrote context.json (env FLEETLEASE_STATE_DIR, "
        "default ~/.local/share/fleetlease)",
    )
    p.add_argument(
        "--origin",
        action="append",
        default=[],
        metavar="URL",
        help="another origin whose forms are accepted, e.g. the public URL behind a "
        "reverse proxy (repeatable)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for each reply of the control plane (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=cmd_web)


def cmd_web(args: argparse.Namespace) -> int:
    from fleetlease.ops.client import OpsError
    from fleetlease.ops.web import WebSettings
    from fleetlease.ops.web.server import parse_listen, start_console

    settings = from_args(args).with_context()
    if not settings.nats_url:
        raise CliError(
            "no NATS URL: start `fleetlease up`, or pass --nats-url / set FLEETLEASE_NATS_URL",
            EXIT_UNAVAILABLE,
        )
    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        raise CliError(f"--listen: {exc}", EXIT_USAGE) from None
    if not args.timeout > 0:
        raise CliError("--timeout must be positive", EXIT_USAGE)
    web = WebSettings(
        nats_url=settings.nats_url,
        prefix=settings.prefix,
        timeout_s=args.timeout,
        allowed_origins=tuple(args.origin),
    )

    async def main() -> None:
        try:
            running = await start_console(web, host=host, port=port, handle_signals=True)
        except OSError as exc:
            raise CliError(
                f"cannot listen on {args.listen}: {exc.strerror or exc}", EXIT_UNAVAILABLE
            ) from None
        except OpsError as exc:
            raise CliError(str(exc), EXIT_UNAVAILABLE) from None
        print(f"fleetlease web: serving the console at {running.url} (Ctrl-C stops)", flush=True)
        await running.wait()

    asyncio.run(main())
    return EXIT_OK
