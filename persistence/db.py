"""Engine creation and URL handling.

A database URL names one server, or several in libpq's multi-host form
(``postgresql://user@h1:5432,h2:5432/db?target_session_attrs=read-write``):
each connection tries the hosts in order, each for at most ``connect_timeout``
seconds (as libpq does), and keeps the first that matches
``target_session_attrs`` (``read-write``: the primary). After a failover the
pool is invalidated (:func:`invalidate_pool`) and new connections find the new
primary. ``docs/operations.md`` has the supported topology."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

#: libpq's (and asyncpg's) values of ``target_session_attrs``.
SESSION_ATTRS = frozenset(
    {"any", "read-write", "read-only", "primary", "standby", "prefer-standby"}
)
DEFAULT_PORT = 5432
#: How long one host of a multi-host URL may take to connect before the next
#: is tried (``connect_timeout`` in the URL overrides it): a failed primary
#: whose address no longer answers must not hold up the standby.
DEFAULT_CONNECT_TIMEOUT_S = 10.0

#: SQLSTATEs after which a connection's server can no longer take this control
#: plane's writes: a read-only transaction (a standby, or a demoted primary)
#: and the server shutting down or crashing. Like a lost connection they
#: invalidate the pool, so the next transactions reconnect and find the
#: primary.
SERVER_LOST_SQLSTATES = frozenset({"25006", "57P01", "57P02", "57P03"})


def _multihost(url: str) -> str:
    """libpq's multi-host form (``h1:p1,h2:p2`` in the authority) as
    SQLAlchemy's asyncpg form (``?host=h1:p1&host=h2:p2``); anything else
    unchanged. A host without a port gets 5432, as in libpq."""
    parts = urlsplit(url)
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    if "," not in hostlist:
        return url
    if any(q.partition("=")[0] in ("host", "port") for q in parts.query.split("&")):
        raise ValueError("give the hosts either in the authority or as ?host=, not both")
    hosts = []
    for entry in hostlist.split(","):
        if not entry:
            raise ValueError("empty host in a multi-host database URL")
        if entry.startswith("["):
            raise ValueError(
                "IPv6 addresses are not supported in a multi-host database URL: use host names"
            )
        host, colon, port = entry.partition(":")
        if not host or (colon and not port.isdigit()):
            raise ValueError(f"bad host:port {entry!r} in a multi-host database URL")
        hosts.append(f"host={quote(host, safe='')}:{port or DEFAULT_PORT}")
    query = "&".join(hosts + ([parts.query] if parts.query else []))
    return urlunsplit((parts.scheme, userinfo + at, parts.path, query, parts.fragment))


def async_url(url: str) -> str:
    """Accept ``postgresql://``, ``postgres://`` or ``postgresql+asyncpg://`` URLs
    (including unix-socket ones, ``?host=/path``, and libpq's multi-host form)
    and return the asyncpg form. ``ValueError`` for an unusable one."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    u = make_url(_multihost(url))
    if u.drivername in ("postgresql", "postgresql+psycopg2", "postgresql+psycopg"):
        u = u.set(drivername="postgresql+asyncpg")
    if u.drivername != "postgresql+asyncpg":
        raise ValueError(f"unsupported database URL scheme {u.drivername!r}: use postgresql://")
    if "connect_timeout" in u.query:
        connect_timeout(url)  # validated; the engine applies it per host
        u = u.difference_update_query(["connect_timeout"])
    attrs = u.query.get("target_session_attrs")
    if attrs is not None and (not isinstance(attrs, str) or attrs not in SESSION_ATTRS):
        raise ValueError("target_session_attrs must be one of " + ", ".join(sorted(SESSION_ATTRS)))
    return u.render_as_string(hide_password=False)


def connect_timeout(url: str) -> float:
    """The URL's ``connect_timeout`` (seconds per host, as in libpq), else
    ``DEFAULT_CONNECT_TIMEOUT_S``. ``ValueError`` unless a positive number."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    value = make_url(_multihost(url)).query.get("connect_timeout")
    if value is None:
        return DEFAULT_CONNECT_TIMEOUT_S
    try:
        seconds = float(value if isinstance(value, str) else value[-1])
    except ValueError:
        seconds = 0.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"connect_timeout must be a positive number of seconds, got {value!r}")
    return seconds


def _each_host(timeout_s: float) -> Any:
    """asyncpg's connect for a list of hosts, one at a time with ``timeout_s``
    each (asyncpg's own ``timeout`` bounds all hosts together, so a first host
    that does not answer would use it all up). A host that cannot be reached,
    refuses or does not match ``target_session_attrs`` passes to the next; the
    last host's error is raised."""
    import asyncpg

    async def connect(
        *args: Any,
        host: str | Sequence[str] | None = None,
        port: int | Sequence[int] | None = None,
        **kwargs: Any,
    ) -> Any:
        kwargs["timeout"] = timeout_s
        if not isinstance(host, list | tuple) or not isinstance(port, list | tuple):
            return await asyncpg.connect(*args, host=host, port=port, **kwargs)
        error: BaseException | None = None
        for h, p in zip(host, port, strict=True):
            try:
                return await asyncpg.connect(*args, host=h, port=p, **kwargs)
            except (
                OSError,
                TimeoutError,
                asyncpg.InternalClientError,  # no match for target_session_attrs
                asyncpg.PostgresConnectionError,
                asyncpg.CannotConnectNowError,  # starting up or shutting down
            ) as exc:
                error = exc
        assert error is not None
        raise error

    return connect


def _mark_server_lost(ctx: Any) -> None:
    """``handle_error`` of the engine: a server that went read-only or is
    shutting down counts as a disconnect, which invalidates the pool."""
    orig = ctx.original_exception
    state = getattr(orig, "sqlstate", None) or getattr(
        getattr(orig, "__cause__", None), "sqlstate", None
    )
    if state in SERVER_LOST_SQLSTATES:
        ctx.is_disconnect = True


def create_engine(
    url: str, *, pool_size: int = 10, max_overflow: int = 10, **kwargs: Any
) -> AsyncEngine:
    # No pre-ping: it cost a round trip per transaction. A connection PostgreSQL
    # dropped fails at BEGIN, before anything of the transaction ran (Unavailable,
    # retryable), and that disconnect invalidates the whole pool, so the next
    # transactions reconnect.
    #
    # JIT off: the assigner's ranking query is estimated expensive enough for
    # PostgreSQL to JIT-compile it, which took 15-30 ms of a 3 ms execution, on
    # every assignment. Short OLTP statements never gain from it.
    #
    # Connecting: one host at a time (``_each_host``), through the asyncpg
    # dialect's hook for a connect function of one's own (``async_creator_fn``,
    # given the dialect's connect arguments from the URL).
    connect_args = dict(kwargs.pop("connect_args", {}))
    server_settings = {"jit": "off", **connect_args.get("server_settings", {})}
    connect_args["server_settings"] = server_settings
    raw_connect = _each_host(connect_timeout(url))
    connect_args.setdefault("async_creator_fn", raw_connect)
    engine = create_async_engine(
        async_url(url),
        pool_size=pool_size,
        max_overflow=max_overflow,
        connect_args=connect_args,
        **kwargs,
    )
    event.listen(engine.sync_engine, "handle_error", _mark_server_lost)
    _RAW_CONNECT[engine.sync_engine] = raw_connect
    return engine


#: The connect function of each engine made by :func:`create_engine`.
_RAW_CONNECT: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def raw_connect(engine: AsyncEngine) -> Any:
    """The connect function ``engine``'s pool uses (one host at a time, each for
    the URL's ``connect_timeout``): for a connection outside the pool, such as
    a LISTEN connection, that must find the primary as the pool does. Call it
    with the dialect's connect arguments. Plain ``asyncpg.connect`` for an
    engine made elsewhere."""
    import asyncpg

    return _RAW_CONNECT.get(engine.sync_engine, asyncpg.connect)


def invalidate_pool(engine: AsyncEngine, connection: Any) -> None:
    """Recycle, at their next checkout, every pooled connection made before
    ``connection`` (a pool's connection, whose server was found gone): what
    SQLAlchemy does itself on a disconnect, for failures it does not see (the
    driver's own path). Connections made after it, to a server that is up,
    are kept."""
    engine.sync_engine.pool._invalidate(connection, None, _checkin=False)


def redact(url: str) -> str:
    """The URL with any password hidden, for logs and messages."""
    try:
        return make_url(_multihost(url)).render_as_string(hide_password=True)
    except Exception:
        return "<unparseable database URL>"
