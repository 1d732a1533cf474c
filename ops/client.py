"""The client of the user API: requests on ``{prefix}.ops.{user}.{verb}`` carrying
the user's token, answered by ``ops/userapi`` in the control plane, and the task events of
the tasks that user may read.

Used by the CLI (``ops/commands``) and the web console (``ops/web``).
Every failure is an ``OpsError`` carrying the wire error ``code``
(``unauthorized``, ``forbidden``, ``not_found``, ...): the web console answers
401, 403 or 404 by it, the CLI maps it to its exit code (``ops/cli.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fleetlease.ops import limits
from fleetlease.ops.config import Settings
from fleetlease.transport import wire
from fleetlease.transport.subjects import Subjects, is_valid_token

DEFAULT_TIMEOUT_S = 10.0
#: Verbs that only read: sent again when the connection reconnected while one
#: was waiting for its reply (a reply published while the client was away, as
#: when its broker authorization expires, is lost).
REPEATABLE_VERBS = frozenset(
    {
        "whoami",
        "tasks",
        "task_show",
        "events",
        "logs",
        "artifacts",
        "artifact_get",
        "hosts",
        "host_list",
        "devices",
        "fleet_counts",
        "fleet_history",
    }
)
_RECONNECT_CHECK_S = 0.1


class OpsError(Exception):
    """A user API request failed; ``code`` is the wire error code (``unavailable``
    when no control plane answered, ``bad_reply`` for an undecodable reply)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass
