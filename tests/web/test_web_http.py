"""The web console over plain HTTP (httpx against the console served by uvicorn,
or in process where no control plane is needed): sign-in, 401 and
403 handling, CSRF on every state-changing request, the event stream, and a
scan of every response for secrets and host paths."""

from __future__ import annotations

import asyncio
import hashlib
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from fleetlease.ops.web.app import SECURITY_HEADERS, Console, WebSettings, create_app
from fleetlease.ops.web.server import RunningConsole, start_console
from fleetlease.ops.web.sessions import SESSION_COOKIE
from fleetlease.persistence import tables as t
from fleetlease.persistence.model import TaskKind, TaskSpec
from tests.integration.test_ops_cli import SimHost, System, _forms
from tests.web.conftest import SecureSystem
from tests.web.support import WebUser

HANG = '{"sim": {"outcome": "hang"}}'


@pytest.fixture
async def web(console: RunningConsole) -> AsyncIterator[WebUser]:
    user = WebUser(console.url)
    try:
        yield user
    finally:
        await user.close()


@pytest.fixture
async def other(console: RunningConsole) -> AsyncIterator[WebUser]:
    """A second browser, for a second user."""
    user = WebUser(console.url)
    try:
        yield user
    finally:
        await user.close()


async def owner_of_a_project(system: System, name: str) -> str:
    """A new user who owns the project of the same name (so may submit into it)."""
    token = await system.user(name)
    run = await system.cli("project", "add", name, "--owner", name, token=system.admin_token)
    assert run.code == 0, run.err
    return token


async def cancel_requested(system: System, task_id: str) -> tuple[str, bool]:
    rows = await system.rows(
        sa.select(t.tasks.c.status, t.tasks.c.cancel_requested_at).where(t.tasks.c.id == task_id)
    )
    status, at = rows[0]
    return str(status), at is not None


# --- sign-in and 401 --------------------------------------------------------------------------


async def test_without_a_session_every_page_answers_401_with_the_sign_in_page(
    system: System, web: WebUser
) -> None:
    some_task = str(uuid.uuid4())
    for path in ("/", "/tasks", "/tasks?state=done", f"/tasks/{some_task}"):
        r = await web.get(path)
        assert r.status_code == 401, path
        assert 'action="/login"' in r.text and "Sign in" in r.text
    # Parts of pages and the event stream answer a bare 401 (the page script reloads).
    for path in ("/fleet/part", "/tasks/part", f"/tasks/{some_task}/part", "/events"):
        r = await web.get(path)
        assert r.status_code == 401, path
        assert 'action="/login"' not in r.text


