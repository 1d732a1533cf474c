"""The event loop of the long-running processes (``serve``, ``agent``, ``up``).

uvloop (libuv, from the authors of asyncpg) when it is installed, the standard
asyncio loop otherwise or when ``FLEETLEASE_EVENT_LOOP=asyncio``. Every host
message is a few turns of the loop (its NATS read, the handler's task, the
commit's wake-up, the reply's flush); with spread-out traffic each turn is paid
on its own, so the loop's own machinery is a visible share of the control
plane's CPU (``docs/performance.md``). The code does not
depend on which loop runs it: tests run on asyncio's, the processes they
start on this one.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

ENV = "FLEETLEASE_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")


class EventLoopError(RuntimeError):
    """``FLEETLEASE_EVENT_LOOP`` names an unknown or unavailable loop."""


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop to create (None: asyncio's default)."""
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise EventLoopError(f"{ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise EventLoopError(f"{ENV}=uvloop but uvloop is not installed") from None
        return None
    return uvloop.new_event_loop


def checked_factory(usage_error: Callable[[str], Exception]) -> None:
    """Raise ``usage_error(message)`` if the environment names no usable loop
    (commands call it before starting anything)."""
    try:
        loop_factory()
    except EventLoopError as exc:
        raise usage_error(str(exc)) from None


def loop_name() -> str:
    return "asyncio" if loop_factory() is None else "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the chosen loop."""
    try:
        factory = loop_factory()
    except BaseException:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
