"""A NATS member that goes silent without closing its sockets (a frozen
process, a lost machine) is left by every fleetlease connection well inside a
lease, by the keepalive pings of ``transport.nats_connect``.

The member is a real nats-server behind a TCP proxy that stops forwarding
(``FaultProxy.blackhole``): the client's socket stays open and nothing comes
back, so only the client's own pings can tell. With nats-py's defaults (a ping
every two minutes, two unanswered) the connection would be held for four
minutes, long past a 30 s lease.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from fleetlease.ops.testing.faultproxy import FaultProxy
from fleetlease.transport.nats_connect import (
    MAX_OUTSTANDING_PINGS,
    PING_INTERVAL_S,
    connect,
)

#: The default lease (``serve --lease-s``): a silent member must be left before it ends.
LEASE_S = 30.0


async def test_a_silent_member_is_left_within_a_lease(nats_url: str) -> None:
    first = urlsplit(nats_url.split(",")[0])
    proxy = await FaultProxy((first.hostname or "127.0.0.1", first.port or 4222)).start()
    disconnected = asyncio.Event()

    async def on_disconnect() -> None:
        disconnected.set()

    nc = await connect(
        f"nats://127.0.0.1:{proxy.port}",
        name="keepalive-test",
        disconnected_cb=on_disconnect,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=2,
    )
    try:
        assert nc.options["ping_interval"] == PING_INTERVAL_S
        assert nc.options["max_outstanding_pings"] == MAX_OUTSTANDING_PINGS
        await nc.flush(timeout=5)
        proxy.blackhole()
        # A deadline, not a timing assertion: the keepalive is what ends the wait.
        await asyncio.wait_for(disconnected.wait(), timeout=LEASE_S)
    finally:
        proxy.heal()
        await nc.close()
        await proxy.stop()
