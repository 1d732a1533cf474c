"""Device sources: where a host agent's devices come from, chosen with
``fleetlease agent --devices SPEC`` (repeatable, or comma-separated).

=====================  ===============================================================
``simulated:N``        N simulated devices (``sim-0`` ...), platform=android, model=sim
``local:N``            N slots on the host itself (``local-0`` ...), platform=local
``adb`` / ``adb:PATH`` the Android devices ``adb devices -l`` lists (platform=android)
``command:PATH``       an executable printing a JSON list of devices, re-run on every
                       refresh: ``[{"id": "x", "state": "idle", "capabilities": {...}}]``
                       (``state`` idle or offline, default idle)
``NAME`` / ``NAME:ARG`` a third-party source: the entry point ``NAME`` of the group
                       ``fleetlease.devices``, called with ``ARG`` (a string, "" when
                       absent), returning a ``DeviceManager``
=====================  ===============================================================

Several sources make one set of devices (``--devices local:2 --devices
command:/opt/lab/list``, or ``--devices local:2,command:/opt/lab/list``); a
device id two sources report is kept from the first and logged
(``device_id_duplicated``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import entry_points
from typing import Any

import structlog

from fleetlease.hostagent.devices import (
    DeviceInfo,
    DeviceManager,
    DeviceState,
    SimulatedDeviceManager,
    UnknownDevice,
    _Notifier,
    device_manager_from_spec,
)

__all__ = [
    "DEVICE_SOURCE_GROUP",
    "CombinedDeviceManager",
    "CommandDeviceManager",
    "device_manager_from_specs",
    "parse_device_list",
]

log = structlog.get_logger(__name__)

DEVICE_SOURCE_GROUP = "fleetlease.devices"
MAX_LISTED_DEVICES = 1000


def parse_device_list(text: str) -> list[DeviceInfo]:
    """The devices of a ``command:`` source's output; ``ValueError`` naming the
    problem when it is not a JSON list of ``{"id", "state"?, "capabilities"?}``."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, list):
        raise ValueError("expected a JSON list of devices")
    if len(data) > MAX_LISTED_DEVICES:
        raise ValueError(f"more than {MAX_LISTED_DEVICES} devices")
    found: dict[str, DeviceInfo] = {}
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"device {i}: expected an object")
        device_id = item.get("id")
        if not isinstance(device_id, str) or not device_id:
            raise ValueError(f"device {i}: 'id' must be a non-empty string")
        state = item.get("state", "idle")
        if state not in ("idle", "offline"):
            raise ValueError(f"device {device_id!r}: 'state' must be idle or offline")
        caps = item.get("capabilities", {})
        if not isinstance(caps, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in caps.items()
        ):
            raise ValueError(f"device {device_id!r}: 'capabilities' must map strings to strings")
        found[device_id] = DeviceInfo(
            device_id=device_id, state=_state(state), capabilities=dict(caps)
        )
    return [found[k] for k in sorted(found)]


def _state(value: str) -> DeviceState:
    return "offline" if value == "offline" else "idle"


class CommandDeviceManager(_Notifier):
    """The devices an executable lists (see ``parse_device_list``), re-read on
    every ``refresh()``. When it cannot be run, fails, or prints something
    else, every device known so far is reported offline. The busy flag belongs
    to the agent and survives refreshes."""

    def __init__(
        self,
        path: str,
        *,
        runner: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
        timeout_s: float = 10.0,
    ) -> None:
        super().__init__()
        if not path:
            raise ValueError("command path must be non-empty")
        self._path = path
        self._runner = runner
        self._timeout_s = timeout_s
        self._seen: list[DeviceInfo] = []
        self._busy: set[str] = set()

    def _compose(self) -> list[DeviceInfo]:
        return [
            DeviceInfo(device_id=d.device_id, state="busy", capabilities=d.capabilities)
            if d.state == "idle" and d.device_id in self._busy
            else d
            for d in self._seen
        ]

    def snapshot(self) -> list[DeviceInfo]:
        with self._lock:
            return self._compose()

    def _list(self) -> list[DeviceInfo] | None:
        try:
            proc = self._runner(
                [self._path], capture_output=True, text=True, timeout=self._timeout_s, check=False
            )
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("device_command_failed", command=self._path, error=str(exc))
            return None
        if proc.returncode != 0:
            log.warning("device_command_failed", command=self._path, returncode=proc.returncode,
                        error=(proc.stderr or "").strip()[:500])  # fmt: skip
            return None
        try:
            return parse_device_list(proc.stdout or "")
        except ValueError as exc:
            log.warning("device_command_failed", command=self._path, error=str(exc)[:500])
            return None

    def refresh(self) -> bool:
        listed = self._list()
        with self._lock:
            if listed is None:
                listed = [
                    DeviceInfo(device_id=d.device_id, state="offline", capabilities=d.capabilities)
                    for d in self._seen
                ]
            before = self._compose()
            self._seen = listed
            changed = self._compose() != before
            if changed:
                self._bump()
        if changed:
            self._notify()
        return changed

    def _set_busy(self, device_id: str, *, busy: bool) -> None:
        with self._lock:
            if busy and all(d.device_id != device_id for d in self._seen):
                raise UnknownDevice(device_id)
            before = self._compose()
            if busy:
                self._busy.add(device_id)
            else:
                self._busy.discard(device_id)
            changed = self._compose() != before
            if changed:
                self._bump()
        if changed:
            self._notify()

    def mark_busy(self, device_id: str) -> None:
        self._set_busy(device_id, busy=True)

    def mark_idle(self, device_id: str) -> None:
        self._set_busy(device_id, busy=False)


