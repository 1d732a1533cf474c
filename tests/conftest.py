"""Test fixtures: a real PostgreSQL and a real nats-server, never mocks.

The servers named by FLEETLEASE_TEST_DATABASE_URL / FLEETLEASE_TEST_NATS_URL are
used when set; otherwise embedded ones are started once per test session. Every
test gets its own database, copied from a migrated template (procrastinate's
approach), and its own NATS subject prefix.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import json
import os
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
import structlog
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.ops.embedded import EmbeddedNats, EmbeddedPostgres
from fleetlease.persistence.clock import ManualClock
from fleetlease.persistence.db import async_url, create_engine

T = TypeVar("T")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", help="run the long soak tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="soak test: run with --soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Collect the last test's garbage before the terminal summary: objects
    whose finalizers report (unclosed transports, pending tasks of a closed
    event loop) would otherwise run inside the ``ast.parse`` of a plugin's
    late import, where CPython 3.11 raises "AST constructor recursion depth
    mismatch" and the session ends with an internal error."""
    gc.collect()


@pytest.fixture(autouse=True)
def _structlog_restored() -> Iterator[None]:
    """Each test starts with the logging configuration the session had: a CLI
    run in-process configures structlog to print to the ``sys.stderr`` of that
    moment, which is pytest's capture of that one test, closed after it."""
    saved = structlog.get_config()
    yield
    structlog.reset_defaults()
    structlog.configure(**saved)


def run_async(fn: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion on a private loop in another thread, so that
    it works from sync fixtures whatever loop pytest-asyncio has around."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(fn())).result()  # type: ignore[arg-type]


def with_database(url: str, database: str) -> str:
    u = make_url(async_url(url))
    return u.set(database=database).render_as_string(hide_password=False)


async def _admin(url: str, *statements: str) -> None:
    import asyncpg

    u = make_url(async_url(url))
    conn = await asyncpg.connect(
        user=u.username,
        password=u.password,
        database=u.database,
        host=u.query.get("host") or u.host,
        port=u.port,
    )
    try:
        for sql in statements:
            await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def pg_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a PostgreSQL server database where we may create databases."""
    url = os.environ.get("FLEETLEASE_TEST_DATABASE_URL")
    if url:
        yield url
        return
    pg = EmbeddedPostgres(tmp_path_factory.mktemp("embedded-pg"), database="postgres")
    pg.start()
    try:
        yield pg.url
    finally:
        pg.stop("immediate")


@pytest.fixture(scope="session")
def template_database(pg_server_url: str) -> Iterator[str]:
    """A migrated database that every test's database is copied from."""
    from fleetlease.persistence.migrate import upgrade

    name = f"fl_tpl_{uuid.uuid4().hex[:10]}"
    run_async(lambda: _admin(pg_server_url, f'CREATE DATABASE "{name}"'))
    run_async(lambda: upgrade(with_database(pg_server_url, name)))
    try:
        yield name
    finally:
        run_async(lambda: _admin(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def db_url(pg_server_url: str, template_database: str) -> Iterator[str]:
    """URL of a fresh, migrated database for this test only."""
    name = f"fl_t_{uuid.uuid4().hex[:12]}"
    run_async(
        lambda: _admin(pg_server_url, f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    )
    try:
        yield with_database(pg_server_url, name)
    finally:
        run_async(lambda: _admin(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = create_engine(db_url, pool_size=20, max_overflow=60)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get("FLEETLEASE_TEST_NATS_URL")
    if url:
        # A shared server keeps what runs killed mid-test left behind.
        run_async(lambda: _drop_stale_test_streams(url))
        yield url
        return
    server = EmbeddedNats(tmp_path_factory.mktemp("embedded-nats"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def subject_prefix(request: pytest.FixtureRequest) -> Iterator[str]:
    """A subject prefix of this test's own, so tests sharing a server never meet.
    Afterwards the prefix's JetStream streams (artifact staging and the artifact
    object store) are deleted from the test NATS server, if the test made them:
    a file stream's byte cap is reserved on the server for as long as it exists."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    yield prefix
    if "nats_url" in request.fixturenames:
        url = request.getfixturevalue("nats_url")
        run_async(lambda: _drop_staging(url, prefix))


async def _drop_staging(url: str, prefix: str) -> None:
    import nats
    from nats.errors import Error as NatsError

    try:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
    except Exception:  # a secured or stopped server: nothing of ours to drop
        return
    try:
        js = nc.jetstream(timeout=5)
        for stream in _test_streams(prefix):
            with contextlib.suppress(NatsError, TimeoutError):  # none made, or no JetStream
                await js.delete_stream(stream)
    finally:
        await nc.close()


def _test_streams(prefix: str) -> list[str]:
    return [f"FLEETLEASE_UPLOADS_{prefix}", f"OBJ_fleetlease-artifacts-{prefix}"]


#: A test's own prefix (``subject_prefix``), as it appears in its stream names.
_TEST_STREAM = re.compile(r"^(FLEETLEASE_UPLOADS_|OBJ_fleetlease-artifacts-)t[0-9a-f]{12}$")


async def _drop_stale_test_streams(url: str, idle_s: float = 1800.0) -> None:
    """Delete the streams of test prefixes untouched for ``idle_s`` (a run
    killed mid-test never dropped them; a run in progress touches its own).
    Read through the JetStream API itself: its replies carry the times."""
    import nats

    try:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
    except Exception:
        return

    async def api(subject: str, body: dict[str, object] | None = None) -> dict[str, Any]:
        msg = await nc.request(f"$JS.API.{subject}", json.dumps(body or {}).encode(), timeout=10)
        reply: dict[str, Any] = json.loads(msg.data)
        return reply

    try:
        names: list[str] = []
        offset = 0
        while True:
            page = await api("STREAM.NAMES", {"offset": offset})
            batch = page.get("streams") or []
            names += batch
            offset += len(batch)
            if not batch or offset >= int(page.get("total", 0)):
                break
        now = datetime.now(UTC)
        for name in names:
            if not _TEST_STREAM.match(name):
                continue
            info = await api(f"STREAM.INFO.{name}")
            last = (info.get("state") or {}).get("last_ts") or info.get("created")
            if not isinstance(last, str):
                continue
            seen = _rfc3339(last)
            if seen is not None and (now - seen).total_seconds() > idle_s:
                await api(f"STREAM.DELETE.{name}")
    except Exception:  # best effort: a leftover stream costs reservation, not correctness
        pass
    finally:
        await nc.close()


def _rfc3339(text: str) -> datetime | None:
    """nats-server's times (nanosecond fractions, ``Z``) as datetimes."""
    m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z$", text)
    if m is None:
        return None
    micros = (m.group(2) or "0")[:6].ljust(6, "0")
    return datetime.fromisoformat(f"{m.group(1)}.{micros}+00:00")


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir()
    return d
