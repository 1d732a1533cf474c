"""The devices a host agent offers: the ``DeviceManager`` contract, a simulated
manager for tests and demos, and an adb-backed manager for Android devices.

The agent sends the *complete* snapshot with every heartbeat; the control plane
replaces that host's device records with it. Managers therefore only need to
say what is attached now and notify when that changes, so the heartbeat loop can
send at once instead of waiting for its next tick.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import structlog

__all__ = [
    "ADB_CAPABILITY_FIELDS",
    "ADB_PROPERTIES",
    "DEFAULT_SIM_CAPABILITIES",
    "AdbDeviceManager",
    "ChangeCallback",
    "DeviceInfo",
    "DeviceManager",
    "DeviceState",
    "SimulatedDeviceManager",
    "UnknownDevice",
    "device_manager_from_spec",
    "parse_adb_devices",
    "parse_getprop",
]

log = structlog.get_logger(__name__)

DeviceState = Literal["idle", "busy", "offline"]
_DEVICE_STATES: frozenset[str] = frozenset({"idle", "busy", "offline"})

ChangeCallback = Callable[[], None]


@dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    device_id: str
    state: DeviceState = "idle"
    capabilities: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.device_id:
            raise ValueError("device_id must be non-empty")
        if self.state not in _DEVICE_STATES:
            raise ValueError(f"state must be one of {sorted(_DEVICE_STATES)}, got {self.state!r}")

    def to_wire(self) -> dict[str, Any]:
        return {
            "device_id": self.device_id,
            "state": self.state,
            "capabilities": dict(self.capabilities),
        }


class UnknownDevice(KeyError):
    """The device manager does not know this device."""

    def __init__(self, device_id: str) -> None:
        super().__init__(device_id)
        self.device_id = device_id

    def __str__(self) -> str:
        return f"unknown device {self.device_id!r}"


@runtime_checkable
class DeviceManager(Protocol):
    """The devices attached to this host.

    Contract:

    - ``snapshot()`` returns the complete current list, sorted by device id; it
      is cheap (no I/O) and safe to call from any thread.
    - ``refresh()`` re-reads the attached devices (may block on I/O: call it from
      an executor) and returns whether the snapshot changed.
    - ``mark_busy(device_id)`` records that the agent is running a task on the
      device; it raises ``UnknownDevice`` if the device is not known, so the
      agent never starts work on a device it cannot see. An offline device stays
      reported offline while busy.
    - ``mark_idle(device_id)`` releases it; it never raises (it is called on
      cleanup paths, possibly after the device disappeared).
    - ``on_change(callback)`` registers ``callback`` to be called, with no
      arguments, after every change of the snapshot; it returns a function that
      unregisters it. Callbacks run synchronously in the thread that made the
      change, outside any lock, so they must be quick and thread-safe (e.g.
      ``lambda: loop.call_soon_threadsafe(event.set)``). A callback that raises
      is logged and does not stop the others.
    - ``version`` increases by one with every change of the snapshot.
    """

    @property
    def version(self) -> int: ...

    def snapshot(self) -> list[DeviceInfo]: ...

    def refresh(self) -> bool: ...

    def mark_busy(self, device_id: str) -> None: ...

    def mark_idle(self, device_id: str) -> None: ...

    def on_change(self, callback: ChangeCallback) -> Callable[[], None]: ...


class _Notifier:
    """Snapshot versioning and change callbacks shared by the managers."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._version = 0
        self._callbacks: list[ChangeCallback] = []

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    def on_change(self, callback: ChangeCallback) -> Callable[[], None]:
        with self._lock:
            self._callbacks.append(callback)

        def unsubscribe() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._callbacks.remove(callback)

        return unsubscribe

    def _bump(self) -> None:
        """Call with ``self._lock`` held after a change; then ``_notify()``
        after releasing it."""
        self._version += 1

    def _notify(self) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback()
            except Exception as exc:
                log.warning("device_change_callback_failed", error_type=type(exc).__name__)


DEFAULT_SIM_CAPABILITIES: Mapping[str, str] = {"platform": "android", "model": "sim"}


