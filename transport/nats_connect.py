"""NATS connections that outlive the expiry of their authorization.

On a secured broker every connection's user JWT expires (see
``transport/broker_auth.py``): the nats-server sends
``-ERR 'User Authentication Expired'`` and closes the connection, and the
client must come back through the auth callout, which checks the principal
again. nats-py 2.16 treats that error like any other protocol error and closes
the client for good (an open nats-py bug), so an agent or a CLI watch would
stop after one lifetime.

:class:`ReauthClient` handles that one error as a lost connection instead: the
usual reconnect runs (subscriptions replayed, buffered publishes flushed,
``reconnected_cb`` called), and a refused reconnect is reported through
``error_cb`` as for any other reconnect. What a reconnect can lose is the same
as for a network blip: a reply published while the client was away. Callers
already treat a missing reply as retryable (``TransportError``, the agent's
backoff loops, the CLI's idempotent retries).

The client does this only when reconnecting is allowed (``allow_reconnect``);
otherwise nats-py's own handling (close) applies.

Every connection of the control plane, the agents and the CLI also pings its
member every :data:`PING_INTERVAL_S` and drops it after
:data:`MAX_OUTSTANDING_PINGS` unanswered pings (:data:`KEEPALIVE`): a member
that froze without closing its sockets is left within about 15 s, well inside
a lease, where nats-py's defaults (two minutes, two pings) would let leases
expire first.
"""

from __future__ import annotations

from typing import Any

import structlog
from nats import errors as nats_errors
from nats.aio.client import Client as NatsClient

log = structlog.get_logger("fleetlease.nats")

#: Seconds between the client's pings to its member.
PING_INTERVAL_S = 5
#: Unanswered pings after which the client drops its member and reconnects.
MAX_OUTSTANDING_PINGS = 2
#: The keepalive options of every fleetlease connection (``nats.connect`` keywords).
KEEPALIVE: dict[str, Any] = {
    "ping_interval": PING_INTERVAL_S,
    "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
}

#: What the server says, lowercased as nats-py's parser hands it over.
AUTH_EXPIRED = "user authentication expired"


class ReauthClient(NatsClient):
    """A nats-py client that reconnects when its authorization expires."""

    async def _process_err(self, err_msg: str) -> None:
        if AUTH_EXPIRED in err_msg.lower() and self.options.get("allow_reconnect"):
            log.info("nats_authorization_expired", connection=self.options.get("name"))
            await self._process_op_err(nats_errors.Error(f"nats: {AUTH_EXPIRED}"))
            return
        await super()._process_err(err_msg)


def server_list(url: str | list[str]) -> str | list[str]:
    """The ``servers`` argument of ``nats.connect`` for a NATS URL setting.

    A setting may name several members of a NATS cluster, comma-separated
    (``nats://a:4222,nats://b:4222``); nats-py connects to one of them and fails
    over to the others when it drops. A single URL is passed through unchanged.
    """
    if isinstance(url, list) or "," not in url:
        return url
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ValueError(f"no NATS URL in {url!r}")
    return servers


async def connect(servers: str | list[str], **options: Any) -> NatsClient:
    """``nats.connect`` with a :class:`ReauthClient`; ``servers`` may be a
    comma-separated list of cluster members (see :func:`server_list`)."""
    nc = ReauthClient()
    await nc.connect(server_list(servers), **{**KEEPALIVE, **options})
    return nc