class CombinedDeviceManager:
    """Several sources as one ``DeviceManager``."""

    def __init__(self, sources: Sequence[DeviceManager]) -> None:
        if not sources:
            raise ValueError("at least one device source is needed")
        self.sources = list(sources)
        self._duplicates_logged: set[str] = set()

    @property
    def version(self) -> int:
        return sum(s.version for s in self.sources)

    def snapshot(self) -> list[DeviceInfo]:
        found: dict[str, DeviceInfo] = {}
        for source in self.sources:
            for d in source.snapshot():
                if d.device_id in found:
                    if d.device_id not in self._duplicates_logged:
                        self._duplicates_logged.add(d.device_id)
                        log.warning("device_id_duplicated", device_id=d.device_id)
                    continue
                found[d.device_id] = d
        return [found[k] for k in sorted(found)]

    def refresh(self) -> bool:
        changed = False
        for source in self.sources:
            changed = source.refresh() or changed
        return changed

    def _owner(self, device_id: str) -> DeviceManager:
        for source in self.sources:
            if any(d.device_id == device_id for d in source.snapshot()):
                return source
        raise UnknownDevice(device_id)

    def mark_busy(self, device_id: str) -> None:
        self._owner(device_id).mark_busy(device_id)

    def mark_idle(self, device_id: str) -> None:
        for source in self.sources:
            source.mark_idle(device_id)

    def on_change(self, callback: Callable[[], None]) -> Callable[[], None]:
        undo = [s.on_change(callback) for s in self.sources]

        def unsubscribe() -> None:
            for u in undo:
                with contextlib.suppress(Exception):
                    u()

        return unsubscribe


def _one(spec: str) -> DeviceManager:
    text = spec.strip()
    kind, sep, arg = text.partition(":")
    if kind in ("simulated", "adb"):
        return device_manager_from_spec(text)
    if kind == "local":
        try:
            count = int(arg.strip()) if sep else -1
        except ValueError:
            count = -1
        if count < 1:
            raise ValueError(f"device spec {spec!r}: expected 'local:N' with N >= 1")
        return SimulatedDeviceManager(count, capabilities={"platform": "local"}, prefix="local")
    if kind == "command":
        if not arg.strip():
            raise ValueError(f"device spec {spec!r}: expected 'command:/path/to/executable'")
        return CommandDeviceManager(arg.strip())
    plugin = _plugins().get(kind)
    if plugin is None:
        raise ValueError(
            f"unknown device spec {spec!r}: expected simulated:N, local:N, adb, command:PATH "
            f"or a source of the entry point group {DEVICE_SOURCE_GROUP}"
        )
    manager = plugin(arg)
    if not isinstance(manager, DeviceManager):
        raise ValueError(f"device source {kind!r} did not return a DeviceManager")
    return manager


def _plugins() -> dict[str, Callable[[str], Any]]:
    found: dict[str, Callable[[str], Any]] = {}
    for ep in entry_points(group=DEVICE_SOURCE_GROUP):
        try:
            found[ep.name] = ep.load()
        except Exception as exc:
            log.warning("device_source_load_failed", name=ep.name, error=str(exc)[:500])
    return found


def device_manager_from_specs(specs: Iterable[str]) -> DeviceManager:
    """One manager for every source of ``specs`` (each may be a comma-separated
    list); ``ValueError`` naming a bad one."""
    parts = [p.strip() for spec in specs for p in spec.split(",") if p.strip()]
    if not parts:
        raise ValueError("no device source given")
    managers = [_one(p) for p in parts]
    return managers[0] if len(managers) == 1 else CombinedDeviceManager(managers)
