"""``watch``'s live table: its title counts the fleet's tasks (the ``fleet_counts``
totals), not the rows it holds."""

from __future__ import annotations

from rich.console import Console

from fleetlease.ops.commands.watch import _LiveTasks


def _title(live: _LiveTasks) -> str:
    table = live.render()
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_the_title_counts_the_totals_not_the_rows_loaded() -> None:
    rows = {f"t{i}": {"id": f"t{i}", "state": "queued", "updated_at": str(i)} for i in range(2)}
    live = _LiveTasks(rows, limit=2)

    assert "queued 2" in _title(live)  # without totals: the rows held
    live.totals = {"queued": 40, "running": 3, "done": 0}

    text = _title(live)
    assert "queued 40" in text and "running 3" in text
    assert "done" not in text.splitlines()[0]
