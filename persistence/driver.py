"""SQLAlchemy Core statements executed on the driver's (asyncpg) connection.

The repository builds its hot statements once (``_prebuilt``) and runs them
many times. SQLAlchemy's execution layer around each run (the compiled-cache
lookup, parameter processing, the DBAPI adaptation, the result metadata) is a
sizeable share of the control plane's CPU per task. Here a statement is
compiled once, for the engine's dialect, into its SQL text, the order of its
parameters and the processors of its binds and result columns; each run then
binds, runs the statement prepared once per connection on the asyncpg
connection and wraps the records in rows with the same access as SQLAlchemy's
(attribute, index, ``_mapping``; ``mappings()``, ``scalars()``, ``first()``,
...). ``docs/performance.md`` has what this saves per statement.

The SQL is SQLAlchemy's own compilation, so there is one statement to keep in
step with the schema, not a hand-written copy. Driver errors are translated
into SQLAlchemy's exception types (``sa.exc.IntegrityError``, ...), so the
repository's error mapping is unchanged. A statement that is not prebuilt is
compiled on every run (correct, only not faster); one whose SQL is completed
at each run (``IN`` with a list of values) is completed by SQLAlchemy's
``construct_expanded_state``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import asyncpg
import sqlalchemy as sa
from sqlalchemy.engine import Dialect

_STATUS_COUNT = re.compile(r"(?:SELECT|UPDATE|DELETE|INSERT \d+|MERGE) (\d+)")


class DriverRow(tuple[Any, ...]):
    """A row: a tuple, with its columns as attributes and ``_mapping``."""

    __slots__ = ()
    _keys: tuple[str, ...] = ()
    _index: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        try:
            return tuple.__getitem__(self, type(self)._index[name])
        except KeyError:
            raise AttributeError(name) from None

    @property
    def _mapping(self) -> dict[str, Any]:
        return dict(zip(self._keys, self, strict=True))

    def _asdict(self) -> dict[str, Any]:
        return self._mapping


def _row_class(keys: tuple[str, ...]) -> type[DriverRow]:
    return type(
        "DriverRow",
        (DriverRow,),
        {"__slots__": (), "_keys": keys, "_index": {k: i for i, k in enumerate(keys)}},
    )


class _Compiled:
    """One statement compiled for the dialect: SQL, parameter order, processors."""

    __slots__ = (
        "bind_procs",
        "compiled",
        "entries",
        "expanding",
        "keys",
        "order",
        "procs",
        "row_cls",
        "sql",
        "static",
        "stmt",
        "typed",
    )

    def __init__(self, stmt: Any, dialect: Dialect, keys: tuple[str, ...]) -> None:
        compiled = stmt.compile(dialect=dialect, column_keys=list(keys))
        sql = compiled.string
        #: SQL completed at each run (``IN`` with a list: one parameter each),
        #: or a bind computed at each run: SQLAlchemy's own path for those.
        self.expanding = "POSTCOMPILE" in sql
        self.compiled = compiled
        self.stmt = stmt
        self.sql = sql
        self.order: tuple[str, ...] = tuple(compiled.positiontup or ())
        self.bind_procs: dict[str, Any] = dict(compiled._bind_processors)
        # Values bound in the statement itself (a literal compared with a
        # column, say): used unless the caller gives that name.
        self.static: dict[str, Any] = {}
        for bind, name in compiled.bind_names.items():
            if bind.callable is not None:  # a value computed at each run
                self.expanding = True
            elif not bind.required:
                self.static[name] = bind.effective_value
        self.entries = compiled._result_columns
        self.keys: tuple[str, ...] = tuple(e.keyname for e in self.entries)
        #: The result columns' processors, known once the statement is prepared
        #: (they depend on the column types the server reports).
        self.procs: list[Any] | None = None
        self.typed = False
        self.row_cls = _row_class(self.keys)

    def sql_and_args(self, params: Mapping[str, Any] | None) -> tuple[str, list[Any]]:
        if not self.expanding:
            return self.sql, self.args(params)
        state = self.compiled.construct_expanded_state(dict(params or {}), escape_names=False)
        procs = state.processors
        args = []
        for name in state.positiontup or ():
            value = state.parameters[name]
            proc = procs.get(name)
            args.append(proc(value) if proc is not None and value is not None else value)
        return state.statement, args

    def args(self, params: Mapping[str, Any] | None) -> list[Any]:
        params = params or {}
        out = []
        static, procs = self.static, self.bind_procs
        for name in self.order:
            if name in params:
                value = params[name]
            elif name in static:
                value = static[name]
            else:
                raise sa.exc.ArgumentError(f"a value is required for bind parameter {name!r}")
            proc = procs.get(name)
            out.append(proc(value) if proc is not None and value is not None else value)
        return out

    def type_results(self, prepared: Any, dialect: Dialect) -> None:
        attrs = prepared.get_attributes()
        if len(attrs) == len(self.entries):
            procs = [
                e.type._cached_result_processor(dialect, a.type.oid)
                for e, a in zip(self.entries, attrs, strict=True)
            ]
            self.procs = procs if any(procs) else None
        elif attrs:
            # Not SQLAlchemy's idea of the result (a textual statement): the
            # server's names, values as the driver gives them.
            self.keys = tuple(a.name for a in attrs)
            self.row_cls = _row_class(self.keys)
        self.typed = True

    def row(self, record: Sequence[Any]) -> DriverRow:
        procs = self.procs
        if procs is None:
            return self.row_cls(record)
        return self.row_cls(
            v if p is None or v is None else p(v) for p, v in zip(procs, record, strict=True)
        )


class _Values:
    """A list with SQLAlchemy's accessors (``scalars()``, ``mappings()``)."""

    __slots__ = ("_values",)

    def __init__(self, values: list[Any]) -> None:
        self._values = values

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def all(self) -> list[Any]:
        return list(self._values)

    def first(self) -> Any:
        return self._values[0] if self._values else None

    def one_or_none(self) -> Any:
        if len(self._values) > 1:
            raise sa.exc.MultipleResultsFound("more than one row where one or none was required")
        return self.first()

    def one(self) -> Any:
        if not self._values:
            raise sa.exc.NoResultFound("No row was found when one was required")
        return self.one_or_none()


