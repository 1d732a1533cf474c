"""``python -m hostagent ARGS`` is ``fleetlease agent ARGS``."""

from __future__ import annotations

import sys

from fleetlease.ops.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["agent", *sys.argv[1:]]))
