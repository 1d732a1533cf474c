from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import Any

import pytest
from structlog.testing import capture_logs

from fleetlease.hostagent.devices import (
    AdbDeviceManager,
    DeviceInfo,
    DeviceManager,
    SimulatedDeviceManager,
    UnknownDevice,
    device_manager_from_spec,
    parse_adb_devices,
)

ADB_OUTPUT = """\
* daemon not running; starting now at tcp:5037
* daemon started successfully
List of devices attached
emulator-5554          device product:sdk_gphone64_x86_64 model:sdk_gphone64_x86_64 device:emu64xa transport_id:1

R58M12ABCDE            unauthorized usb:1-1 transport_id:2
0123456789ABCDEF       offline transport_id:3
192.168.1.20:5555      device product:panther model:Pixel_7 device:panther transport_id:4
5A3C000123             no permissions (missing udev rules? user is in the plugdev group); see [http://developer.android.com/tools/device.html] usb:1-2 transport_id:5

"""  # noqa: E501  (real adb lines are long)


class FakeAdb:
    """Stands in for subprocess.run; returns queued outputs in order."""

    def __init__(self, *outputs: str | BaseException | tuple[int, str]) -> None:
        self.outputs = list(outputs)
        self.calls: list[Sequence[str]] = []

    def __call__(self, args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(args)
        assert kwargs["capture_output"] is True and kwargs["text"] is True
        out = self.outputs.pop(0) if len(self.outputs) > 1 else self.outputs[0]
        if isinstance(out, BaseException):
            raise out
        if isinstance(out, tuple):
            code, err = out
            return subprocess.CompletedProcess(args, code, stdout="", stderr=err)
        return subprocess.CompletedProcess(args, 0, stdout=out, stderr="")


def states(manager: DeviceManager) -> dict[str, str]:
    return {d.device_id: d.state for d in manager.snapshot()}


# -- simulated ------------------------------------------------------------------


def test_simulated_manager_offers_count_idle_devices_with_default_capabilities() -> None:
    manager = SimulatedDeviceManager(3)

    assert manager.snapshot() == [
        DeviceInfo(device_id=f"sim-{i}", capabilities={"platform": "android", "model": "sim"})
        for i in range(3)
    ]


def test_simulated_manager_prefix_and_capabilities_are_configurable() -> None:
    manager = SimulatedDeviceManager(2, capabilities={"platform": "ios"}, prefix="hostA")

    snap = manager.snapshot()

    assert [d.device_id for d in snap] == ["hostA-0", "hostA-1"]
    assert all(d.capabilities == {"platform": "ios"} for d in snap)


def test_simulated_manager_with_no_devices_has_an_empty_snapshot() -> None:
    assert SimulatedDeviceManager(0).snapshot() == []


def test_mark_busy_and_idle_change_the_snapshot_and_notify() -> None:
    manager = SimulatedDeviceManager(2)
    calls: list[int] = []
    manager.on_change(lambda: calls.append(manager.version))

    manager.mark_busy("sim-1")
    assert states(manager) == {"sim-0": "idle", "sim-1": "busy"}
    manager.mark_idle("sim-1")

    assert states(manager) == {"sim-0": "idle", "sim-1": "idle"}
    assert calls == [1, 2]


def test_repeating_a_mark_is_not_a_change() -> None:
    manager = SimulatedDeviceManager(1)
    calls: list[None] = []
    manager.on_change(lambda: calls.append(None))

    manager.mark_busy("sim-0")
    manager.mark_busy("sim-0")
    manager.mark_idle("sim-0")
    manager.mark_idle("sim-0")

    assert len(calls) == 2
    assert manager.version == 2


def test_unsubscribed_callback_is_not_called() -> None:
    manager = SimulatedDeviceManager(1)
    calls: list[None] = []
    unsubscribe = manager.on_change(lambda: calls.append(None))

    unsubscribe()
    unsubscribe()
    manager.mark_busy("sim-0")

    assert calls == []


def test_a_failing_callback_is_logged_and_others_still_run() -> None:
    manager = SimulatedDeviceManager(1)
    calls: list[None] = []

    def broken() -> None:
        raise RuntimeError("boom")

    manager.on_change(broken)
    manager.on_change(lambda: calls.append(None))

    with capture_logs() as logs:
        manager.mark_busy("sim-0")

    assert calls == [None]
    assert [e["event"] for e in logs] == ["device_change_callback_failed"]


def test_mark_busy_of_an_unknown_device_raises_but_mark_idle_does_not() -> None:
    manager = SimulatedDeviceManager(1)

    with pytest.raises(UnknownDevice):
        manager.mark_busy("sim-7")
    manager.mark_idle("sim-7")

    assert manager.version == 0


def test_an_offline_simulated_device_is_reported_offline_even_when_busy() -> None:
    manager = SimulatedDeviceManager(1)
    manager.mark_busy("sim-0")

    manager.set_offline("sim-0")
    assert states(manager) == {"sim-0": "offline"}
    manager.set_online("sim-0")

    assert states(manager) == {"sim-0": "busy"}


def test_snapshot_is_a_copy() -> None:
    manager = SimulatedDeviceManager(1)

    manager.snapshot()[0].capabilities["model"] = "changed"

    assert manager.snapshot()[0].capabilities["model"] == "sim"


def test_simulated_manager_satisfies_the_protocol() -> None:
    assert isinstance(SimulatedDeviceManager(1), DeviceManager)
    assert SimulatedDeviceManager(1).refresh() is False


@pytest.mark.parametrize("count", [-1, True, 1.5])
def test_simulated_manager_rejects_a_bad_count(count: Any) -> None:
    with pytest.raises(ValueError, match="count"):
        SimulatedDeviceManager(count)


def test_device_info_rejects_an_unknown_state() -> None:
    with pytest.raises(ValueError, match="state"):
        DeviceInfo(device_id="x", state="gone")  # type: ignore[arg-type]


def test_device_info_to_wire() -> None:
    info = DeviceInfo(device_id="d", state="busy", capabilities={"a": "b"})

    assert info.to_wire() == {"device_id": "d", "state": "busy", "capabilities": {"a": "b"}}


# -- adb parsing ------------------------------------------------------------------


def test_parse_adb_devices_reads_states_and_capabilities() -> None:
    devices = {d.device_id: d for d in parse_adb_devices(ADB_OUTPUT)}

    assert {k: d.state for k, d in devices.items()} == {
        "0123456789ABCDEF": "offline",
        "192.168.1.20:5555": "idle",
        "5A3C000123": "offline",
        "R58M12ABCDE": "offline",
        "emulator-5554": "idle",
    }
    assert devices["emulator-5554"].capabilities == {
        "platform": "android",
        "product": "sdk_gphone64_x86_64",
        "model": "sdk_gphone64_x86_64",
        "device": "emu64xa",
        "transport_id": "1",
    }
    assert devices["R58M12ABCDE"].capabilities == {"platform": "android", "transport_id": "2"}
    assert devices["5A3C000123"].capabilities == {"platform": "android", "transport_id": "5"}


def test_parse_adb_devices_is_sorted_by_serial() -> None:
    ids = [d.device_id for d in parse_adb_devices(ADB_OUTPUT)]

    assert ids == sorted(ids)


def test_parse_adb_devices_with_nothing_attached_is_empty() -> None:
    assert parse_adb_devices("List of devices attached\n\n") == []
    assert parse_adb_devices("") == []


# -- adb manager ------------------------------------------------------------------


def test_adb_manager_snapshot_is_empty_until_refreshed() -> None:
    fake = FakeAdb(ADB_OUTPUT)
    manager = AdbDeviceManager(adb_path="/opt/adb", runner=fake)

    assert manager.snapshot() == []
    assert manager.refresh() is True

    # The list, then one getprop per device ready for work.
    assert fake.calls == [
        ["/opt/adb", "devices", "-l"],
        ["/opt/adb", "-s", "192.168.1.20:5555", "shell", "getprop"],
        ["/opt/adb", "-s", "emulator-5554", "shell", "getprop"],
    ]
    assert len(manager.snapshot()) == 5


def test_adb_refresh_with_the_same_output_is_not_a_change() -> None:
    manager = AdbDeviceManager(runner=FakeAdb(ADB_OUTPUT))
    calls: list[None] = []
    manager.on_change(lambda: calls.append(None))

    assert manager.refresh() is True
    assert manager.refresh() is False

    assert calls == [None]
    assert manager.version == 1


def test_adb_busy_device_stays_busy_across_refreshes_until_marked_idle() -> None:
    manager = AdbDeviceManager(runner=FakeAdb(ADB_OUTPUT))
    manager.refresh()

    manager.mark_busy("emulator-5554")
    manager.refresh()
    assert states(manager)["emulator-5554"] == "busy"
    manager.mark_idle("emulator-5554")

    assert states(manager)["emulator-5554"] == "idle"


def test_adb_offline_device_is_offline_even_when_busy() -> None:
    manager = AdbDeviceManager(runner=FakeAdb(ADB_OUTPUT))
    manager.refresh()

    manager.mark_busy("0123456789ABCDEF")

    assert states(manager)["0123456789ABCDEF"] == "offline"


def test_adb_device_that_disappears_leaves_the_snapshot() -> None:
    later = "List of devices attached\nemulator-5554\tdevice transport_id:1\n"
    manager = AdbDeviceManager(runner=FakeAdb(ADB_OUTPUT, later))
    manager.refresh()

    assert manager.refresh() is True

    assert states(manager) == {"emulator-5554": "idle"}


def test_adb_mark_busy_of_an_unseen_device_raises() -> None:
    manager = AdbDeviceManager(runner=FakeAdb(ADB_OUTPUT))
    manager.refresh()

    with pytest.raises(UnknownDevice):
        manager.mark_busy("not-attached")
    manager.mark_idle("not-attached")


@pytest.mark.parametrize(
    "failure",
    [
        FileNotFoundError(2, "No such file or directory", "adb"),
        subprocess.TimeoutExpired(["adb"], 10.0),
        (1, "error: cannot connect to daemon"),
    ],
)
def test_when_adb_fails_every_known_device_is_reported_offline(failure: Any) -> None:
    manager = AdbDeviceManager(runner=FakeAdb(ADB_OUTPUT, failure))
    manager.refresh()

    with capture_logs() as logs:
        assert manager.refresh() is True

    assert set(states(manager).values()) == {"offline"}
    assert len(manager.snapshot()) == 5
    assert [e["event"] for e in logs] == ["adb_devices_failed"]


def test_adb_manager_satisfies_the_protocol() -> None:
    assert isinstance(AdbDeviceManager(runner=FakeAdb("")), DeviceManager)


# -- spec ---------------------------------------------------------------------------


def test_spec_simulated_n() -> None:
    manager = device_manager_from_spec("simulated:4")

    assert isinstance(manager, SimulatedDeviceManager)
    assert len(manager.snapshot()) == 4


def test_spec_adb_uses_the_binary_found_on_path() -> None:
    manager = device_manager_from_spec("adb", which=lambda name: f"/usr/bin/{name}")

    assert isinstance(manager, AdbDeviceManager)


def test_spec_adb_without_adb_on_path_says_so() -> None:
    with pytest.raises(ValueError, match="not found on PATH"):
        device_manager_from_spec("adb", which=lambda name: None)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("simulated", "simulated:N"),
        ("simulated:", "simulated:N"),
        ("simulated:x", "must be an integer"),
        ("simulated:-2", ">= 0"),
        ("usb", "unknown device spec"),
        ("", "unknown device spec"),
    ],
)
def test_bad_specs_are_rejected_with_a_clear_message(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        device_manager_from_spec(spec)
