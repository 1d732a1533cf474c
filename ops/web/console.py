"""The console's settings and its running state: the sign-in sessions, one NATS
connection per signed-in user shared by that user's sessions, the sign-in
limits, and the signal that ends every event stream at shutdown.

A user's connection is opened by their first sign-in and closed when their
last session ends (sign-out, expiry, eviction, a refused token). Every request
on it still carries the token of the session that makes it, so each session is
authorized as itself: a revoked token ends its own sessions, not the others.
A further sign-in of a user already connected is checked over that connection
(the control plane answers only if the token is that user's), so signing in
again and again opens nothing new.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass, field

from fleetlease.ops.client import DEFAULT_TIMEOUT_S, OpsClient, OpsError
from fleetlease.ops.web.ratelimit import RateLimiter, SignInLimits
from fleetlease.ops.web.sessions import Session, SessionStore


@dataclass(frozen=True, kw_only=True)
class WebSettings:
    nats_url: str
    prefix: str = "fleetlease"
    #: Seconds to wait for each reply of the control plane.
    timeout_s: float = DEFAULT_TIMEOUT_S
    session_idle_s: float = 12 * 3600.0
    session_max_age_s: float = 7 * 86400.0
    #: Sessions of one user; a further sign-in ends that user's least recently used.
    max_sessions_per_user: int = 16
    #: Sessions in all; at this many a sign-in is refused (503), never another's ended.
    max_sessions: int = 10_000
    #: Sign-in attempts per user name: ``burst`` at once, then one per interval.
    sign_in_burst_per_user: int = 10
    sign_in_interval_per_user_s: float = 6.0
    #: Sign-in attempts per client address: ``burst`` at once, then one per interval.
    sign_in_burst_per_address: int = 30
    sign_in_interval_per_address_s: float = 2.0
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


#: Seconds between sweeps of expired sessions (at most; less for a short idle limit).
SWEEP_S = 60.0


@dataclass
class _UserLink:
    """One user's NATS connection, shared by that user's sessions."""

    client: OpsClient | None = None
    #: Sessions of the user, and sign-ins of the user under way.
    sessions: int = 0
    signing_in: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Console:
    """The state of one running console: the sign-in sessions, one NATS
    connection per signed-in user, the sign-in limits, and the signal that
    ends every event stream at shutdown."""

    def __init__(self, settings: WebSettings) -> None:
        self.settings = settings
        self.sessions = SessionStore(
            idle_s=settings.session_idle_s,
            max_age_s=settings.session_max_age_s,
            max_sessions=settings.max_sessions,
            max_per_user=settings.max_sessions_per_user,
            on_drop=self._forget,
        )
        self.limits = SignInLimits(
            per_user=RateLimiter(
                burst=settings.sign_in_burst_per_user,
                interval_s=settings.sign_in_interval_per_user_s,
            ),
            per_address=RateLimiter(
                burst=settings.sign_in_burst_per_address,
                interval_s=settings.sign_in_interval_per_address_s,
            ),
        )
        self.closing = asyncio.Event()
        self._links: dict[str, _UserLink] = {}
        self._closers: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    def connections(self) -> dict[str, int]:
        """Open NATS connections by user (each 1: one per signed-in user)."""
        return {
            user: 1
            for user, link in self._links.items()
            if link.client is not None and link.client.nc is not None
        }

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
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return self

    async def stop(self) -> None:
        self.closing.set()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        self.sessions.clear()
        for user in list(self._links):
            self._release(user)
        if self._closers:
            await asyncio.gather(*self._closers, return_exceptions=True)

    async def _sweep(self) -> None:
        """Ends expired sessions (and so their users' connections) periodically."""
        every = min(SWEEP_S, self.settings.session_idle_s / 2, self.settings.session_max_age_s / 2)
        while True:
            await asyncio.sleep(every)
            self.sessions.sweep()

    def _forget(self, session: Session) -> None:
        link = self._links.get(session.user)
        if link is not None:
            link.sessions = max(0, link.sessions - 1)
            self._release(session.user)

    def _release(self, user: str) -> None:
        """Closes ``user``'s connection if no session or sign-in needs it."""
        link = self._links.get(user)
        if link is None or (link.sessions and not self.closing.is_set()) or link.signing_in:
            return
        del self._links[user]
        client, link.client = link.client, None
        if client is not None:
            closer = asyncio.get_running_loop().create_task(client.close())
            self._closers.add(closer)
            closer.add_done_callback(self._closers.discard)

    async def _connected(self, link: _UserLink, *, user: str, token: str) -> OpsClient:
        """The user's connection, opened with ``token`` if there is none or it
        was lost (a NATS restart, or its token refused when the broker asked
        again)."""
        async with link.lock:
            client = link.client
            if client is None or client.nc is None or client.nc.is_closed:
                if client is not None:
                    await client.close()
                    link.client = None
                client = await self._client(user=user, token=token).connect()
                link.client = client
            return client

    def _as(self, client: OpsClient, token: str) -> OpsClient:
        """Requests on the shared connection ``client`` that carry ``token``."""
        return dataclasses.replace(client, token=token)

    async def sign_in(
        self, *, user: str, token: str, address: str = "unknown"
    ) -> tuple[str, Session]:
        """Counts the attempt against the limits of ``user`` and ``address``
        (``SignInThrottled`` over them), then asks the control plane, with
        ``token``, who that is: ``OpsError`` "unauthorized" if the user or the
        token is wrong, ``SessionsFull`` if the console may hold no more."""
        self.limits.attempt(user=user, address=address)
        link = self._links.setdefault(user, _UserLink())
        link.signing_in += 1
        try:
            shared = await self._connected(link, user=user, token=token)
            me = await self._as(shared, token).call("whoami")
            if not isinstance(me, dict) or me.get("name") != user:
                raise OpsError("the token is not this user's", "unauthorized")
            session_id, session = self.sessions.create(
                token=token, user=user, platform_admin=bool(me.get("platform_admin"))
            )
            link.sessions += 1
            return session_id, session
        finally:
            link.signing_in -= 1
            self._release(user)

    async def client(self, session: Session) -> OpsClient:
        """A client of the session's user's connection (made again with this
        session's token if it was lost) whose requests carry this session's token."""
        link = self._links.get(session.user)
        if link is None:
            # The user's last session ended while this request was under way.
            raise OpsError("the session has ended", "unauthorized")
        link.signing_in += 1
        try:
            shared = await self._connected(link, user=session.user, token=session.token)
            return self._as(shared, session.token)
        finally:
            link.signing_in -= 1
            self._release(session.user)
