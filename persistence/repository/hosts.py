"""Hosts and their sessions: credentials, registration, revocation, heartbeats
and device snapshots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence import credentials
from fleetlease.persistence.errors import Conflict, Invalid, NotFound, Unauthorized
from fleetlease.persistence.matching import advert_params, advert_stmt
from fleetlease.persistence.model import DeviceSnapshot, EndReason, Expired, HostAdvert, Session
from fleetlease.persistence.repository._sql import (
    _ACTIVE,
    _FENCE_COLUMNS,
    _devices_changed_stmt,
    _devices_gone_stmt,
    _devices_new_stmt,
    _host_alive_stmt,
    _host_row_stmt,
    _host_seen_stmt,
    _prebuilt,
)
from fleetlease.persistence.repository._tx import log
from fleetlease.persistence.repository._validate import (
    _check_devices,
    _check_host_id,
    _check_session,
)
from fleetlease.persistence.repository.expiry import ExpiryMixin
from fleetlease.persistence.repository.fencing import _unauthorized
from fleetlease.persistence.secrets import hash_secret, matches, new_token
from fleetlease.persistence.tables import attempts, hosts, tasks

_DUMMY_HASH = hash_secret("no such host")


class HostMixin(ExpiryMixin):
    """Hosts, sessions and device snapshots."""

    async def add_host(self, host_id: str) -> str:
        """Create a host; returns its raw credential once (only the hash stored).
        ``Conflict`` if it exists (unless revoked: then re-issued, and every older
        session generation stays dead)."""
        _check_host_id(host_id)
        credential = new_token()

        async def run(conn: AsyncConnection, now: datetime) -> str:
            ins = pg_insert(hosts).values(
                host_id=host_id, credential_hash=hash_secret(credential), created_at=now
            )
            stmt = ins.on_conflict_do_update(
                index_elements=[hosts.c.host_id],
                set_={
                    "credential_hash": ins.excluded.credential_hash,
                    "revoked_at": None,
                    "last_seen": None,
                    "session_generation": hosts.c.session_generation + 1,
                },
                where=hosts.c.revoked_at.is_not(None),
            ).returning(hosts.c.host_id)
            if (await conn.execute(stmt)).first() is None:
                raise Conflict("host exists", reason="exists", host_id=host_id)
            return credential

        return await self._tx("add_host", run)

    async def revoke_host(self, host_id: str) -> list[Expired]:
        """Revoke the credential and every session; active attempts of the host end
        (retry policy, end reason ``host_revoked``) and their reservations are
        released. Revoking a revoked host changes nothing and returns []."""
        _check_host_id(host_id)

        async def run(conn: AsyncConnection, now: datetime) -> list[Expired]:
            host = (
                await conn.execute(
                    sa.select(hosts.c.revoked_at)
                    .where(hosts.c.host_id == host_id)
                    .with_for_update()
                )
            ).first()
            if host is None:
                raise NotFound("no such host", host_id=host_id)
            if host.revoked_at is not None:
                return []
            await conn.execute(
                hosts.update().where(hosts.c.host_id == host_id).values(revoked_at=now)
            )
            rows = await self._lock_active_of_host(conn, host_id, _ACTIVE)
            endings = [self._ending(r, now, EndReason.HOST_REVOKED, "host_revoked") for r in rows]
            await self._apply_endings(conn, now, endings)
            log.info("host.revoked", host_id=host_id, ended=len(endings))
            return [e.expired() for e in endings]

        return await self._tx("revoke_host", run)

    async def _lock_active_of_host(
        self, conn: AsyncConnection, host_id: str, states: Sequence[str]
    ) -> Sequence[RowMapping]:
        return (
            (
                await conn.execute(
                    sa.select(*_FENCE_COLUMNS)
                    .select_from(
                        tasks.join(
                            attempts,
                            sa.and_(
                                attempts.c.task_id == tasks.c.id,
                                attempts.c.number == tasks.c.attempt,
                            ),
                        )
                    )
                    .where(attempts.c.host_id == host_id, tasks.c.status.in_(states))
                    .order_by(tasks.c.id)
                    .with_for_update(of=[tasks, attempts])
                )
            )
            .mappings()
            .all()
        )

    async def register_session(self, host_id: str, credential: str) -> Session:
        """Check the credential (constant time) and start generation n+1; every older
        generation is dead. ``Unauthorized`` for unknown host, wrong credential or
        revoked host (same message for all three)."""
        if not isinstance(host_id, str) or not isinstance(credential, str):
            raise Unauthorized("invalid host credentials")

        async def run(conn: AsyncConnection, now: datetime) -> Session:
            row = (
                await conn.execute(
                    sa.select(hosts.c.credential_hash, hosts.c.revoked_at)
                    .where(hosts.c.host_id == host_id)
                    .with_for_update()
                )
            ).first()
            ok = matches(credential, row.credential_hash if row else _DUMMY_HASH)
            if row is None or not ok or row.revoked_at is not None:
                raise Unauthorized("invalid host credentials")
            generation = (
                await conn.execute(
                    hosts.update()
                    .where(hosts.c.host_id == host_id)
                    .values(
                        session_generation=hosts.c.session_generation + 1,
                        session_started_at=now,
                        last_seen=now,
                        # A new session sends its complete snapshot first.
                        devices_digest=None,
                        devices_synced_at=None,
                    )
                    .returning(hosts.c.session_generation)
                )
            ).scalar_one()
            log.info("host.registered", host_id=host_id, generation=generation)
            return Session(host_id=host_id, generation=generation)

        return await self._tx("register_session", run)

    async def host_credential_hash(self, host_id: str) -> bytes | None:
        """The stored SHA-256 of the host's credential (None if unknown or revoked),
        read only: what a register proof is opened with (``transport.host_handlers``)."""
        if not isinstance(host_id, str):
            raise Invalid("host_id must be a string", field="host_id")

        async def run(conn: AsyncConnection, now: datetime) -> bytes | None:
            return await credentials.host_hash(conn, host_id)

        return await self._tx("host_credential_hash", run)

    async def current_generation(self, host_id: str) -> int | None:
        """The host's current session generation (None if unknown, revoked or never
        registered)."""
        if not isinstance(host_id, str):
            raise Invalid("host_id must be a string", field="host_id")

        async def run(conn: AsyncConnection, now: datetime) -> int | None:
            row = (
                await conn.execute(_prebuilt("host_row", _host_row_stmt), {"host_id": host_id})
            ).first()
            if row is None or row.revoked_at is not None or row.session_generation <= 0:
                return None
            return int(row.session_generation)

        return await self._tx("current_generation", run, autocommit=True, driver=True)

    async def heartbeat(
        self,
        session: Session,
        devices: Sequence[DeviceSnapshot],
        advert: HostAdvert | None = None,
        *,
        digest: str | None = None,
    ) -> None:
        """Refresh last_seen and make this host's device records the snapshot's:
        rows of devices gone from it deleted, changed ones rewritten, new ones
        inserted; an unchanged row is neither written nor locked. With
        ``advert``, store what the host serves (see ``persistence.matching``).
        ``digest`` is the host's tag of this snapshot, kept for
        :meth:`heartbeat_unchanged`."""
        _check_session(session)
        snapshot = _check_devices(devices)
        _check_digest(digest)
        try:
            advertised = None if advert is None else advert_params(session.host_id, advert)
        except ValueError as exc:
            raise Invalid(str(exc), field="advert") from None

        async def run(conn: AsyncConnection, now: datetime) -> None:
            seen = (
                await conn.execute(
                    _prebuilt("host_seen", _host_seen_stmt),
                    {
                        "p_host_id": session.host_id,
                        "p_generation": session.generation,
                        "p_now": now,
                        "p_digest": digest,
                    },
                )
            ).first()
            if seen is None:
                raise _unauthorized(session)
            if advertised is not None:
                await conn.execute(_prebuilt("host_advert", advert_stmt), advertised)
            await self._replace_devices(conn, now, session.host_id, snapshot)

        await self._tx("heartbeat", run, driver=True)

    async def heartbeat_unchanged(self, session: Session, digest: str) -> None:
        """A heartbeat without a snapshot: the host's is still the one its last
        complete heartbeat of this session tagged ``digest``. Refreshes
        last_seen only (one row). ``Conflict`` (reason ``snapshot_unknown``),
        nothing written, when the stored tag is another or none (the control
        plane clears it whenever it changes one of the host's device rows: a
        device held at an expiry, or freed by a result), or a device row of the
        host changed since it was written: the host then sends its complete
        snapshot."""
        _check_session(session)
        _check_digest(digest)
        if digest is None:
            raise Invalid("digest is required", field="digest")

        async def run(conn: AsyncConnection, now: datetime) -> None:
            alive = (
                await conn.execute(
                    _prebuilt("host_alive", _host_alive_stmt),
                    {
                        "p_host_id": session.host_id,
                        "p_generation": session.generation,
                        "p_now": now,
                        "p_digest": digest,
                    },
                )
            ).first()
            if alive is not None:
                return
            row = (
                await conn.execute(
                    _prebuilt("host_row", _host_row_stmt), {"host_id": session.host_id}
                )
            ).first()
            if (
                row is None
                or row.revoked_at is not None
                or row.session_generation != session.generation
            ):
                raise _unauthorized(session)
            raise _snapshot_unknown(session)

        # One conditional write, atomic by itself: no BEGIN / COMMIT round trips.
        await self._tx("heartbeat_unchanged", run, autocommit=True, driver=True)

    async def _replace_devices(
        self, conn: AsyncConnection, now: datetime, host_id: str, snapshot: list[DeviceSnapshot]
    ) -> None:
        # Device order, as every statement that locks several device rows uses.
        snapshot = sorted(snapshot, key=lambda d: d.device_id)
        ids = [d.device_id for d in snapshot]
        await conn.execute(
            _prebuilt("devices_gone", _devices_gone_stmt), {"p_host_id": host_id, "p_ids": ids}
        )
        if not snapshot:
            return
        # Unchanged rows are not rewritten (nor locked): updated_at is the time
        # of the last change.
        rows = {
            "p_host_id": host_id,
            "p_now": now,
            "r_device_id": ids,
            "r_state": [d.state for d in snapshot],
            "r_capabilities": [json.dumps(d.capabilities) for d in snapshot],
        }
        await conn.execute(_prebuilt("devices_changed", _devices_changed_stmt), rows)
        await conn.execute(_prebuilt("devices_new", _devices_new_stmt), rows)


def _check_digest(digest: object) -> None:
    if digest is not None and (not isinstance(digest, str) or not 0 < len(digest) <= 128):
        raise Invalid("digest must be a string of 1-128 characters", field="digest")


def _snapshot_unknown(session: Session) -> Conflict:
    """``heartbeat_unchanged``'s refusal: the stored digest is another, or a
    device row of the host changed since it was written."""
    return Conflict(
        "device snapshot unknown: send the complete snapshot",
        reason="snapshot_unknown",
        host_id=session.host_id,
    )
