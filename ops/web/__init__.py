"""The web console (``fleetlease web``, also started by ``fleetlease up``): the
fleet, the tasks and their histories in a browser, over the same user API and
safe projection as the CLI. ``app.py`` holds the routes, ``sessions.py`` the
sign-in sessions and CSRF checks, ``server.py`` runs it under uvicorn."""