class DriverResult(_Values):
    """The slice of SQLAlchemy's ``CursorResult`` the repository uses: its rows,
    with ``_Values``' accessors, plus the row count and the scalar forms."""

    __slots__ = ("rowcount",)

    def __init__(self, rows: list[DriverRow], rowcount: int) -> None:
        super().__init__(rows)
        self.rowcount = rowcount

    fetchall = _Values.all

    def scalar(self) -> Any:
        return self._values[0][0] if self._values else None

    def scalar_one(self) -> Any:
        return self.one()[0]

    def scalar_one_or_none(self) -> Any:
        row = self.one_or_none()
        return None if row is None else row[0]

    def scalars(self) -> _Values:
        return _Values([r[0] for r in self._values])

    def mappings(self) -> _Values:
        return _Values([r._mapping for r in self._values])


#: Compiled statements by identity (the parameters' names, the server's
#: version). Prebuilt statements live as long as the process, and the entry
#: holds the statement, so an id is never reused.
_COMPILED: dict[tuple[int, tuple[str, ...], Any], _Compiled] = {}
_INFO_KEY = "fleetlease.prepared"


class DriverConnection:
    """What a repository transaction's function is given instead of an
    ``AsyncConnection``: ``execute``, ``scalar`` and ``scalars`` of Core
    statements, on the driver's connection. ``prebuilt`` says which statements
    may be compiled once and kept (the repository's ``_prebuilt`` ones)."""

    __slots__ = ("_prebuilt", "_prepared", "dialect", "raw")

    def __init__(
        self, raw: asyncpg.Connection, dialect: Dialect, prebuilt: Any, prepared: dict[str, Any]
    ) -> None:
        self.raw = raw
        self.dialect = dialect
        self._prebuilt = prebuilt
        self._prepared = prepared

    @classmethod
    async def of(cls, conn: Any, prebuilt: Any) -> DriverConnection:
        """The driver connection under ``conn`` (a SQLAlchemy ``AsyncConnection``).
        Its prepared statements are kept in the pool's ``info`` of that
        connection, which lives and is discarded with it (a prepared statement
        refers to its connection: a cache outside would keep every connection
        the pool ever discarded alive)."""
        fairy = await conn.get_raw_connection()
        prepared = fairy.info.get(_INFO_KEY)
        if prepared is None:
            prepared = fairy.info[_INFO_KEY] = {}
        return cls(fairy.driver_connection, conn.dialect, prebuilt, prepared)

    def _compiled(self, stmt: Any, params: Mapping[str, Any] | None) -> _Compiled:
        # As SQLAlchemy does, an INSERT or UPDATE without values of its own sets
        # the columns the parameters name (the others take their defaults).
        # The server's version too: the dialect may compile for it.
        keys = tuple(sorted(params)) if params else ()
        cache_key = (id(stmt), keys, self.dialect.server_version_info)
        entry = _COMPILED.get(cache_key)
        if entry is not None and entry.stmt is stmt:
            return entry
        entry = _Compiled(stmt, self.dialect, keys)
        if self._prebuilt(stmt):
            _COMPILED[cache_key] = entry
        return entry

    async def execute(self, stmt: Any, params: Mapping[str, Any] | None = None) -> DriverResult:
        if params is not None and not isinstance(params, Mapping):
            raise TypeError("the driver runs a statement with one mapping of parameters")
        comp = self._compiled(stmt, params)
        sql, args = comp.sql_and_args(params)
        try:
            try:
                prepared, records = await self._run(comp, sql, args)
            except asyncpg.InvalidCachedStatementError:
                # The schema changed under a prepared statement (a migration
                # by another process): forget this connection's, and run
                # again if no transaction was aborted by it.
                self._prepared.clear()
                if self.raw.is_in_transaction():
                    raise
                prepared, records = await self._run(comp, sql, args)
        except asyncpg.PostgresError as exc:
            raise self._translate(exc, sql, args) from exc
        match = _STATUS_COUNT.match(prepared.get_statusmsg() or "")
        return DriverResult([comp.row(r) for r in records], int(match.group(1)) if match else -1)

    async def _run(self, comp: _Compiled, sql: str, args: list[Any]) -> tuple[Any, list[Any]]:
        prepared = self._prepared.get(sql)
        if prepared is None:
            prepared = await self.raw.prepare(sql)
            if len(self._prepared) >= 256:
                self._prepared.clear()  # a rare refill is cheap
            self._prepared[sql] = prepared
        if not comp.typed:
            comp.type_results(prepared, self.dialect)
        return prepared, await prepared.fetch(*args)

    async def scalar(self, stmt: Any, params: Mapping[str, Any] | None = None) -> Any:
        return (await self.execute(stmt, params)).scalar()

    async def scalars(self, stmt: Any, params: Mapping[str, Any] | None = None) -> _Values:
        return (await self.execute(stmt, params)).scalars()

    def _translate(self, exc: asyncpg.PostgresError, sql: str, args: list[Any]) -> Exception:
        """The driver's error as SQLAlchemy raises it (``sa.exc.IntegrityError``
        for a foreign key violation, ...), its ``orig`` carrying the SQLSTATE."""
        dbapi = self.dialect.dbapi
        orig: Exception = exc
        for cls in type(exc).__mro__:
            translate = dbapi._asyncpg_error_translate.get(cls)  # type: ignore[union-attr]
            if translate is not None:
                orig = translate(exc.args[0] if exc.args else str(exc), exc)
                break
        return sa.exc.DBAPIError.instance(
            sql,
            args,
            orig,
            dbapi.Error,  # type: ignore[union-attr]
            hide_parameters=True,
            dialect=self.dialect,
        )
