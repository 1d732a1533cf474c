"""Engine creation and URL handling."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine


def async_url(url: str) -> str:
    """Accept ``postgresql://``, ``postgres://`` or ``postgresql+asyncpg://`` URLs
    (including unix-socket ones, ``?host=/path``) and return the asyncpg form."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    u = make_url(url)
    if u.drivername in ("postgresql", "postgresql+psycopg2", "postgresql+psycopg"):
        u = u.set(drivername="postgresql+asyncpg")
    if u.drivername != "postgresql+asyncpg":
        raise ValueError(f"unsupported database URL scheme {u.drivername!r}: use postgresql://")
    return u.render_as_string(hide_password=False)


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
    connect_args = dict(kwargs.pop("connect_args", {}))
    server_settings = {"jit": "off", **connect_args.get("server_settings", {})}
    connect_args["server_settings"] = server_settings
    return create_async_engine(
        async_url(url),
        pool_size=pool_size,
        max_overflow=max_overflow,
        connect_args=connect_args,
        **kwargs,
    )


def redact(url: str) -> str:
    """The URL with any password hidden, for logs and messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparseable database URL>"
