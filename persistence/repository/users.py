"""Users and projects: tokens, roles, and who may see or act on a task."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.errors import Conflict, Forbidden, Invalid, NotFound, Unauthorized
from fleetlease.persistence.model import User
from fleetlease.persistence.repository._sql import _PROJECT_ROLE_SQL, _USER_BY_TOKEN_SQL
from fleetlease.persistence.repository._tx import Transactions
from fleetlease.persistence.repository._validate import _check_str
from fleetlease.persistence.secrets import hash_secret, new_token
from fleetlease.persistence.tables import project_admins, projects, tasks, users


class UserMixin(Transactions):
    """Users, projects and access rules."""

    async def _require_names(
        self, conn: AsyncConnection, table: sa.Table, names: set[str], field: str
    ) -> None:
        found = set(
            (await conn.execute(sa.select(table.c.name).where(table.c.name.in_(names)))).scalars()
        )
        missing = names - found
        if missing:
            raise NotFound(f"no such {field}: {sorted(missing)[0]}", field=field)

    async def add_user(self, name: str, *, platform_admin: bool = False) -> str:
        """Returns the raw user token once. ``Conflict`` if the name is taken."""
        _check_str(name, "name", max_len=128)
        if not isinstance(platform_admin, bool):
            raise Invalid("platform_admin must be a boolean", field="platform_admin")
        token = new_token()

        async def run(conn: AsyncConnection, now: datetime) -> str:
            inserted = (
                await conn.execute(
                    pg_insert(users)
                    .values(
                        name=name,
                        token_hash=hash_secret(token),
                        platform_admin=platform_admin,
                        created_at=now,
                    )
                    .on_conflict_do_nothing()
                    .returning(users.c.name)
                )
            ).first()
            if inserted is None:
                raise Conflict("user exists", reason="exists", name=name)
            return token

        return await self._tx("add_user", run)

    async def add_project(self, name: str, *, owner: str, admins: Sequence[str] = ()) -> None:
        """``Conflict`` if it exists; ``NotFound(field='owner'|'admins')`` for an
        unknown user."""
        _check_str(name, "name", max_len=128)
        _check_str(owner, "owner", max_len=128)
        if isinstance(admins, str) or not all(isinstance(a, str) for a in admins):
            raise Invalid("admins must be a sequence of user names", field="admins")
        admin_set = set(admins)

        async def run(conn: AsyncConnection, now: datetime) -> None:
            await self._require_names(conn, users, {owner}, "owner")
            await self._require_names(conn, users, admin_set, "admins")
            inserted = (
                await conn.execute(
                    pg_insert(projects)
                    .values(name=name, owner=owner, created_at=now)
                    .on_conflict_do_nothing()
                    .returning(projects.c.name)
                )
            ).first()
            if inserted is None:
                raise Conflict("project exists", reason="exists", name=name)
            if admin_set:
                await conn.execute(
                    project_admins.insert(),
                    [{"project": name, "user_name": a} for a in sorted(admin_set)],
                )

        await self._tx("add_project", run)

    async def authenticate_user(self, token: str) -> User:
        """``Unauthorized`` for an unknown token. The stored value is the SHA-256 of a
        256-bit random token, so looking it up by hash leaks nothing useful."""
        if not isinstance(token, str) or not token:
            raise Unauthorized("invalid user token")

        async def run(raw: Any, now: datetime) -> User:
            row = await raw.fetchrow(_USER_BY_TOKEN_SQL, hash_secret(token))
            if row is None:
                raise Unauthorized("invalid user token")
            return User(name=row["name"], platform_admin=row["platform_admin"])

        # Every user request starts here: one statement on the driver's
        # connection, with no BEGIN/COMMIT and no SQLAlchemy execution layer.
        return await self._raw("authenticate_user", run)

    async def check_submit_role(self, user: User, project: str) -> None:
        """Submitting into a project needs a role on it (owner, project admin or
        platform admin): ``NotFound`` for an unknown project, ``Forbidden``
        without a role. One read; the submit itself re-checks the project."""
        if not isinstance(project, str) or not project:
            raise Invalid("project must be a non-empty string", field="project")

        async def run(raw: Any, now: datetime) -> Any:
            return await raw.fetchrow(_PROJECT_ROLE_SQL, project, user.name)

        # One statement on the driver's connection, as ``authenticate_user``.
        row = await self._raw("check_submit_role", run)
        if row is None:
            raise NotFound(f"no project {project!r}", field="project")
        if user.platform_admin or row["owner"] == user.name or row["is_admin"]:
            return
        raise Forbidden(f"you have no role on project {project!r}", field="project")

    @staticmethod
    def _visible(user: User) -> sa.ColumnElement[bool]:
        if user.platform_admin:
            return sa.true()
        return sa.or_(
            tasks.c.owner == user.name,
            tasks.c.project.in_(sa.select(projects.c.name).where(projects.c.owner == user.name)),
            tasks.c.project.in_(
                sa.select(project_admins.c.project).where(project_admins.c.user_name == user.name)
            ),
        )

    async def _may_access(
        self, conn: AsyncConnection, user: User, owner: str, project: str
    ) -> bool:
        if user.platform_admin or owner == user.name:
            return True
        role = (
            await conn.execute(
                sa.select(sa.literal(1))
                .select_from(projects)
                .where(
                    projects.c.name == project,
                    sa.or_(
                        projects.c.owner == user.name,
                        sa.exists().where(
                            project_admins.c.project == project,
                            project_admins.c.user_name == user.name,
                        ),
                    ),
                )
            )
        ).first()
        return role is not None

    async def _authorize_task(self, conn: AsyncConnection, task_id: str, user: User) -> RowMapping:
        row = (await conn.execute(sa.select(tasks).where(tasks.c.id == task_id))).mappings().first()
        if row is None:
            raise NotFound("no such task", task_id=task_id)
        if not await self._may_access(conn, user, row["owner"], row["project"]):
            raise Forbidden("not allowed to read this task", task_id=task_id)
        return row
