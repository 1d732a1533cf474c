"""The drain commands (a platform admin's): ``host drain|undrain`` and
``device drain|undrain``.

``host drain HOST [--deadline D] [--wait]``: the host takes no new assignment;
its active attempts run on, and past the deadline (if given) are handed back
and retried elsewhere. ``--wait`` returns once no attempt holds a device of
the host (or, for ``device drain --wait``, that device), polling ``devices``;
``--wait-timeout`` bounds the wait (exit 1 if the host is still busy then).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import Any

from fleetlease.ops import render
from fleetlease.ops.cli import EXIT_ERROR, EXIT_USAGE, CliError
from fleetlease.ops.client import OpsClient
from fleetlease.ops.commands.bulk import duration
from fleetlease.ops.commands.shared import command_adder, run

#: How often ``--wait`` asks whether the drained host or device is idle.
WAIT_POLL_S = 0.5


def register(sub: Any) -> None:
    cmd = command_adder(sub)
    device = sub.add_parser("device", help="drain devices (platform admin)").add_subparsers(
        dest="device_command", metavar="COMMAND", required=True
    )
    p = cmd("drain", "drain a device: it takes no new assignment", cmd_device_drain, device)
    p.add_argument("device", metavar="HOST/DEVICE")
    _add_wait(p)
    p = cmd("undrain", "end a device's drain", cmd_device_undrain, device)
    p.add_argument("device", metavar="HOST/DEVICE")


def add_host_commands(cmd: Callable[..., Any], host: Any) -> None:
    """``host drain`` and ``host undrain``, beside the other ``host`` commands."""
    p = cmd(
        "drain",
        "drain a host: no new assignment; its running attempts finish",
        cmd_host_drain,
        host,
    )
    p.add_argument("host_id")
    p.add_argument(
        "--deadline",
        type=duration,
        metavar="DURATION",
        help="hand the host's attempts back after this long (90, 30s, 10m, 2h, 1d)",
    )
    _add_wait(p)
    p = cmd("undrain", "end a host's drain: it takes assignments again", cmd_host_undrain, host)
    p.add_argument("host_id")


def _add_wait(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait", action="store_true", help="return once nothing runs on it")
    p.add_argument(
        "--wait-timeout",
        type=duration,
        metavar="DURATION",
        help="with --wait: give up (exit 1) after this long; default: wait until idle",
    )


def split_device(text: str) -> tuple[str, str]:
    """``HOST/DEVICE`` as (host, device); the device id may contain ``/``."""
    host, sep, device = text.partition("/")
    if not sep or not host or not device:
        raise CliError(f"expected HOST/DEVICE, got {text!r}", EXIT_USAGE)
    return host, device


async def wait_idle(
    client: OpsClient, host_id: str, device_id: str | None, timeout: float | None
) -> float:
    """Poll ``devices`` until no attempt holds a device of the host (or the one
    device); returns the seconds waited. ``CliError`` past ``timeout``."""
    start = time.monotonic()
    while True:
        rows = await client.call("devices", host=host_id)
        busy = [
            d
            for d in rows
            if d.get("task_id") is not None and (device_id is None or d["device_id"] == device_id)
        ]
        waited = time.monotonic() - start
        if not busy:
            return waited
        if timeout is not None and waited >= timeout:
            what = f"{host_id}/{device_id}" if device_id else host_id
            raise CliError(
                f"{what} still has {len(busy)} active attempt(s) after {timeout:g}s", EXIT_ERROR
            )
        await asyncio.sleep(WAIT_POLL_S)


def _finish(
    args: argparse.Namespace, data: dict[str, Any], what: str, waited: float | None
) -> None:
    if waited is not None:
        data = {**data, "idle": True, "active": 0}
    if args.json:
        render.print_json(data)
        return
    deadline = f", deadline {data['deadline']}" if data.get("deadline") else ""
    print(f"{what} drained{deadline}; {data['active']} active attempt(s)")
    if waited is not None:
        print(f"{what} is idle (waited {waited:.1f}s)")


def cmd_host_drain(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        call: dict[str, Any] = {"host_id": args.host_id}
        if args.deadline is not None:
            call["deadline_s"] = args.deadline
        data = await client.call("host_drain", **call)
        waited = None
        if args.wait:
            if not args.json:
                print(f"host {args.host_id} drained; waiting for {data['active']} attempt(s)")
            waited = await wait_idle(client, args.host_id, None, args.wait_timeout)
        _finish(args, data, f"host {args.host_id}", waited)

    return run(args, body)


def cmd_host_undrain(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        data = await client.call("host_undrain", host_id=args.host_id)
        if args.json:
            render.print_json(data)
            return
        note = "" if data.get("was_drained") else " (it was not drained)"
        print(f"host {args.host_id} takes assignments again{note}")

    return run(args, body)


def cmd_device_drain(args: argparse.Namespace) -> int:
    host_id, device_id = split_device(args.device)

    async def body(client: OpsClient) -> None:
        data = await client.call("device_drain", host_id=host_id, device_id=device_id)
        waited = None
        if args.wait:
            waited = await wait_idle(client, host_id, device_id, args.wait_timeout)
        _finish(args, data, f"device {host_id}/{device_id}", waited)

    return run(args, body)


def cmd_device_undrain(args: argparse.Namespace) -> int:
    host_id, device_id = split_device(args.device)

    async def body(client: OpsClient) -> None:
        data = await client.call("device_undrain", host_id=host_id, device_id=device_id)
        if args.json:
            render.print_json(data)
            return
        note = "" if data.get("was_drained") else " (it was not drained)"
        print(f"device {host_id}/{device_id} takes assignments again{note}")

    return run(args, body)
