"""Rules of the source that a test can hold, read from the tree itself."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "transport", "persistence", "hostagent", "ops")


def test_no_module_hands_a_pipe_to_the_loops_pipe_transports() -> None:
    """Under uvloop, ``connect_read_pipe``/``connect_write_pipe`` close the file
    object's descriptor twice (libuv's close, then the file object's), closing
    whatever another thread opened with that number in between. Pipes are read
    with ``loop.add_reader`` instead (``hostagent/runners/process.py``)."""
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and node.attr in (
                    "connect_read_pipe",
                    "connect_write_pipe",
                ):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []
