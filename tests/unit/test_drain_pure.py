"""The pure parts of drain: ``HOST/DEVICE`` parsing, the projection of a host's
drain and a device's flag, and their rendering in the tables."""

from __future__ import annotations

import pytest

from fleetlease.ops import render
from fleetlease.ops.cli import CliError
from fleetlease.ops.commands.drain import split_device
from fleetlease.ops.userapi.projection import project_device, project_host


def test_host_slash_device_splits_at_the_first_slash() -> None:
    assert split_device("h1/d0") == ("h1", "d0")
    assert split_device("h1/usb/1-2") == ("h1", "usb/1-2")
    for bad in ("h1", "/d0", "h1/", ""):
        with pytest.raises(CliError):
            split_device(bad)


def test_the_projection_shows_a_drain_by_allow_list() -> None:
    drained = project_host(
        {
            "host_id": "h1",
            "drain": {"requested_at": "2030-01-01T00:00:00+00:00", "deadline": None, "x": 1},
        }
    )
    assert drained["drain"] == {"requested_at": "2030-01-01T00:00:00+00:00", "deadline": None}
    assert project_host({"host_id": "h1"})["drain"] is None
    assert project_host({"host_id": "h1", "drain": "yes"})["drain"] is None
    assert project_device({"host_id": "h1", "device_id": "d0", "drained": 1})["drained"] is True
    assert project_device({"host_id": "h1", "device_id": "d0"})["drained"] is False


def test_the_tables_show_the_drain(capsys: pytest.CaptureFixture[str]) -> None:
    render.print_hosts(
        [
            {"host_id": "h1", "live": True, "drain": {"requested_at": "x", "deadline": None}},
            {"host_id": "h2", "live": True, "drain": None},
        ]
    )
    out = capsys.readouterr().out
    assert "DRAIN" in out and "drained" in out
    render.print_devices([{"host_id": "h1", "device_id": "d0", "state": "idle", "drained": True}])
    assert "drained" in capsys.readouterr().out