class SimulatedDeviceManager(_Notifier):
    """``count`` always-present devices named ``f"{prefix}-{i}"`` (0-based),
    each with a copy of ``capabilities``. ``set_offline`` / ``set_online``
    let tests and demos make a device disappear from the usable pool."""

    def __init__(
        self,
        count: int,
        capabilities: Mapping[str, str] | None = None,
        prefix: str = "sim",
    ) -> None:
        super().__init__()
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        if not prefix:
            raise ValueError("prefix must be non-empty")
        caps = dict(capabilities) if capabilities is not None else dict(DEFAULT_SIM_CAPABILITIES)
        for key, value in caps.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError("capabilities must map str to str")
        self._capabilities = caps
        self._ids = [f"{prefix}-{i}" for i in range(count)]
        self._busy: set[str] = set()
        self._offline: set[str] = set()

    def snapshot(self) -> list[DeviceInfo]:
        with self._lock:
            return [
                DeviceInfo(
                    device_id=device_id,
                    state=self._state_of(device_id),
                    capabilities=dict(self._capabilities),
                )
                for device_id in sorted(self._ids)
            ]

    def _state_of(self, device_id: str) -> DeviceState:
        if device_id in self._offline:
            return "offline"
        if device_id in self._busy:
            return "busy"
        return "idle"

    def refresh(self) -> bool:
        return False

    def _change(self, device_id: str, apply: Callable[[], None]) -> None:
        with self._lock:
            if device_id not in self._ids:
                raise UnknownDevice(device_id)
            before = self._state_of(device_id)
            apply()
            changed = self._state_of(device_id) != before
            if changed:
                self._bump()
        if changed:
            self._notify()

    def mark_busy(self, device_id: str) -> None:
        self._change(device_id, lambda: self._busy.add(device_id))

    def mark_idle(self, device_id: str) -> None:
        with contextlib.suppress(UnknownDevice):
            self._change(device_id, lambda: self._busy.discard(device_id))

    def set_offline(self, device_id: str) -> None:
        self._change(device_id, lambda: self._offline.add(device_id))

    def set_online(self, device_id: str) -> None:
        self._change(device_id, lambda: self._offline.discard(device_id))


#: Fields of ``adb devices -l`` copied into capabilities (plus platform=android).
ADB_CAPABILITY_FIELDS: tuple[str, ...] = ("model", "product", "device", "transport_id")


def parse_adb_devices(output: str) -> list[DeviceInfo]:
    """Parse ``adb devices -l`` output into devices, ``idle`` when adb reports
    ``device`` and ``offline`` for every other state (offline, unauthorized,
    no permissions, recovery, ...): only a ``device`` can run work.

    Skips the ``List of devices attached`` header, blank lines and the daemon's
    ``* daemon ...`` notices. Sorted by serial; a repeated serial keeps the last
    line.
    """
    devices: dict[str, DeviceInfo] = {}
    for raw in output.splitlines():
        line = raw.strip()
        if not line or line.startswith("*") or line.startswith("List of devices"):
            continue
        parts = line.split()
        if len(parts) < 2:
            continue
        serial, state_word, rest = parts[0], parts[1], parts[2:]
        caps: dict[str, str] = {"platform": "android"}
        for token in rest:
            key, sep, value = token.partition(":")
            if sep and key in ADB_CAPABILITY_FIELDS and value:
                caps[key] = value
        state: DeviceState = "idle" if state_word == "device" else "offline"
        devices[serial] = DeviceInfo(device_id=serial, state=state, capabilities=caps)
    return [devices[k] for k in sorted(devices)]


#: ``getprop`` properties read once per attached device -> capability name.
ADB_PROPERTIES: Mapping[str, str] = {
    "ro.product.model": "model",
    "ro.build.version.sdk": "sdk",
    "ro.build.version.release": "android_version",
    "ro.product.cpu.abi": "abi",
}
_GETPROP_LINE = re.compile(r"^\[([^\]]+)\]: \[(.*)\]$")


def parse_getprop(output: str) -> dict[str, str]:
    """Capabilities from ``adb shell getprop`` output (``[name]: [value]`` lines)."""
    caps: dict[str, str] = {}
    for raw in output.splitlines():
        m = _GETPROP_LINE.match(raw.strip())
        if m is not None and m.group(1) in ADB_PROPERTIES and m.group(2):
            caps[ADB_PROPERTIES[m.group(1)]] = m.group(2)[:128]
    return caps