class OpsClient:
    """One NATS connection for the user API of one control plane."""

    nats_url: str
    token: str
    prefix: str = "fleetlease"
    timeout_s: float = DEFAULT_TIMEOUT_S
    nc: Any = None
    #: The token's user: connect as ``user:<name>`` with a proof of the token
    #: (harmless on an open server). Unknown: an anonymous connect,
    #: which only an open server accepts.
    user: str | None = None
    #: Concurrent first calls identify once, not each on its own connection.
    _identifying: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings, timeout_s: float = DEFAULT_TIMEOUT_S) -> OpsClient:
        assert settings.nats_url and settings.token
        return cls(
            nats_url=settings.nats_url,
            token=settings.token,
            prefix=settings.prefix,
            timeout_s=timeout_s,
            user=settings.user,
        )

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    async def connect(self) -> OpsClient:
        from fleetlease.transport.nats_connect import connect as nats_connect

        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc) or type(exc).__name__)

        identity = self._identity()
        try:
            # nats-py 2.16 retries the first connect forever with
            # max_reconnect_attempts=0: allow one retry, and bound it anyway.
            # Reconnecting is allowed (twice, then the client closes) so that a
            # long `watch` or console session comes back through the expiry of
            # its broker authorization.
            self.nc = await asyncio.wait_for(
                nats_connect(
                    self.nats_url,
                    name="fleetlease-cli",
                    connect_timeout=min(self.timeout_s, 5.0),
                    allow_reconnect=True,
                    max_reconnect_attempts=1,
                    reconnect_time_wait=0.1,
                    error_cb=on_error,
                    **identity,
                ),
                self.timeout_s,
            )
        except Exception as exc:
            reason = errors[0] if errors else (str(exc) or type(exc).__name__)
            if "authorization" in reason.lower():
                who = f"user {self.user!r} with this token" if self.user else "an unnamed user"
                raise OpsError(
                    f"NATS at {self.nats_url} refused {who}: check the token, and name its "
                    "user with --user or FLEETLEASE_USER",
                    "unauthorized",
                ) from exc
            raise OpsError(
                f"cannot reach NATS at {self.nats_url}: {reason}", "unavailable"
            ) from exc
        return self

    def _identity(self) -> dict[str, Any]:
        """The connect options of this user: its own inbox prefix (the control
        plane answers nowhere else) and, for a secured broker, its identity and
        proof of the token. A client that does not know its user yet gets the
        anonymous inbox, where only the identify request is answered."""
        if not self.user:
            return {"inbox_prefix": self.subjects.anon_inbox_prefix().encode()}
        from fleetlease.transport.broker_auth import BrokerAuthError, user_connect_options

        try:
            inbox = self.subjects.ops_inbox_prefix(self.user)
        except ValueError:
            raise OpsError(
                f"user name {self.user!r} is not 1..64 characters of [A-Za-z0-9_-]",
                "bad_request",
            ) from None
        try:
            return user_connect_options(self.user, self.token, self.subjects)
        except (BrokerAuthError, ValueError):
            # Not a well-formed token: the API says so.
            return {"inbox_prefix": inbox.encode()}

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
            self.nc = None

    async def __aenter__(self) -> OpsClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _send(self, subject: str, verb: str, data: bytes) -> Any:
        """The reply to one request; a read-only verb is sent once more if the
        connection reconnects while it waits (instead of waiting out the timeout
        for a reply that was lost)."""
        resend = verb in REPEATABLE_VERBS
        while True:
            reconnects = self.nc.stats["reconnects"]
            pending = asyncio.ensure_future(self.nc.request(subject, data, timeout=self.timeout_s))
            try:
                while True:
                    done, _ = await asyncio.wait({pending}, timeout=_RECONNECT_CHECK_S)
                    if done:
                        return pending.result()
                    if resend and self.nc.stats["reconnects"] != reconnects:
                        break
            finally:
                pending.cancel()  # a no-op once it is done
            resend = False

    async def call(self, verb: str, **args: Any) -> Any:
        """``verb`` on ``{prefix}.ops.{user}.{verb}``. A client that was not told
        its user asks the control plane whose the token is first (an open broker
        only: a secured one admits no unnamed user) and reconnects as that user."""
        if not self.user:
            async with self._identifying:
                if not self.user:
                    await self._identify()
        assert self.user is not None
        return await self._request(self.subjects.ops(self.user, verb), verb, args)

    async def _identify(self) -> None:
        me = await self._request(self.subjects.ops_identify(), "whoami", {})
        name = me.get("name") if isinstance(me, dict) else None
        if not is_valid_token(name):
            raise OpsError("bad reply from the control plane: no user name", "bad_reply")
        await self.close()
        try:
            self.user = name
            await self.connect()
        except BaseException:
            self.user = None  # the next call identifies again
            raise

    async def _request(self, subject: str, verb: str, args: dict[str, Any]) -> Any:
        import nats.errors

        sent = {k: v for k, v in args.items() if v is not None}
        request = wire.OpsRequest(token=self.token, verb=verb, args=sent)
        data = self._checked(verb, sent, request)
        try:
            msg = await self._send(subject, verb, data)
        except nats.errors.NoRespondersError:
            raise OpsError(
                f"no control plane answers on NATS at {self.nats_url} (prefix {self.prefix}): "
                "is `fleetlease up` or `fleetlease serve` running?",
                "unavailable",
            ) from None
        except nats.errors.TimeoutError:
            raise OpsError(
                f"the control plane did not answer {verb} within {self.timeout_s:g}s",
                "unavailable",
            ) from None
        except nats.errors.ConnectionClosedError:
            raise OpsError(
                f"the NATS connection to {self.nats_url} closed", "unavailable"
            ) from None
        try:
            reply = wire.decode_reply(msg.data, wire.OpsReply)
        except wire.RemoteError as exc:
            raise OpsError(
                f"{exc.code.replace('_', ' ')}: {exc.message}",
                exc.code,
            ) from None
        except wire.DecodeError as exc:
            raise OpsError(
                f"bad reply from the control plane: {exc.message}", "bad_reply"
            ) from None
        return reply.data

    def _checked(self, verb: str, args: dict[str, Any], request: wire.OpsRequest) -> bytes:
        """The encoded request, refused here (as the API would refuse it) when an
        argument or the whole request is larger than the API or the broker takes."""
        message = limits.oversized(args)
        data = b"" if message is not None else wire.encode(request)
        broker = int(getattr(self.nc, "max_payload", 0) or limits.MAX_REQUEST)
        most = min(limits.MAX_REQUEST, broker)
        if message is None and len(data) > most:
            message = limits.too_large(f"the {verb.replace('_', ' ')} request", most)
        if message is not None:
            raise OpsError(f"bad request: {message}", "bad_request")
        return data


# --- task events ----------------------------------------------------------------------


def normalize_event(raw: Any) -> dict[str, Any] | None:
    """A task event as ``watch`` shows it, by allow-list (events are produced by
    the actor system; only these fields ever reach the screen)."""
    if not isinstance(raw, dict):
        return None
    task_id = raw.get("task_id") or raw.get("id")
    state = raw.get("state") or raw.get("new_state") or raw.get("status")
    if not isinstance(task_id, str) or not isinstance(state, str):
        return None
    at = raw.get("at") or raw.get("ts") or raw.get("time")
    if isinstance(at, int | float) and not isinstance(at, bool):
        at = wire.from_unix(float(at)).isoformat()
    return {
        "task_id": task_id,
        "state": state,
        "attempt": raw.get("attempt") if isinstance(raw.get("attempt"), int) else None,
        "host_id": raw.get("host_id") if isinstance(raw.get("host_id"), str) else None,
        "device_id": raw.get("device_id") if isinstance(raw.get("device_id"), str) else None,
        "at": at if isinstance(at, str) else None,
    }


