"""Server-side sign-in sessions and the CSRF checks of the web console.

The user token never leaves the server once signed in: the browser holds only a
random session id in an HttpOnly, SameSite=Strict cookie, and the store keeps
that id's SHA-256 (so a dump of the store cannot be replayed as cookies) next
to the token, the user's name and the session's CSRF token. Sessions live in
memory: restarting the console signs everyone out, which is the safe failure.

Limits: a session ends after ``idle_s`` without use or ``max_age_s`` in all; a
user holds at most ``max_per_user`` sessions (a further sign-in ends that
user's own least recently used one, never another user's); the store holds at
most ``max_sessions`` in all, and refuses a sign-in (``SessionsFull``) rather
than end anyone's session to make room.

CSRF: every state-changing request must come from our own origin (``Origin``,
else ``Referer``; neither is refused) and carry the synchronizer token of its
session in the form (or, before sign-in, the double-submit cookie's value).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

SESSION_COOKIE = "fleetlease_session"
LOGIN_CSRF_COOKIE = "fleetlease_login_csrf"


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def _key(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class SessionsFull(Exception):
    """The console holds as many sessions as it may: a sign-in is refused (no
    other user's session is ended to make room)."""


@dataclass
class Session:
    user: str
    platform_admin: bool
    token: str = field(repr=False)
    csrf: str = field(repr=False)
    created: float
    last_used: float
    #: One-shot notices shown by the next page (kind, text), e.g. a cancel's outcome.
    flashes: list[tuple[str, str]] = field(default_factory=list)

    def flash(self, kind: str, text: str) -> None:
        self.flashes.append((kind, text))

    def take_flashes(self) -> list[tuple[str, str]]:
        out, self.flashes = self.flashes, []
        return out


class SessionStore:
    """In-memory sessions, ended after ``idle_s`` without use or ``max_age_s`` in
    all, at most ``max_per_user`` of one user and ``max_sessions`` in all."""

    def __init__(
        self,
        *,
        idle_s: float = 12 * 3600.0,
        max_age_s: float = 7 * 86400.0,
        max_sessions: int = 10_000,
        max_per_user: int = 16,
        clock: Callable[[], float] = time.monotonic,
        on_drop: Callable[[Session], None] | None = None,
    ) -> None:
        """``on_drop(session)`` runs for every session that ends (sign-out,
        expiry, eviction, a refused token): the console releases its user's
        connection."""
        if idle_s <= 0 or max_age_s <= 0:
            raise ValueError("idle_s and max_age_s must be positive")
        if max_sessions < 1 or max_per_user < 1:
            raise ValueError("max_sessions and max_per_user must be at least 1")
        self.idle_s = idle_s
        self.max_age_s = max_age_s
        self.max_sessions = max_sessions
        self.max_per_user = max_per_user
        self._clock = clock
        self._on_drop = on_drop
        self._sessions: dict[str, Session] = {}
        #: Each user's session keys, least recently used first.
        self._by_user: dict[str, dict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def count(self, user: str) -> int:
        """How many sessions ``user`` holds."""
        return len(self._by_user.get(user, ()))

    def users(self) -> set[str]:
        """The users holding at least one session."""
        return set(self._by_user)

    def create(self, *, token: str, user: str, platform_admin: bool) -> tuple[str, Session]:
        """A new session; returns the cookie value (shown to nobody else) and the
        session. At ``max_per_user`` the user's own least recently used session
        ends; ``SessionsFull`` if the store is full of other sessions."""
        self.sweep()
        own = self._by_user.get(user, {})
        while len(own) >= self.max_per_user:
            self._drop_key(next(iter(own)))
        if len(self._sessions) >= self.max_sessions:
            raise SessionsFull("the console holds as many sessions as it may")
        now = self._clock()
        session_id = new_secret()
        session = Session(
            user=user,
            platform_admin=platform_admin,
            token=token,
            csrf=new_secret(),
            created=now,
            last_used=now,
        )
        key = _key(session_id)
        self._sessions[key] = session
        self._by_user.setdefault(user, {})[key] = None
        return session_id, session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        key = _key(session_id)
        session = self._sessions.get(key)
        if session is None:
            return None
        now = self._clock()
        if self._expired(session, now):
            self._drop_key(key)
            return None
        session.last_used = now
        own = self._by_user[session.user]
        own.pop(key)
        own[key] = None  # now the user's most recently used
        return session

    def drop(self, session_id: str | None) -> None:
        if session_id:
            self._drop_key(_key(session_id))

    def drop_token(self, token: str) -> None:
        """End every session signed in with ``token`` (it was refused: revoked)."""
        for key in [k for k, s in self._sessions.items() if hmac.compare_digest(s.token, token)]:
            self._drop_key(key)

    def clear(self) -> None:
        for key in list(self._sessions):
            self._drop_key(key)

    def _drop_key(self, key: str) -> None:
        session = self._sessions.pop(key, None)
        if session is None:
            return
        own = self._by_user.get(session.user)
        if own is not None:
            own.pop(key, None)
            if not own:
                del self._by_user[session.user]
        if self._on_drop is not None:
            self._on_drop(session)

    def _expired(self, session: Session, now: float) -> bool:
        return now - session.last_used > self.idle_s or now - session.created > self.max_age_s

    def sweep(self) -> int:
        """Ends every expired session (the console calls this periodically, so
        an abandoned session's connection does not wait for the next sign-in);
        returns how many ended."""
        now = self._clock()
        expired = [k for k, s in self._sessions.items() if self._expired(s, now)]
        for key in expired:
            self._drop_key(key)
        return len(expired)


def tokens_match(expected: str | None, given: str | None) -> bool:
    if not expected or not given:
        return False
    return hmac.compare_digest(expected.encode(), given.encode())


def origin_of(url: str) -> str | None:
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if not parts.scheme or not parts.netloc:
        return None
    return f"{parts.scheme}://{parts.netloc}".lower()


def same_origin(
    *, origin: str | None, referer: str | None, own: str, allowed: Iterable[str] = ()
) -> bool:
    """Whether a state-changing request comes from one of our own origins. A
    browser sends ``Origin`` with every POST; ``Referer`` is the fallback; a
    request with neither (or ``Origin: null``) is refused."""
    claimed = origin_of(origin) if origin and origin != "null" else None
    if claimed is None and not origin and referer:
        claimed = origin_of(referer)
    if claimed is None:
        return False
    return claimed in {own.lower(), *(a.lower().rstrip("/") for a in allowed)}
