"""The console's Jinja2 templates and the filters and globals they use: times,
spans, sizes and JSON as the pages show them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from starlette.templating import Jinja2Templates

from fleetlease.persistence.model import TaskState

HERE = Path(__file__).parent
TASK_STATES = tuple(s.value for s in TaskState)
TERMINAL_STATES = frozenset(s.value for s in TaskState if s.is_terminal)


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def fmt_when(value: Any) -> str:
    """``2026-12-02 12:09:40`` (UTC, as the API gives it), or an em dash."""
    at = _parse_time(value)
    if at is None:
        return "—"
    return at.strftime("%Y-%m-%d %H:%M:%S")


def fmt_time(value: Any) -> str:
    at = _parse_time(value)
    return "—" if at is None else at.strftime("%H:%M:%S")


def fmt_span(start: Any, end: Any) -> str:
    a, b = _parse_time(start), _parse_time(end)
    if a is None or b is None:
        return ""
    seconds = max(0.0, (b - a).total_seconds())
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def fmt_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


def what(task: Mapping[str, Any]) -> str:
    if task.get("goal"):
        return str(task["goal"])
    if task.get("workflow"):
        return f"workflow {task['workflow']}"
    return "—"


def fmt_size(value: Any) -> str:
    if not isinstance(value, int):
        return "—"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{value} B"


def templates() -> Jinja2Templates:
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    env = templates.env
    env.autoescape = True
    env.filters.update(
        when=fmt_when,
        time=fmt_time,
        pretty=fmt_json,
        size=fmt_size,
        urlpart=lambda v: quote(str(v), safe=""),
    )
    env.globals.update(span=fmt_span, what=what, TERMINAL=TERMINAL_STATES, STATES=TASK_STATES)
    return templates