class AdbDeviceManager(_Notifier):
    """Android devices seen by ``adb devices -l``.

    ``refresh()`` runs adb through ``runner`` (``subprocess.run`` by default;
    tests inject a fake). When adb cannot be run or fails, every device known so
    far is reported offline: no work should be sent to a device the agent cannot
    reach. The busy flag belongs to the agent, not to adb, so it survives
    refreshes until ``mark_idle``.
    """

    def __init__(
        self,
        adb_path: str = "adb",
        runner: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
        timeout_s: float = 10.0,
    ) -> None:
        super().__init__()
        if not adb_path:
            raise ValueError("adb_path must be non-empty")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self._adb_path = adb_path
        self._runner = runner
        self._timeout_s = timeout_s
        self._seen: list[DeviceInfo] = []
        self._busy: set[str] = set()
        #: Serial -> capabilities read with getprop (once while it stays attached).
        self._props: dict[str, dict[str, str]] = {}

    def _properties(self, serial: str) -> dict[str, str]:
        """One ``adb -s SERIAL shell getprop`` per newly attached device."""
        known = self._props.get(serial)
        if known is not None:
            return known
        try:
            proc = self._runner(
                [self._adb_path, "-s", serial, "shell", "getprop"],
                capture_output=True, text=True, timeout=self._timeout_s, check=False,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("adb_getprop_failed", serial=serial, error=str(exc))
            return {}
        if proc.returncode != 0:
            return {}
        caps = parse_getprop(proc.stdout or "")
        self._props[serial] = caps
        return caps

    def _with_properties(self, listed: list[DeviceInfo]) -> list[DeviceInfo]:
        present = {d.device_id for d in listed}
        for gone in set(self._props) - present:
            del self._props[gone]
        out: list[DeviceInfo] = []
        for d in listed:
            if d.state != "idle":
                out.append(d)
                continue
            caps = {**d.capabilities, **self._properties(d.device_id)}
            out.append(DeviceInfo(device_id=d.device_id, state=d.state, capabilities=caps))
        return out

    def _compose(self, seen: Iterable[DeviceInfo], busy: set[str]) -> list[DeviceInfo]:
        return [
            DeviceInfo(device_id=d.device_id, state="busy", capabilities=d.capabilities)
            if d.state == "idle" and d.device_id in busy
            else d
            for d in seen
        ]

    def snapshot(self) -> list[DeviceInfo]:
        with self._lock:
            return self._compose(self._seen, self._busy)

    def _list(self) -> list[DeviceInfo] | None:
        args: Sequence[str] = [self._adb_path, "devices", "-l"]
        try:
            proc = self._runner(
                args, capture_output=True, text=True, timeout=self._timeout_s, check=False
            )
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("adb_devices_failed", adb=self._adb_path, error=str(exc))
            return None
        if proc.returncode != 0:
            log.warning(
                "adb_devices_failed",
                adb=self._adb_path,
                returncode=proc.returncode,
                error=(proc.stderr or "").strip()[:500],
            )
            return None
        return parse_adb_devices(proc.stdout or "")

    def refresh(self) -> bool:
        listed = self._list()
        if listed is not None:
            listed = self._with_properties(listed)
        with self._lock:
            if listed is None:
                listed = [
                    DeviceInfo(device_id=d.device_id, state="offline", capabilities=d.capabilities)
                    for d in self._seen
                ]
            before = self._compose(self._seen, self._busy)
            self._seen = listed
            changed = self._compose(self._seen, self._busy) != before
            if changed:
                self._bump()
        if changed:
            self._notify()
        return changed

    def mark_busy(self, device_id: str) -> None:
        self._set_busy(device_id, busy=True)

    def mark_idle(self, device_id: str) -> None:
        self._set_busy(device_id, busy=False)

    def _set_busy(self, device_id: str, *, busy: bool) -> None:
        with self._lock:
            if busy and all(d.device_id != device_id for d in self._seen):
                raise UnknownDevice(device_id)
            before = self._compose(self._seen, self._busy)
            if busy:
                self._busy.add(device_id)
            else:
                self._busy.discard(device_id)
            changed = self._compose(self._seen, self._busy) != before
            if changed:
                self._bump()
        if changed:
            self._notify()


def device_manager_from_spec(
    spec: str,
    *,
    which: Callable[[str], str | None] = shutil.which,
) -> DeviceManager:
    """Build a device manager from a command-line spec.

    ``"simulated:N"`` gives N simulated devices; ``"adb"`` uses the ``adb`` on
    PATH and ``"adb:/path/to/adb"`` an explicit binary. Raises ``ValueError``
    naming the problem otherwise, including when adb cannot be found.
    """
    text = spec.strip()
    kind, sep, arg = text.partition(":")
    if kind == "simulated":
        if not sep or not arg.strip():
            raise ValueError(f"device spec {spec!r}: expected 'simulated:N' with N >= 0")
        try:
            count = int(arg.strip())
        except ValueError:
            raise ValueError(
                f"device spec {spec!r}: N in 'simulated:N' must be an integer, got {arg!r}"
            ) from None
        if count < 0:
            raise ValueError(f"device spec {spec!r}: N in 'simulated:N' must be >= 0")
        return SimulatedDeviceManager(count)
    if kind == "adb":
        wanted = arg.strip() if sep else "adb"
        if not wanted:
            raise ValueError(f"device spec {spec!r}: expected 'adb' or 'adb:/path/to/adb'")
        found = which(wanted)
        if found is None:
            raise ValueError(
                f"device spec {spec!r}: adb executable {wanted!r} not found on PATH "
                "(install Android platform-tools or use 'simulated:N')"
            )
        return AdbDeviceManager(adb_path=found)
    raise ValueError(f"unknown device spec {spec!r}: expected 'simulated:N' or 'adb'")
