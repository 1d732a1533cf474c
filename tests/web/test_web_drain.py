"""The fleet page's drain button: shown to platform admins only, a CSRF-checked
form that drains and undrains a host; the page shows the drain; anyone else's
post is refused and writes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa

from fleetlease.ops.web.server import RunningConsole
from fleetlease.persistence import tables as t
from tests.integration.test_ops_cli import SimHost, System
from tests.web.support import WebUser


@pytest.fixture
async def web(console: RunningConsole) -> AsyncIterator[WebUser]:
    user = WebUser(console.url)
    try:
        yield user
    finally:
        await user.close()


async def drained_at(system: System) -> object:
    return await system.scalar(
        sa.select(t.hosts.c.drain_requested_at).where(t.hosts.c.host_id == "h1")
    )


async def test_a_platform_admin_drains_and_undrains_a_host_from_the_fleet_page(
    system: System, host: SimHost, web: WebUser
) -> None:
    assert (await web.sign_in("admin", system.admin_token)).status_code == 303
    page = await web.get("/")
    assert 'action="/hosts/h1/drain"' in page.text
    csrf = await web.csrf()

    assert (await web.post("/hosts/h1/drain", {"x": "1"})).status_code == 403  # no CSRF
    assert await drained_at(system) is None
    r = await web.post("/hosts/h1/drain", {"csrf": csrf})
    assert r.status_code == 303 and r.headers["location"] == "/"
    assert await drained_at(system) is not None
    page = await web.get("/")
    assert "badge-drained" in page.text and 'action="/hosts/h1/undrain"' in page.text
    assert "Host h1 drained" in page.text
    part = await web.get("/fleet/part")
    assert part.text.count('class="dev-drained"') == 2

    r = await web.post("/hosts/h1/undrain", {"csrf": csrf})
    assert r.status_code == 303
    assert await drained_at(system) is None
    assert (await web.post("/hosts/no.such/drain", {"csrf": csrf})).status_code == 404
    assert (await web.post("/hosts/ghost/drain", {"csrf": csrf})).status_code == 404


async def test_anyone_else_sees_no_button_and_their_post_is_refused(
    system: System, host: SimHost, web: WebUser
) -> None:
    bob = await system.user("bob")
    assert (await web.sign_in("bob", bob)).status_code == 303
    page = await web.get("/")
    assert page.status_code == 200 and "h1" in page.text
    assert "/hosts/h1/drain" not in page.text
    csrf = await web.csrf()

    r = await web.post("/hosts/h1/drain", {"csrf": csrf})
    assert r.status_code == 403 and "Not allowed" in r.text
    assert await drained_at(system) is None
