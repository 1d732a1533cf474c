"""The ``fleetlease`` subcommands, one module per group, each exposing
``register(subparsers)`` (``ops/cli.py`` lists them in ``COMMAND_MODULES``):
``system`` (migrate, up, serve), ``agent``, the user-API commands ``tasks``,
``fleet``, ``admin`` and ``watch`` (sharing ``shared``; the bulk cancel in
``bulk``), ``bench``, ``web`` and ``soak``."""
