"""The fleet commands: ``hosts`` and ``devices``."""

from __future__ import annotations

import argparse
from typing import Any

from fleetlease.ops import render
from fleetlease.ops.client import OpsClient
from fleetlease.ops.commands.shared import command_adder, output, run


def register(sub: Any) -> None:
    cmd = command_adder(sub)

    cmd("hosts", "hosts of the fleet", cmd_hosts)
    p = cmd("devices", "devices of the fleet", cmd_devices)
    p.add_argument("--host", help="only this host's devices")


def cmd_hosts(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        output(args, await client.call("hosts"), render.print_hosts)

    return run(args, body)


def cmd_devices(args: argparse.Namespace) -> int:
    async def body(client: OpsClient) -> None:
        output(args, await client.call("devices", host=args.host), render.print_devices)

    return run(args, body)
