"""structlog configuration: JSON lines when not on a terminal, a console renderer
on one. Secrets are never passed to a logger; this also drops any field whose name
says it is one, as a second line of defence."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

_SECRET_KEYS = ("token", "credential", "session_key", "password", "secret", "signature")


def _drop_secrets(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in list(event):
        if any(s in key.lower() for s in _SECRET_KEYS):
            event[key] = "[redacted]"
    return event


def configure_logging(
    *, debug: bool = False, json: bool | None = None, cache: bool = False
) -> None:
    """``cache``: each module's logger is assembled once, on its first use, not
    on every call (structlog's ``cache_logger_on_first_use``). For processes that
    configure logging once and then log from a hot path (``serve``, ``agent``):
    without it every log call, even one below the level, builds a new logger
    (about 4 % of a benchmark agent's CPU). Not for code that configures logging
    again later (``up`` switches to its log file and back), nor in-process
    commands: a cached logger keeps the configuration it was first used with."""
    level = logging.DEBUG if debug else logging.INFO
    if json is None:
        json = not sys.stderr.isatty()
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _drop_secrets,
            structlog.processors.format_exc_info
            if json
            else structlog.processors.StackInfoRenderer(),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=cache,
    )
