"""The web console (``fleetlease web``, also started by ``fleetlease up``): the
fleet, the tasks and their histories in a browser, over the same user API and
safe projection as the CLI. ``app.py`` assembles the console from its page
routes; ``sessions.py`` holds the sign-in sessions and CSRF checks,
``server.py`` runs it under uvicorn."""

from fleetlease.ops.web.app import create_app
from fleetlease.ops.web.console import Console, WebSettings
from fleetlease.ops.web.headers import SECURITY_HEADERS

__all__ = ["SECURITY_HEADERS", "Console", "WebSettings", "create_app"]
