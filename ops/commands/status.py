"""``fleetlease status``: the readiness of a running control plane, and the
``--metrics`` flag of ``serve``, ``up`` and ``agent``.

``status`` asks the ``/readyz`` endpoint of a ``serve`` (or ``up``): the URL is
``--metrics-url`` > ``FLEETLEASE_METRICS_URL`` > the context file of the state
dir (written by ``up``) > ``http://127.0.0.1:9464``. It prints every check and
exits 0 when ready, 6 when not ready or when nothing answers.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from typing import Any

from fleetlease.ops.cli import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, CliError
from fleetlease.ops.config import from_args as settings_from_args
from fleetlease.ops.config import read_context
from fleetlease.ops.observe.http import DEFAULT_ADDRESS, MetricsAddressError, parse_address

ENV_METRICS_URL = "FLEETLEASE_METRICS_URL"
STATUS_TIMEOUT_S = 10.0
STATUS_HELP = f"""Ask a running control plane (serve or up) whether it is ready: its /readyz
checks PostgreSQL, the schema's migrations, NATS and the actors. One line per
check (--json: the report). Exit 0 when ready, 6 when not ready or when nothing
answers.

The listener: --metrics-url, else {ENV_METRICS_URL}, else the context file of
the state dir (written by up), else http://{DEFAULT_ADDRESS}.
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="is the control plane ready? (its /readyz: database, migrations, NATS, actors)",
        description=STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--metrics-url",
        help=f"the serve's metrics listener (env {ENV_METRICS_URL}; default: the context "
        f"file's, else http://{DEFAULT_ADDRESS})",
    )
    p.add_argument(
        "--state-dir",
        help="state directory (env FLEETLEASE_STATE_DIR, default ~/.local/share/fleetlease)",
    )
    p.add_argument("--json", action="store_true", help="print the readiness report as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=cmd_status)


def add_metrics_flag(p: argparse.ArgumentParser, *, default_on: bool) -> None:
    if default_on:
        text = (
            f"serve /metrics, /healthz and /readyz on HOST:PORT (default {DEFAULT_ADDRESS}, "
            "skipped with a warning when taken; 'off' for none)"
        )
    else:
        text = "serve /metrics, /healthz and /readyz on HOST:PORT (default: off)"
    p.add_argument("--metrics", default=None, metavar="HOST:PORT", help=text)


def metrics_from_args(args: argparse.Namespace, *, default_on: bool) -> tuple[str | None, bool]:
    """The listener's address (None: none) and whether a bind failure is only a
    warning (the default address: another process may hold it)."""
    value = getattr(args, "metrics", None)
    if value is None:
        return (DEFAULT_ADDRESS, True) if default_on else (None, False)
    if value.strip().lower() == "off":
        return None, False
    try:
        parse_address(value)
    except MetricsAddressError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    return value.strip(), False


def status_url(args: argparse.Namespace) -> str:
    url = getattr(args, "metrics_url", None) or os.environ.get(ENV_METRICS_URL)
    if not url:
        ctx = read_context(settings_from_args(args).state_dir)
        url = ctx.get("metrics_url") if isinstance(ctx.get("metrics_url"), str) else None
    url = (url or f"http://{DEFAULT_ADDRESS}").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise CliError(f"--metrics-url must be an http(s) URL, got {url!r}", EXIT_USAGE)
    return url


def fetch_readiness(url: str, timeout_s: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
    """The ``/readyz`` report at ``url`` (a 503 carries a report too);
    ``CliError`` (unavailable) when nothing usable answers."""
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
        if exc.code != 503:
            raise CliError(f"{url}/readyz answered {exc.code}", EXIT_UNAVAILABLE) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise CliError(f"cannot reach {url}: {reason}", EXIT_UNAVAILABLE) from None
    try:
        report = json.loads(body)
    except ValueError:
        raise CliError(
            f"{url}/readyz answered something else than JSON", EXIT_UNAVAILABLE
        ) from None
    if not isinstance(report, dict) or not isinstance(report.get("checks"), dict):
        raise CliError(f"{url}/readyz answered an unknown report", EXIT_UNAVAILABLE)
    return report


def cmd_status(args: argparse.Namespace) -> int:
    url = status_url(args)
    report = fetch_readiness(url)
    ready = bool(report.get("ready"))
    if args.json:
        print(json.dumps({**report, "url": url}, indent=2, sort_keys=True))
    else:
        print(f"{'ready' if ready else 'NOT READY'} ({url})")
        for name, check in sorted(report["checks"].items()):
            ok = isinstance(check, dict) and check.get("ok")
            detail = check.get("detail", "") if isinstance(check, dict) else ""
            print(f"  {name:<11} {'ok' if ok else 'FAIL':<5} {detail}")
    return EXIT_OK if ready else EXIT_UNAVAILABLE
