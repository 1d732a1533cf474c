"""The console's settings and its running state: the sign-in sessions, each with
its own NATS connection as its user, and the signal that ends every event
stream at shutdown."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fleetlease.ops.client import DEFAULT_TIMEOUT_S, OpsClient, OpsError
from fleetlease.ops.web.sessions import Session, SessionStore


@dataclass(frozen=True, kw_only=True)
class WebSettings:
    nats_url: str
    prefix: str = "fleetlease"
    #: Seconds to wait for each reply of the control plane.
    timeout_s: float = DEFAULT_TIMEOUT_S
    session_idle_s: float = 12 * 3600.0
    session_max_age_s: float = 7 * 86400.0
    #: Origins besides the console's own accepted on state-changing requests
    #: (the public origin when it sits behind a reverse proxy).
    allowed_origins: tuple[str, ...] = ()
    #: A comment line on idle event streams, so proxies keep them open.
    keepalive_s: float = 15.0
    #: Log lines shown on a task's page (the newest are kept).
    max_log_lines: int = 5000

    def __post_init__(self) -> None:
        if not self.nats_url:
            raise ValueError("nats_url is required")
        if self.timeout_s <= 0 or self.keepalive_s <= 0:
            raise ValueError("timeout_s and keepalive_s must be positive")


class Console:
    """The state of one running console: the sign-in sessions, each with its own
    NATS connection, and the signal that ends every event stream at shutdown."""

    def __init__(self, settings: WebSettings) -> None:
        self.settings = settings
        self.sessions = SessionStore(
            idle_s=settings.session_idle_s,
            max_age_s=settings.session_max_age_s,
            on_drop=self._forget,
        )
        self.closing = asyncio.Event()
        self._closers: set[asyncio.Task[None]] = set()

    def _client(self, *, user: str | None, token: str) -> OpsClient:
        return OpsClient(
            nats_url=self.settings.nats_url,
            token=token,
            prefix=self.settings.prefix,
            timeout_s=self.settings.timeout_s,
            user=user,
        )

    async def start(self) -> Console:
        """Checks that NATS answers (``OpsError`` "unavailable" if not). A secured
        broker refuses this anonymous probe, which is an answer too."""
        probe = self._client(user=None, token="")
        try:
            await probe.connect()
        except OpsError as exc:
            if exc.code != "unauthorized":
                raise
        finally:
            await probe.close()
        return self

    async def stop(self) -> None:
        self.closing.set()
        self.sessions.clear()
        if self._closers:
            await asyncio.gather(*self._closers, return_exceptions=True)

    def _forget(self, session: Session) -> None:
        client, session.client = session.client, None
        if client is not None:
            closer = asyncio.get_running_loop().create_task(client.close())
            self._closers.add(closer)
            closer.add_done_callback(self._closers.discard)

    async def sign_in(self, *, user: str, token: str) -> tuple[str, Session]:
        """Connects as ``user`` with ``token`` and asks who that is; the session
        keeps the connection. ``OpsError`` "unauthorized" if either is wrong."""
        client = self._client(user=user, token=token)
        await client.connect()
        try:
            me = await client.call("whoami")
            if me.get("name") != user:
                raise OpsError("the token is not this user's", "unauthorized")
        except BaseException:
            await client.close()
            raise
        session_id, session = self.sessions.create(
            token=token, user=user, platform_admin=bool(me.get("platform_admin"))
        )
        session.client = client
        return session_id, session

    async def client(self, session: Session) -> OpsClient:
        """The session's connection, made again if it was lost (a NATS restart)."""
        async with session.lock:
            client: OpsClient | None = session.client
            if client is None or client.nc is None or client.nc.is_closed:
                client = self._client(user=session.user, token=session.token)
                await client.connect()
                session.client = client
            return client
