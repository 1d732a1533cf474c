"""The web console in a real browser: the system's headless Chromium driven by
Playwright (``executable_path``, never ``playwright install``) against a real
running system (PostgreSQL, NATS, the control plane, a simulated agent) and
the console served by uvicorn. Each page is saved as a screenshot under
``test-artifacts/web/``. Every request the browser makes is checked to stay on
the console: the pages need nothing from the internet."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from fleetlease.hostagent.agent import Agent
from fleetlease.ops.web.server import RunningConsole
from tests.integration.test_ops_cli import System

playwright_api = pytest.importorskip(
    "playwright.async_api", reason="playwright is not installed (pip install -e '.[test]')"
)
expect = playwright_api.expect

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason="no chromium binary (Debian package `chromium`; .ci/run installs it)",
)

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
LIVE_TIMEOUT_MS = 60_000
HANG = '{"sim": {"outcome": "hang"}}'


class Browser:
    """One Chromium profile (a fresh user-data-dir) on the console."""

    def __init__(self, context: Any, base_url: str, shots: Path) -> None:
        self.context = context
        self.base_url = base_url.rstrip("/")
        self.shots = shots
        self.foreign: list[str] = []

    async def page(self) -> Any:
        return await self.context.new_page()

    async def sign_in(self, page: Any, user: str, token: str) -> None:
        await page.goto(self.base_url + "/")
        await expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
        await page.get_by_label("User name").fill(user)
        await page.get_by_label("Token").fill(token)
        await page.get_by_role("button", name="Sign in").click()
        await expect(page.get_by_role("button", name="Sign out")).to_be_visible()

    async def shot(self, page: Any, name: str) -> None:
        await page.screenshot(path=str(self.shots / f"{name}.png"), full_page=True)


@pytest.fixture
async def open_browser(
    console: RunningConsole, tmp_path: Path, artifacts_dir: Path
) -> AsyncIterator[Callable[[str], Awaitable[Browser]]]:
    async with playwright_api.async_playwright() as pw:
        browsers: list[Browser] = []

        async def launch(profile: str) -> Browser:
            context = await pw.chromium.launch_persistent_context(
                str(tmp_path / f"chromium-{profile}"),
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1360, "height": 900},
                accept_downloads=True,
            )
            browser = Browser(context, console.url, artifacts_dir)

            async def local_only(route: Any) -> None:
                if route.request.url.startswith(browser.base_url + "/"):
                    await route.continue_()
                else:
                    browser.foreign.append(route.request.url)
                    await route.abort()

            await context.route("**/*", local_only)
            browsers.append(browser)
            return browser

        try:
            yield launch
        finally:
            for browser in browsers:
                await browser.context.close()
        for browser in browsers:
            assert browser.foreign == [], f"the browser left the console: {browser.foreign}"


async def test_sign_in_and_see_a_host_with_its_devices(
    system: System, agent: Agent, open_browser: Callable[[str], Awaitable[Browser]]
) -> None:
    browser = await open_browser("admin")
    page = await browser.page()
    response = await page.goto(browser.base_url + "/")
    assert response is not None and response.status == 401
    await expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    await browser.shot(page, "01-sign-in")

    await browser.sign_in(page, "admin", system.admin_token)
    await expect(page.get_by_role("heading", name="Fleet")).to_be_visible()
    local = page.locator('section.host[data-host-id="local"]')
    await expect(local.locator(".badge")).to_have_text("live")
    for device in ("local-dev-0", "local-dev-1"):
        row = local.locator(f'tr[data-device-id="{device}"]')
        await expect(row).to_be_visible()
        await expect(row.locator(".dev")).to_have_text("idle")
    await expect(page.locator("body")).to_have_attribute("data-live", "on")
    await browser.shot(page, "02-fleet")


async def test_a_task_submitted_through_the_cli_reaches_done_live(
    system: System, agent: Agent, open_browser: Callable[[str], Awaitable[Browser]]
) -> None:
    browser = await open_browser("admin")
    page = await browser.page()
    await browser.sign_in(page, "admin", system.admin_token)
    await page.goto(browser.base_url + "/tasks")
    await expect(page.locator("body")).to_have_attribute("data-live", "on")
    await page.evaluate("window.notReloaded = true")

    sim = {"sim": {"duration_s": 1.0, "log_lines": 4, "artifact_bytes": 2048}}
    task_id = await system.submit(
        system.admin_token, "--goal", "open the settings", "--payload", json.dumps(sim)
    )
    row = page.locator(f'tr[data-task-id="{task_id}"]')
    await expect(row).to_be_visible(timeout=LIVE_TIMEOUT_MS)
    await expect(row.locator('[data-field="state"]')).to_have_text("done", timeout=LIVE_TIMEOUT_MS)
    assert await page.evaluate("window.notReloaded === true"), "the page was reloaded"
    await browser.shot(page, "03-tasks-live-done")

    await row.get_by_role("link").click()
    await expect(page.locator("#task-state")).to_have_text("done")
    attempt = page.locator("#attempts li.attempt").first
    await expect(attempt.locator(".reason")).to_have_text("done")
    await expect(attempt).to_contain_text("local/local-dev-")
    await expect(page.locator("#logs .logline")).to_have_count(4)
    artifact = page.locator("#artifacts tbody tr").first
    await expect(artifact).to_be_visible()
    await browser.shot(page, "04-task-done")

    async with page.expect_download() as info:
        await artifact.get_by_role("link", name="Download").click()
    download = await info.value
    path = await download.path()
    assert path is not None
    assert len(await asyncio.to_thread(Path(path).read_bytes)) == 2048


async def test_a_hanging_task_is_cancelled_from_its_page(
    system: System, agent: Agent, open_browser: Callable[[str], Awaitable[Browser]]
) -> None:
    browser = await open_browser("admin")
    page = await browser.page()
    await browser.sign_in(page, "admin", system.admin_token)
    task_id = await system.submit(
        system.admin_token, "--goal", "wait for a dialog", "--payload", HANG
    )
    await page.goto(f"{browser.base_url}/tasks/{task_id}")
    await expect(page.locator("body")).to_have_attribute("data-live", "on")
    await expect(page.locator("#task-state")).to_have_text("running", timeout=LIVE_TIMEOUT_MS)
    await browser.shot(page, "05-task-running")

    await page.locator("#cancel-task").click()
    await expect(page.get_by_role("heading", name="Cancel this task?")).to_be_visible()
    await browser.shot(page, "06-cancel-confirm")
    await page.get_by_role("button", name="Yes, cancel the task").click()

    await expect(page.locator(".flash-ok")).to_contain_text("Cancel requested by admin")
    await expect(page.locator("#task-state")).to_have_text("cancelled", timeout=LIVE_TIMEOUT_MS)
    await expect(page.locator("#cancel-summary")).to_contain_text("requested by admin")
    await expect(page.locator("#attempts .reason").first).to_have_text("cancelled")
    await expect(page.locator("#cancel-task")).to_have_count(0)
    await browser.shot(page, "07-task-cancelled")
    assert (await system.show(task_id))["state"] == "cancelled"


async def test_a_user_without_rights_gets_the_403_view(
    system: System, open_browser: Callable[[str], Awaitable[Browser]]
) -> None:
    task_id = await system.submit(system.admin_token, "--goal", "admin only")
    bob = await system.user("bob")
    browser = await open_browser("bob")
    page = await browser.page()
    await browser.sign_in(page, "bob", bob)

    response = await page.goto(f"{browser.base_url}/tasks/{task_id}")
    assert response is not None and response.status == 403
    await expect(page.get_by_role("heading", name="Not allowed")).to_be_visible()
    await expect(page.locator("main")).to_contain_text("signed in as bob")
    await browser.shot(page, "08-not-allowed")

    await page.goto(f"{browser.base_url}/tasks")
    await expect(page.locator(f'tr[data-task-id="{task_id}"]')).to_have_count(0)
    await expect(page.locator("#no-tasks")).to_be_visible()