@dataclass
class PollPacer:
    """When a long-poll loop may ask again. An answer with events, or one that
    took most of the wait asked for, is followed at once by the next poll. An
    empty answer that came back early (the control plane had no long-poll slot
    to park it in, or is stopping) and a ``busy`` refusal are followed by a
    capped exponential backoff with jitter, so a loop never spins however the
    control plane answers."""

    base_s: float = 0.5
    cap_s: float = 15.0
    #: An empty answer within this fraction of the wait asked for is early.
    early_fraction: float = 0.5
    rng: Callable[[], float] = field(default=random.random)
    failures: int = 0

    def answered(self, *, waited_s: float, asked_s: float, events: int) -> float:
        """The pause before the next poll after an answer."""
        if events or waited_s >= asked_s * self.early_fraction:
            self.failures = 0
            return 0.0
        return self.refused()

    def refused(self) -> float:
        """The pause before the next poll after a ``busy`` refusal."""
        self.failures += 1
        delay = min(self.cap_s, self.base_s * 2 ** min(self.failures - 1, 32))
        return float(delay * (0.5 + 0.5 * self.rng()))


#: ``unavailable`` answers in a row that an events poll takes before giving up:
#: on a cursor, that no control plane holds it (a gap); without one, that none
#: answers. The retries wait 0.2 s, doubling up to 2 s, with jitter: about 10 s
#: in all (plus the requests' own time).
EVENTS_RETRIES = 8


async def _poll_events(client: OpsClient, pacer: PollPacer, **args: Any) -> Any:
    """One ``events`` call, retried after ``pacer``'s backoff while ``busy``, and
    while ``unavailable`` up to ``EVENTS_RETRIES`` times (each retry may reach
    another control-plane process: one that holds the cursor, or one that is
    alive); then the last ``unavailable`` is raised."""
    unavailable = 0
    while True:
        try:
            return await client.call("events", **args)
        except OpsError as exc:
            if exc.code == "busy":
                await asyncio.sleep(pacer.refused())
                continue
            if exc.code != "unavailable" or unavailable >= EVENTS_RETRIES:
                raise
        delay = min(2.0, 0.2 * 2**unavailable)
        unavailable += 1
        await asyncio.sleep(delay * (0.5 + 0.5 * pacer.rng()))


async def task_events(
    client: OpsClient,
    *,
    subscribed: asyncio.Event | None = None,
    wait_s: float | None = None,
    pacer: PollPacer | None = None,
    on_gap: Callable[[], Awaitable[None] | None] | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """State changes of the tasks this user may read, in commit order, from the
    control plane's ``events`` verb (a long-poll the control plane filters by
    the user's roles: no client ever reads another's events). ``subscribed`` is
    set once the cursor of the present is known: every event after that is seen
    (a live view can say "live" truthfully). ``wait_s``: the long-poll of one
    request (default: three quarters of the client's timeout, at most 25 s).
    Early empty answers and ``busy`` refusals are paced by ``pacer``
    (:class:`PollPacer`).

    Every ``serve`` process serves the same feed, so a cursor continues on
    whichever one answers. A poll that fails ``unavailable`` (the process was
    stopped or killed, or does not hold the cursor) is retried, paced, up to
    ``EVENTS_RETRIES`` times. When none of those retries could continue from
    the cursor, the feed goes on from the present and ``on_gap`` is called
    (changes may have been missed: re-read what you show); when no control
    plane answers at all, the last ``OpsError`` is raised."""
    wait = wait_s if wait_s is not None else min(25.0, client.timeout_s * 0.75)
    pacer = pacer if pacer is not None else PollPacer()
    loop = asyncio.get_running_loop()
    cursor = int((await _poll_events(client, pacer))["next"])
    if subscribed is not None:
        subscribed.set()
    while True:
        started = loop.time()
        try:
            page = await _poll_events(client, pacer, after=cursor, wait_s=wait)
        except OpsError as exc:
            if exc.code != "unavailable":
                raise
            page = {"next": (await _poll_events(client, pacer))["next"], "gap": True}
        cursor = int(page["next"])
        if page.get("gap") and on_gap is not None:
            pending = on_gap()
            if pending is not None:
                await pending
        raws = page.get("events") or []
        delay = pacer.answered(waited_s=loop.time() - started, asked_s=wait, events=len(raws))
        for raw in raws:
            event = normalize_event(raw)
            if event is not None:
                yield event
        if delay > 0:
            await asyncio.sleep(delay)
