"""Read-only lookups of stored credential hashes, for the broker's
authentication (``transport/broker_auth.py``: the auth callout checks a
connecting host's or user's proof against them; ``transport/broker_config.py``:
a fallback-mode broker config lists every principal). The repository stays the
only writer of these columns.

The queries are the repository's too (``Repository.host_credential_hash`` runs
:func:`host_hash` inside its transaction), so there is one definition of which
stored hash a principal is checked against.
"""

from __future__ import annotations

from typing import Literal

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from fleetlease.persistence.tables import hosts, users

PrincipalKind = Literal["host", "user"]


async def host_hash(conn: AsyncConnection, host_id: str) -> bytes | None:
    """The stored SHA-256 of the host's credential; None if unknown or revoked."""
    query = sa.select(hosts.c.credential_hash).where(
        hosts.c.host_id == host_id, hosts.c.revoked_at.is_(None)
    )
    value = (await conn.execute(query)).scalar_one_or_none()
    return bytes(value) if value is not None else None


async def user_hash(conn: AsyncConnection, user: str) -> bytes | None:
    """The stored SHA-256 of the user's token; None if unknown."""
    query = sa.select(users.c.token_hash).where(users.c.name == user)
    value = (await conn.execute(query)).scalar_one_or_none()
    return bytes(value) if value is not None else None


async def principals(engine: AsyncEngine) -> list[tuple[PrincipalKind, str, bytes]]:
    """``(kind, name, stored hash)`` of every unrevoked host and every user."""
    async with engine.connect() as conn:
        host_rows = await conn.execute(
            sa.select(hosts.c.host_id, hosts.c.credential_hash).where(hosts.c.revoked_at.is_(None))
        )
        out: list[tuple[PrincipalKind, str, bytes]] = [("host", h, bytes(c)) for h, c in host_rows]
        user_rows = await conn.execute(sa.select(users.c.name, users.c.token_hash))
        out += [("user", u, bytes(t)) for u, t in user_rows]
    return out


class SqlCredentialStore:
    """The broker's ``CredentialStore`` on PostgreSQL: reads
    ``hosts.credential_hash`` / ``users.token_hash`` (read only)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def host_hash(self, host_id: str) -> bytes | None:
        async with self.engine.connect() as conn:
            return await host_hash(conn, host_id)

    async def user_hash(self, user: str) -> bytes | None:
        async with self.engine.connect() as conn:
            return await user_hash(conn, user)
