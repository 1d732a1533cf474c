"""Device sources with real executables: a ``command:`` lister, a stand-in ``adb``
on PATH printing what real adb prints, several sources combined."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from fleetlease.hostagent.devices import AdbDeviceManager, UnknownDevice
from fleetlease.hostagent.execution import device_environment
from fleetlease.hostagent.sources import (
    CombinedDeviceManager,
    CommandDeviceManager,
    device_manager_from_specs,
    parse_device_list,
)


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body).lstrip())
    path.chmod(0o755)
    return path


def test_a_command_source_is_rerun_on_each_refresh(tmp_path: Path) -> None:
    listing = tmp_path / "devices.json"
    listing.write_text('[{"id": "rig-1", "capabilities": {"platform": "ios"}}]')
    lister = script(tmp_path / "list", f'cat "{listing}"\n')
    manager = device_manager_from_specs([f"command:{lister}"])
    assert isinstance(manager, CommandDeviceManager)

    assert manager.refresh() is True
    [rig] = manager.snapshot()
    assert (rig.device_id, rig.state, rig.capabilities) == ("rig-1", "idle", {"platform": "ios"})
    manager.mark_busy("rig-1")
    listing.write_text('[{"id": "rig-1", "state": "idle"}, {"id": "rig-2", "state": "offline"}]')
    assert manager.refresh() is True
    assert [(d.device_id, d.state) for d in manager.snapshot()] == [
        ("rig-1", "busy"),
        ("rig-2", "offline"),
    ]
    # Output that is not a device list: everything known goes offline.
    listing.write_text("{not json")
    assert manager.refresh() is True
    assert {d.state for d in manager.snapshot()} == {"offline"}


def test_a_device_list_is_checked() -> None:
    for bad in ("{}", '[{"state": "idle"}]', '[{"id": "a", "state": "busy"}]',
                '[{"id": "a", "capabilities": {"x": 1}}]', "nope"):  # fmt: skip
        with pytest.raises(ValueError):
            parse_device_list(bad)


ADB_DEVICES = """\
List of devices attached
emulator-5554          device product:sdk_gphone64_x86_64 model:sdk_gphone64_x86_64 device:emu64xa transport_id:1
R58M12ABCDE            unauthorized usb:1-1 transport_id:2

"""  # noqa: E501

GETPROP = """\
[dalvik.vm.heapsize]: [512m]
[ro.build.version.release]: [14]
[ro.build.version.sdk]: [34]
[ro.product.cpu.abi]: [x86_64]
[ro.product.model]: [sdk_gphone64_x86_64]
"""


def test_adb_devices_get_model_sdk_and_abi_from_getprop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "devices.txt").write_text(ADB_DEVICES)
    (tmp_path / "getprop.txt").write_text(GETPROP)
    calls = tmp_path / "calls"
    script(bindir / "adb", f"""
        echo "$*" >> "{calls}"
        case "$*" in
          "devices -l") cat "{tmp_path}/devices.txt" ;;
          "-s emulator-5554 shell getprop") cat "{tmp_path}/getprop.txt" ;;
          *) echo "error: device not found" >&2; exit 1 ;;
        esac
    """)  # fmt: skip
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    manager = device_manager_from_specs(["adb"])
    assert isinstance(manager, AdbDeviceManager)

    manager.refresh()
    manager.refresh()
    devices = {d.device_id: d for d in manager.snapshot()}

    assert devices["emulator-5554"].capabilities == {
        "platform": "android",
        "product": "sdk_gphone64_x86_64",
        "model": "sdk_gphone64_x86_64",
        "device": "emu64xa",
        "transport_id": "1",
        "sdk": "34",
        "android_version": "14",
        "abi": "x86_64",
    }
    assert devices["R58M12ABCDE"].state == "offline"
    # getprop once per attached device, not on every refresh.
    assert calls.read_text().splitlines().count("-s emulator-5554 shell getprop") == 1
    env = device_environment(manager.snapshot)
    assert env("emulator-5554") == {
        "FLEETLEASE_DEVICE_SERIAL": "emulator-5554",
        "ANDROID_SERIAL": "emulator-5554",
    }


def test_sources_combine_and_route_busy_to_their_owner(tmp_path: Path) -> None:
    lister = script(tmp_path / "list", """echo '[{"id": "rig-1"}]'\n""")
    manager = device_manager_from_specs(["local:2", f"simulated:1,command:{lister}"])
    assert isinstance(manager, CombinedDeviceManager)
    manager.refresh()

    snap = {d.device_id: d for d in manager.snapshot()}
    assert sorted(snap) == ["local-0", "local-1", "rig-1", "sim-0"]
    assert snap["local-0"].capabilities == {"platform": "local"}
    changes: list[None] = []
    manager.on_change(lambda: changes.append(None))
    manager.mark_busy("rig-1")
    manager.mark_busy("local-1")
    assert {d.device_id for d in manager.snapshot() if d.state == "busy"} == {"rig-1", "local-1"}
    assert len(changes) == 2
    with pytest.raises(UnknownDevice):
        manager.mark_busy("nope")
    assert device_environment(manager.snapshot)("local-0") == {
        "FLEETLEASE_DEVICE_SERIAL": "local-0"
    }


def test_bad_specs_are_refused() -> None:
    for bad in ("local:0", "local:x", "command:", "nosuchsource:1", ""):
        with pytest.raises(ValueError):
            device_manager_from_specs([bad])


def test_a_third_party_source_comes_from_the_entry_point_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real installed distribution, as pip leaves one: a module and its
    # dist-info with an entry point of the group fleetlease.devices.
    (tmp_path / "labrig.py").write_text(
        "from fleetlease.hostagent.devices import SimulatedDeviceManager\n"
        "def source(arg):\n"
        "    return SimulatedDeviceManager(int(arg), {'platform': 'rig'}, prefix='rig')\n"
    )
    info = tmp_path / "labrig-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: labrig\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[fleetlease.devices]\nlabrig = labrig:source\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    manager = device_manager_from_specs(["labrig:3,local:1"])

    ids = [(d.device_id, d.capabilities["platform"]) for d in manager.snapshot()]
    assert ids == [("local-0", "local"), ("rig-0", "rig"), ("rig-1", "rig"), ("rig-2", "rig")]


def test_up_devices_takes_a_count_or_sources() -> None:
    from fleetlease.ops.cli import CliError
    from fleetlease.ops.commands.system import up_devices

    assert up_devices("4") == (None, 4)
    assert up_devices("local:2") == ("local:2", 2)
    assert up_devices("local:2,command:/opt/list") == ("local:2,command:/opt/list", 2)
    assert up_devices("adb") == ("adb", 1)
    with pytest.raises(CliError):
        up_devices("-1")
