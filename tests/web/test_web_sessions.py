"""The console's session and sign-in limits against a real control plane: a
user's sessions are capped (their own least recently used ends, never another
user's), one user's sessions share one NATS connection, and sign-in attempts
are limited per user name and per client address without telling whether a
user exists. Connections are counted by nats-server itself (CONNZ through the
system account of the secured broker) and by the console's own registry."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import pytest

from fleetlease.ops.web.app import WebSettings
from fleetlease.ops.web.server import RunningConsole, start_console
from fleetlease.transport.broker_config import BrokerKeys
from tests.integration.test_ops_cli import System
from tests.web.conftest import SecureSystem
from tests.web.support import WebUser

WAIT_S = 30.0
#: Limits high enough not to get in the way of the tests of the session cap.
GENEROUS = {"sign_in_burst_per_user": 10_000, "sign_in_burst_per_address": 10_000}


async def until(probe: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {WAIT_S}s")
        await asyncio.sleep(0.1)


async def started(nats_url: str, prefix: str, **limits: Any) -> RunningConsole:
    return await start_console(
        WebSettings(nats_url=nats_url, prefix=prefix, timeout_s=20.0, **limits),
        host="127.0.0.1",
        port=0,
    )


async def fresh_sign_in(web: WebUser, user: str, token: str) -> int:
    """Signs in as a new browser would (no session cookie); the status."""
    web.client.cookies.clear()
    return (await web.sign_in(user, token)).status_code


async def signed_in(web: WebUser) -> bool:
    return (await web.get("/tasks")).status_code == 200


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
async def users(console_url: str) -> AsyncIterator[list[WebUser]]:
    """Browsers, each with its own cookies, made on demand."""
    made: list[WebUser] = []
    try:
        yield made
    finally:
        for web in made:
            await web.close()


@pytest.fixture
async def capped(system: System) -> AsyncIterator[RunningConsole]:
    running = await started(
        system.nats_url, system.prefix, max_sessions_per_user=16, max_sessions=40, **GENEROUS
    )
    try:
        yield running
    finally:
        await running.stop()


@pytest.fixture
def console_url(capped: RunningConsole) -> str:
    return capped.url


def browser(users: list[WebUser], url: str) -> WebUser:
    web = WebUser(url)
    users.append(web)
    return web


async def test_a_users_17th_sign_in_ends_only_their_own_oldest_session(
    system: System, capped: RunningConsole, users: list[WebUser]
) -> None:
    alice_token = await system.user("alice")
    admin = browser(users, capped.url)
    assert await fresh_sign_in(admin, "admin", system.admin_token) == 303
    alice = [browser(users, capped.url) for _ in range(17)]
    for web in alice[:16]:
        assert await fresh_sign_in(web, "alice", alice_token) == 303
    assert all([await signed_in(web) for web in alice[:16]])
    # alice[0] is now the least recently used again (alice[1..15] were used after it)
    for web in alice[1:16]:
        assert await signed_in(web)

    assert await fresh_sign_in(alice[16], "alice", alice_token) == 303

    assert not await signed_in(alice[0])
    assert all([await signed_in(web) for web in alice[1:]])
    assert await signed_in(admin)
    console = capped.console
    assert console.sessions.count("alice") == 16
    assert console.connections() == {"admin": 1, "alice": 1}


async def test_another_users_session_survives_a_flood_of_sign_ins_by_one_user(
    system: System, capped: RunningConsole, users: list[WebUser]
) -> None:
    alice_token = await system.user("alice")
    bob_token = await system.user("bob")
    admin, bob, flood = (browser(users, capped.url) for _ in range(3))
    assert await fresh_sign_in(admin, "admin", system.admin_token) == 303
    assert await fresh_sign_in(bob, "bob", bob_token) == 303
    fds, started_at = open_fds(), time.monotonic()

    for _ in range(200):
        assert await fresh_sign_in(flood, "alice", alice_token) == 303

    took = time.monotonic() - started_at
    figure = f"200 sign-ins of one user: {took:.1f}s, {open_fds() - fds:+d} open fds in the process"
    print(figure, file=sys.__stderr__)
    console = capped.console
    assert await signed_in(admin) and await signed_in(bob)
    assert (console.sessions.count("alice"), len(console.sessions)) == (16, 18)
    assert console.connections() == {"admin": 1, "alice": 1, "bob": 1}

    # A full console refuses a sign-in (503, a friendly page) rather than end a session.
    carol_token, dave_token = await system.user("carol"), await system.user("dave")
    late = browser(users, capped.url)
    for _ in range(16):
        assert await fresh_sign_in(late, "carol", carol_token) == 303
    for _ in range(40 - 18 - 16):
        assert await fresh_sign_in(late, "dave", dave_token) == 303
    late.client.cookies.clear()
    full = await late.sign_in("dave", dave_token)
    assert full.status_code == 503 and "too many open sessions" in full.text
    assert await signed_in(admin) and await signed_in(bob)


async def connz(url: str, keys: BrokerKeys) -> list[dict[str, Any]]:
    nc = await nats.connect(url, nkeys_seed_str=keys.system_seed)
    try:
        reply = await nc.request(
            "$SYS.REQ.SERVER.PING.CONNZ",
            json.dumps({"auth": True, "limit": 10_000}).encode(),
            timeout=WAIT_S,
        )
        body = json.loads(reply.data)
        assert "data" in body, body
        return list(body["data"]["connections"] or [])
    finally:
        await nc.close()


async def test_behind_a_secured_broker_the_console_holds_one_connection_per_signed_in_user(
    secure_system: SecureSystem, tmp_path: Path
) -> None:
    keys = BrokerKeys.load_or_create(tmp_path / "secure-state" / "broker")
    assert secure_system.service.repo is not None
    alice_token = await secure_system.service.repo.add_user("alice")
    running = await started(secure_system.nats_url, secure_system.prefix, **GENEROUS)
    webs: list[WebUser] = []

    async def console_connections() -> int:
        conns = await connz(secure_system.nats_url, keys)
        return sum(1 for c in conns if c.get("name") == "fleetlease-cli")

    try:
        for user, token, n in (("admin", secure_system.admin_token, 5), ("alice", alice_token, 3)):
            for _ in range(n):
                web = browser(webs, running.url)
                assert await fresh_sign_in(web, user, token) == 303
                assert await signed_in(web)
        # A wrong token on top opens no connection that stays.
        assert await fresh_sign_in(browser(webs, running.url), "alice", "0" * 64) == 401
        assert running.console.connections() == {"admin": 1, "alice": 1}
        await until(lambda: _equals(console_connections(), 2), "two console connections")

        for web in webs[5:8]:  # alice signs out everywhere
            csrf = await web.csrf()
            assert (await web.post("/logout", {"csrf": csrf})).status_code == 303

        assert running.console.connections() == {"admin": 1}
        await until(lambda: _equals(console_connections(), 1), "alice's connection closed")
        assert all([await signed_in(web) for web in webs[:5]])
    finally:
        for web in webs:
            await web.close()
        await running.stop()


async def _equals(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


async def test_sign_in_attempts_are_limited_per_name_and_address_alike_for_unknown_users(
    system: System,
) -> None:
    alice_token = await system.user("alice")
    running = await started(
        system.nats_url,
        system.prefix,
        sign_in_burst_per_user=3,
        sign_in_interval_per_user_s=3600.0,
        sign_in_burst_per_address=6,
        sign_in_interval_per_address_s=3600.0,
    )
    web = WebUser(running.url)
    try:
        for _ in range(3):
            assert await fresh_sign_in(web, "alice", alice_token) == 303
        web.client.cookies.clear()
        known = await web.sign_in("alice", alice_token)
        for _ in range(3):
            assert await fresh_sign_in(web, "nobody", alice_token) == 401
        web.client.cookies.clear()
        unknown = await web.sign_in("nobody", alice_token)
        web.client.cookies.clear()
        address = await web.sign_in("zed", alice_token)  # a fresh name, but the address is spent

        for refused in (known, unknown, address):
            assert refused.status_code == 429
            assert int(refused.headers["retry-after"]) > 0
            assert "Too many sign-in attempts" in refused.text
            assert "not accepted" not in refused.text
        # Nothing tells a known user from an unknown one.
        assert known.headers["retry-after"] == unknown.headers["retry-after"]
        assert running.console.sessions.count("alice") == 3
    finally:
        await web.close()
        await running.stop()


async def test_an_idle_session_expires_and_its_users_connection_closes_unprompted(
    system: System,
) -> None:
    running = await started(system.nats_url, system.prefix, session_idle_s=1.0, **GENEROUS)
    web = WebUser(running.url)
    try:
        assert await fresh_sign_in(web, "admin", system.admin_token) == 303
        assert running.console.connections() == {"admin": 1}

        async def closed() -> bool:  # no request comes in meanwhile: the sweep ends it
            return not running.console.connections() and len(running.console.sessions) == 0

        await until(closed, "the idle session and its connection end")
        assert (await web.get("/tasks")).status_code == 401
    finally:
        await web.close()
        await running.stop()
