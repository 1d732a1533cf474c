"""structlog configuration: JSON lines when not on a terminal, a console renderer
on one. Secrets are never passed to a logger; this also drops any field whose name
says it is one, as a second line of defence.

A log file (``up``'s ``up.log``) is rotated by size (``logging.handlers.
RotatingFileHandler``): at most ``LOG_FILE_MAX_BYTES`` per file and
``LOG_FILE_BACKUPS`` older files beside it (``up.log.1`` ... ``up.log.4``), so
the log of a control plane, whatever its clients send, takes at most 320 MiB."""

from __future__ import annotations

import logging
import logging.handlers
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import structlog

#: Size at which a log file is rotated (64 MiB).
LOG_FILE_MAX_BYTES = 64 * 1024 * 1024
#: Rotated files kept beside the current one.
LOG_FILE_BACKUPS = 4

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


class RotatingFileLogger:
    """A structlog logger that writes each rendered line through a
    ``RotatingFileHandler`` (which rotates the file by size, under its lock)."""

    def __init__(self, handler: logging.Handler) -> None:
        self._handler = handler

    def msg(self, message: str) -> None:
        record = logging.makeLogRecord(
            {"msg": message, "levelno": logging.INFO, "levelname": "INFO"}
        )
        self._handler.handle(record)

    log = debug = info = warn = warning = error = critical = fatal = exception = msg


def configure_file_logging(
    path: Path,
    *,
    debug: bool = False,
    max_bytes: int = LOG_FILE_MAX_BYTES,
    backups: int = LOG_FILE_BACKUPS,
) -> logging.handlers.RotatingFileHandler:
    """Log JSON lines to ``path``, rotated at ``max_bytes`` with ``backups``
    older files kept. Returns the handler: close it after switching logging
    elsewhere (``configure_logging``)."""
    handler = logging.handlers.RotatingFileHandler(
        path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8"
    )
    logger = RotatingFileLogger(handler)
    configure_logging(debug=debug, json=True)
    structlog.configure(logger_factory=lambda *_: logger)
    return handler