async def test_sign_in_keeps_the_token_server_side_behind_an_opaque_strict_httponly_cookie(
    system: System, web: WebUser
) -> None:
    r = await web.sign_in("admin", system.admin_token, next_path="/tasks")
    assert r.status_code == 303 and r.headers["location"] == "/tasks"
    cookie = next(v for k, v in r.headers.multi_items() if k == "set-cookie" and "session" in v)
    assert cookie.startswith(f"{SESSION_COOKIE}=")
    attrs = {a.strip().lower() for a in cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/"} <= attrs
    value = cookie.split(";")[0].split("=", 1)[1]
    assert system.admin_token not in value and len(value) >= 32
    page = await web.get("/tasks")
    assert page.status_code == 200 and "admin" in page.text
    assert system.admin_token not in page.text


async def test_a_refused_token_shows_the_sign_in_page_again_with_401(
    system: System, web: WebUser
) -> None:
    r = await web.sign_in("admin", "0" * 64)
    assert r.status_code == 401
    assert "not accepted" in r.text
    # A good token under another name is refused too.
    assert (await web.sign_in("bob", system.admin_token)).status_code == 401
    assert SESSION_COOKIE not in r.headers.get("set-cookie", "")
    assert (await web.get("/")).status_code == 401


async def test_a_token_no_longer_accepted_ends_the_session_with_the_sign_in_page(
    system: System, web: WebUser
) -> None:
    alice = await system.user("alice")
    assert (await web.sign_in("alice", alice)).status_code == 303
    assert (await web.get("/tasks")).status_code == 200
    # Rotate alice's token behind the console's back.
    assert system.service.engine is not None
    async with system.service.engine.begin() as conn:
        await conn.execute(
            sa.update(t.users)
            .where(t.users.c.name == "alice")
            .values(token_hash=hashlib.sha256(b"another token").digest())
        )
    r = await web.get("/tasks")
    assert r.status_code == 401 and "no longer valid" in r.text
    assert (await web.get("/tasks")).status_code == 401  # the session is gone, too


async def test_a_safe_next_path_only_after_sign_in(system: System, web: WebUser) -> None:
    for target, expected in (
        ("/tasks?state=done", "/tasks?state=done"),
        ("https://evil.example/", "/"),
        ("//evil.example/", "/"),
        ("/\\evil.example", "/"),
    ):
        web.client.cookies.clear()
        r = await web.sign_in("admin", system.admin_token, next_path=target)
        assert r.headers["location"] == expected, target


# --- CSRF -------------------------------------------------------------------------------------


async def test_state_changing_requests_need_our_origin_and_the_session_csrf_token(
    system: System, web: WebUser
) -> None:
    alice = await owner_of_a_project(system, "alice")
    task_id = await system.submit(alice, "--goal", "wait", "--project", "alice")
    assert (await web.sign_in("alice", alice)).status_code == 303
    csrf = await web.csrf()
    path = f"/tasks/{task_id}/cancel"

    refused = [
        await web.post(path, {"reason": "none"}),  # no token
        await web.post(path, {"csrf": "x" * 43}),  # a wrong token
        await web.post(path, {"csrf": csrf}, origin="http://evil.example"),
        await web.post(path, {"csrf": csrf}, origin="null"),
        await web.post(path, {"csrf": csrf}, origin=None),  # neither Origin nor Referer
        await web.post(
            path, {"csrf": csrf}, origin=None, headers={"Referer": "http://evil.example/x"}
        ),
    ]
    for r in refused:
        assert r.status_code == 403, r.text
        assert "Request refused" in r.text
    # A JSON body is not a form (and no CORS-free cross-site form can send one).
    r = await web.client.post(path, json={"csrf": csrf}, headers={"Origin": web.origin})
    assert r.status_code == 400
    assert await cancel_requested(system, task_id) == ("queued", False)

    # Our Referer (no Origin) is accepted, as is our Origin.
    ok = await web.post(path, {"csrf": csrf}, origin=None, headers={"Referer": web.origin + "/"})
    assert ok.status_code == 303 and ok.headers["location"] == f"/tasks/{task_id}"
    assert await cancel_requested(system, task_id) == ("cancelled", True)
    page = await web.get(f"/tasks/{task_id}")
    assert "Task cancelled (requested by alice" in page.text


async def test_sign_in_and_sign_out_are_protected_too(system: System, web: WebUser) -> None:
    page = await web.get("/login")
    login_csrf = re.search(r'name="login_csrf" value="([^"]+)"', page.text)
    assert login_csrf
    form = {
        "login_csrf": login_csrf.group(1),
        "user": "admin",
        "token": system.admin_token,
        "next": "/",
    }
    assert (await web.post("/login", form, origin="http://evil.example")).status_code == 403
    assert (await web.post("/login", {**form, "login_csrf": "forged"})).status_code == 403
    assert (await web.get("/")).status_code == 401

    assert (await web.post("/login", form)).status_code == 303
    assert (await web.post("/logout", {"csrf": ""})).status_code == 403
    assert (await web.get("/")).status_code == 200
    csrf = await web.csrf()
    r = await web.post("/logout", {"csrf": csrf})
    assert r.status_code == 303 and r.headers["location"] == "/login"
    assert (await web.get("/")).status_code == 401


# --- 403 and 404 ------------------------------------------------------------------------------


async def test_a_user_without_rights_gets_the_not_allowed_view_and_nothing_is_written(
    system: System, web: WebUser
) -> None:
    task_id = await system.submit(system.admin_token, "--goal", "admin's", "--payload", HANG)
    bob = await system.user("bob")
    assert (await web.sign_in("bob", bob)).status_code == 303
    csrf = await web.csrf()

    for path in (f"/tasks/{task_id}", f"/tasks/{task_id}/cancel"):
        r = await web.get(path)
        assert r.status_code == 403, path
        assert "Not allowed" in r.text and "signed in as bob" in r.text
    for path in (f"/tasks/{task_id}/part", f"/tasks/{task_id}/row", f"/events?task={task_id}"):
        assert (await web.get(path)).status_code == 403, path
    r = await web.post(f"/tasks/{task_id}/cancel", {"csrf": csrf})
    assert r.status_code == 403 and "Not allowed" in r.text
    assert await cancel_requested(system, task_id) == ("queued", False)
    # The list shows only what bob may read: nothing.
    listing = await web.get("/tasks")
    assert listing.status_code == 200 and task_id not in listing.text


async def test_unknown_tasks_and_pages_are_404(system: System, web: WebUser) -> None:
    assert (await web.sign_in("admin", system.admin_token)).status_code == 303
    for path in (f"/tasks/{uuid.uuid4()}", "/tasks/not-a-uuid", "/nowhere"):
        r = await web.get(path)
        assert r.status_code == 404, path
        assert "Not found" in r.text


# --- pages and live updates ------------------------------------------------------------------


async def test_pages_show_the_fleet_the_tasks_and_a_task_with_logs_and_artifacts(
    system: System, web: WebUser, host: SimHost
) -> None:
    admin = system.admin_token
    task_id = await system.submit(admin, "--goal", "take a screenshot")
    a = await host.take()
    await host.client.append_logs(task_id, a.attempt, 0, ["opened settings", "<b>not html</b>"])
    await host.client.upload_artifact(
        task_id, a.attempt, a.lease_token, "dir/shot.png", b"\x89PNG fake"
    )
    await host.finish(a)
    assert (await web.sign_in("admin", admin)).status_code == 303

    fleet = await web.get("/")
    assert fleet.status_code == 200
    assert 'data-host-id="h1"' in fleet.text and "live" in fleet.text
    assert 'data-device-id="d0"' in fleet.text and 'data-device-id="d1"' in fleet.text
    # A host that advertises no workflows takes any (its runner is simulated).
    assert "any (simulated runner)" in fleet.text

    tasks = await web.get("/tasks?state=done")
    assert f'data-task-id="{task_id}"' in tasks.text
    assert f'data-task-id="{task_id}"' not in (await web.get("/tasks?state=queued")).text

    page = await web.get(f"/tasks/{task_id}")
    assert page.status_code == 200
    for text in ("take a screenshot", "opened settings", "dir/shot.png", "h1/d", ">done<"):
        assert text in page.text, text
    assert "&lt;b&gt;not html&lt;/b&gt;" in page.text and "<b>not html</b>" not in page.text

    download = await web.get(f"/tasks/{task_id}/artifacts/{a.attempt}/dir%2Fshot.png")
    assert download.status_code == 200 and download.content == b"\x89PNG fake"
    assert download.headers["content-type"] == "application/octet-stream"
    assert "attachment" in download.headers["content-disposition"]
    assert (await web.get(f"/tasks/{task_id}/artifacts/1/missing.bin")).status_code == 404


async def test_every_response_carries_the_security_headers(system: System, web: WebUser) -> None:
    assert (await web.sign_in("admin", system.admin_token)).status_code == 303
    for path in ("/", "/tasks", "/static/console.css", "/static/console.js", "/nowhere"):
        r = await web.get(path)
        for name, value in SECURITY_HEADERS.items():
            assert r.headers.get(name) == value, (path, name)
    assert "no-store" in (await web.get("/")).headers["cache-control"]


async def test_the_event_stream_carries_changes_of_readable_tasks_only(
    system: System, web: WebUser
) -> None:
    alice = await owner_of_a_project(system, "alice")
    assert (await web.sign_in("alice", alice)).status_code == 303
    ready = asyncio.Event()
    mine: list[str] = []

    def until(events: list[dict[str, object]]) -> bool:
        if any("ready" in e for e in events):
            ready.set()  # subscribed: whatever is submitted from now on is seen
        return bool(mine) and any(e.get("task_id") == mine[0] for e in events)

    stream = asyncio.create_task(web.events("/events", until))
    await asyncio.wait_for(ready.wait(), 30)
    await system.submit(system.admin_token, "--goal", "not alice's")
    mine.append(await system.submit(alice, "--goal", "alice's", "--project", "alice"))
    seen = await asyncio.wait_for(stream, 30)

    changes = [e for e in seen if "task_id" in e]
    assert {e["task_id"] for e in changes} == {mine[0]}
    assert set(changes[0]) == {"task_id", "state", "attempt", "host_id", "device_id", "at"}


async def test_after_a_gap_in_the_feed_the_stream_says_ready_again(
    system: System, web: WebUser, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No control plane holds the stream's cursor any more (the only one lost
    its listen connection): ``ready`` comes again (the page re-reads what it
    shows) and the changes after it still arrive."""
    import fleetlease.ops.client as client_module

    monkeypatch.setattr(client_module, "EVENTS_RETRIES", 1)
    alice = await owner_of_a_project(system, "alice")
    assert (await web.sign_in("alice", alice)).status_code == 303
    ready = asyncio.Event()
    again = asyncio.Event()
    mine: list[str] = []

    def until(events: list[dict[str, object]]) -> bool:
        readies = sum(1 for e in events if "ready" in e)
        if readies >= 1:
            ready.set()
        if readies >= 2:
            again.set()
        return bool(mine) and any(e.get("task_id") == mine[0] for e in events)

    stream = asyncio.create_task(web.events("/events", until))
    await asyncio.wait_for(ready.wait(), 30)
    service = system.service
    assert service.engine is not None
    async with service.engine.connect() as conn:
        await conn.execute(
            sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": service.ops.stream.backend_pid}
        )
    await asyncio.wait_for(again.wait(), 30)
    mine.append(await system.submit(alice, "--goal", "after the gap", "--project", "alice"))
    seen = await asyncio.wait_for(stream, 30)
    assert (mine[0], "queued") in [(e.get("task_id"), e.get("state")) for e in seen]


# --- behind a secured broker: each session connects as its own user --------------------------


async def test_behind_a_secured_broker_each_user_connects_as_itself(
    secure_system: SecureSystem,
) -> None:
    running = await start_console(
        WebSettings(nats_url=secure_system.nats_url, prefix=secure_system.prefix),
        host="127.0.0.1",
        port=0,
    )
    web = WebUser(running.url)
    try:
        assert (await web.sign_in("bob", secure_system.admin_token)).status_code == 401
        assert (await web.sign_in("admin", "0" * 64)).status_code == 401
        assert (await web.sign_in("admin", secure_system.admin_token)).status_code == 303
        assert (await web.get("/")).status_code == 200
        ready = asyncio.Event()
        submitted: list[str] = []

        def until(events: list[dict[str, object]]) -> bool:
            if any("ready" in e for e in events):
                ready.set()
            return bool(submitted) and any(e.get("task_id") == submitted[0] for e in events)

        stream = asyncio.create_task(web.events("/events", until))
        await asyncio.wait_for(ready.wait(), 30)
        spec = TaskSpec(kind=TaskKind.GOAL, goal="behind the secured broker")
        submitted.append(await secure_system.service.control_plane.submit(spec))
        await asyncio.wait_for(stream, 30)
        page = await web.get(f"/tasks/{submitted[0]}")
        assert page.status_code == 200 and "behind the secured broker" in page.text
    finally:
        await web.close()
        await running.stop()


# --- no control plane: the console alone, in process (httpx's ASGI transport) -----------------


async def test_without_a_control_plane_sign_in_is_503_and_names_no_url(nats_url: str) -> None:
    settings = WebSettings(nats_url=nats_url, prefix=f"none{uuid.uuid4().hex[:8]}")
    console = await Console(settings).start()
    transport = httpx.ASGITransport(app=create_app(settings, console=console))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://console.test") as c:
            page = await c.get("/login")
            assert page.status_code == 200
            match = re.search(r'name="login_csrf" value="([^"]+)"', page.text)
            assert match
            r = await c.post(
                "/login",
                data={"login_csrf": match.group(1), "user": "admin", "token": "t" * 64},
                headers={"Origin": "http://console.test"},
            )
            assert r.status_code == 503
            assert "not answering" in r.text
            assert nats_url not in r.text and "nats://" not in r.text
    finally:
        await console.stop()


# --- the safe projection ----------------------------------------------------------------------


async def test_no_response_contains_a_secret_a_hash_or_a_host_path(
    system: System, host: SimHost, web: WebUser, other: WebUser, state_dir: Path
) -> None:
    admin = system.admin_token
    alice = await system.user("alice")
    bob = await system.user("bob")
    await system.cli("project", "add", "pa", "--owner", "alice", token=admin)

    # Tasks in every interesting state, as the CLI's scan has them.
    done_id = await system.submit(alice, "--goal", "done", "--project", "pa")
    a = await host.take()
    await host.client.append_logs(done_id, a.attempt, 0, ["a log line"])
    await host.client.upload_artifact(done_id, a.attempt, a.lease_token, "a.txt", b"artifact")
    await host.finish(a)
    hang_id = await system.submit(alice, "--goal", "hang", "--project", "pa")
    b = await host.take()
    retry_id = await system.submit(alice, "--goal", "retry", "--project", "pa")
    c = await host.take()
    await host.client.result(
        c.task_id,
        c.attempt,
        c.lease_token,
        outcome="failed",
        retryable=True,
        reason="flaky",
        fingerprint="f1",
    )
    queued_id = await system.submit(alice, "--goal", "wait", "--project", "pa")
    ids = (done_id, hang_id, retry_id, queued_id)

    # Every page, as admin and as alice (and bob's refusals), cancels included.
    await web.get("/login")
    await web.sign_in("admin", "not a token")
    assert (await web.sign_in("admin", admin)).status_code == 303
    assert (await other.sign_in("alice", alice)).status_code == 303
    for user in (web, other):
        for path in ("/", "/fleet/part", "/tasks", "/tasks/part", "/tasks?state=running"):
            assert (await user.get(path)).status_code == 200, path
        for x in ids:
            for suffix in ("", "/part", "/row", "/cancel"):
                assert (await user.get(f"/tasks/{x}{suffix}")).status_code == 200
        await user.get(f"/tasks/{done_id}/artifacts/1/a.txt")
        await user.get("/static/console.css")
        await user.get("/static/console.js")
        await user.get("/nowhere")
    csrf = await other.csrf()
    await other.post(f"/tasks/{hang_id}/cancel", {"csrf": csrf})
    await other.get(f"/tasks/{hang_id}")
    await host.client.renew(b.task_id, b.attempt, b.lease_token)

    ready = asyncio.Event()

    def until(events: list[dict[str, object]]) -> bool:
        if any("ready" in e for e in events):
            ready.set()
        return any("task_id" in e for e in events)

    stream = asyncio.create_task(other.events("/events", until))
    await asyncio.wait_for(ready.wait(), 30)
    await system.submit(alice, "--goal", "seen live", "--project", "pa")
    assert any("task_id" in e for e in await asyncio.wait_for(stream, 30))
    await other.post(f"/tasks/{queued_id}/cancel", {"csrf": csrf})
    await other.post(f"/tasks/{queued_id}/cancel", {"csrf": "forged"})

    bob_web = WebUser(web.base_url, seen=web.seen)
    try:
        await bob_web.sign_in("bob", bob)
        await bob_web.get(f"/tasks/{done_id}")
        await bob_web.get(f"/tasks/{done_id}/artifacts/1/a.txt")
        await bob_web.post(f"/tasks/{done_id}/cancel", {"csrf": await bob_web.csrf()})
        await bob_web.post("/logout", {"csrf": await bob_web.csrf()})
    finally:
        await bob_web.close()
    await web.post("/logout", {"csrf": await web.csrf()})

    # Every secret in the system, raw and as stored, and every host path.
    secrets: set[str] = {admin, alice, bob, host.credential}
    for token in (admin, alice, bob, host.credential):
        secrets |= _forms(token)
    for token in host.lease_tokens:
        secrets |= _forms(token)
    for key in host.session_keys:
        secrets |= _forms(key)
    for (h,) in await system.rows(sa.select(t.attempts.c.lease_token_hash)):
        if h is not None:
            secrets |= _forms(bytes(h))
    for (h,) in await system.rows(sa.select(t.hosts.c.credential_hash)):
        secrets |= _forms(bytes(h))
    for (h,) in await system.rows(sa.select(t.users.c.token_hash)):
        secrets |= _forms(bytes(h))
    from fleetlease.transport.auth import ServerSecret

    secrets |= _forms(ServerSecret.load_or_create(state_dir / "server.secret").value)
    paths = {str(state_dir), str(state_dir.parent), str(Path.home()), system.nats_url}
    assert len(host.lease_tokens) == 3 and host.session_keys

    seen = web.seen + other.seen
    assert len(seen) > 60
    for i, response in enumerate(seen):
        text = response.text()
        for s in secrets:
            assert s not in text, f"response {i} ({response.url}) leaks a secret"
        for p in paths:
            assert p not in text, f"response {i} ({response.url}) shows a host path or URL"


async def test_the_fleet_shows_a_reserved_device_busy_with_its_task_and_the_hosts_disagreement(
    system: System, web: WebUser, host: SimHost
) -> None:
    """The host's snapshot (both devices idle) lags the reservation: the console
    and the CLI show the device busy with its task, and say the host disagrees;
    the counts are the fleet's."""
    admin = system.admin_token
    task_id = await system.submit(admin, "--goal", "take a screenshot")
    a = await host.take()
    assert (await web.sign_in("admin", admin)).status_code == 303

    fleet = (await web.get("/")).text
    row = fleet.split(f'data-device-id="{a.device_id}"', 1)[1].split("</tr>", 1)[0]
    assert '<span class="dev dev-busy">busy</span>' in row
    assert "host reports idle" in row
    assert f'href="/tasks/{task_id}"' in row
    assert '<span class="stat-n dev-busy">1</span>' in fleet
    assert '<span class="stat-n dev-idle">1</span>' in fleet

    devices = (await system.cli("devices", "--json", token=admin)).json()
    mine = next(d for d in devices if d["device_id"] == a.device_id)
    assert (mine["state"], mine["task_id"], mine["reported"]) == ("busy", task_id, "idle")
    assert mine["disagreement"]
    table = await system.cli("devices", token=admin)
    assert "busy" in table.out and "host reports idle" in table.out


async def test_the_fleet_names_a_busy_devices_task_only_to_those_who_may_read_it(
    system: System, web: WebUser, other: WebUser, host: SimHost
) -> None:
    """The admin's running task shows on its device for the admin; eve, who may
    not read it, sees the device busy without its id, in the console and the CLI."""
    admin = system.admin_token
    eve = await system.user("eve")
    task_id = await system.submit(admin, "--goal", "take a screenshot")
    a = await host.take()
    assert (await web.sign_in("admin", admin)).status_code == 303
    assert (await other.sign_in("eve", eve)).status_code == 303

    assert f'href="/tasks/{task_id}"' in (await web.get("/")).text
    fleet = (await other.get("/")).text
    part = (await other.get("/fleet/part")).text
    row = fleet.split(f'data-device-id="{a.device_id}"', 1)[1].split("</tr>", 1)[0]
    assert '<span class="dev dev-busy">busy</span>' in row
    assert task_id not in fleet and task_id not in part

    devices = (await system.cli("devices", "--json", token=eve)).json()
    theirs = next(d for d in devices if d["device_id"] == a.device_id)
    assert (theirs["state"], theirs["task_id"]) == ("busy", None)
    assert task_id not in (await system.cli("devices", token=eve)).out
