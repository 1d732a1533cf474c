"""The fleet health page in the system's Chromium (the harness of
``test_web_browser``): with a real agent running tasks that finish done,
failed and cancelled, the four charts render from the control plane's
history, each with its legend, its aria-label and its data table. Saved as
``test-artifacts/web/health.png`` and, in the dark colour scheme,
``health-dark.png``."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

import pytest

from fleetlease.hostagent.agent import Agent
from tests.integration.test_ops_cli import System
from tests.web.test_web_browser import HANG, Browser, expect
from tests.web.test_web_browser import open_browser as open_browser
from tests.web.test_web_browser import pytestmark as pytestmark

#: Points come every 10 s and the page reads them as often: a few intervals.
CHARTS_TIMEOUT_MS = 60_000

#: Whether a column of a chart's data table (what its lines are drawn from)
#: has a positive value.
SOME = """(chart, n) => Array.from(
    document.querySelectorAll(`[data-chart="${chart}"] tbody tr td:nth-child(${n})`),
    (td) => Number(td.textContent)).some((v) => v > 0)"""
#: Whether a column of a chart's data table has a value at all (a dash: none). A
#: dispatch latency may be 0: a claim made by the transaction that assigns
#: shares its commit, and so its time.
MEASURED = """(chart, n) => Array.from(
    document.querySelectorAll(`[data-chart="${chart}"] tbody tr td:nth-child(${n})`),
    (td) => td.textContent.trim()).some((t) => t !== "" && Number.isFinite(Number(t)))"""
#: A point with queued tasks and busy devices.
BACKLOG = f"""() => {{ const some = {SOME};
  return some("queue", 2) && some("devices", 2); }}"""
#: Points with each outcome and a dispatch latency, and lines drawn.
RENDERED = f"""() => {{ const some = {SOME}; const measured = {MEASURED};
  return some("finished", 2) && some("finished", 3) && some("finished", 4)
    && measured("latency", 2) && measured("latency", 3)
    && document.querySelectorAll("svg.plot path.series").length >= 8; }}"""


@pytest.mark.timeout(240)
async def test_the_health_page_charts_the_last_hour_live(
    system: System, agent: Agent, open_browser: Callable[[str], Awaitable[Browser]]
) -> None:
    admin = system.admin_token
    browser = await open_browser("admin")
    page = await browser.page()
    await browser.sign_in(page, "admin", admin)
    await page.get_by_role("link", name="Health").click()
    await expect(page.get_by_role("heading", name="Fleet health")).to_be_visible()
    await expect(page.get_by_role("link", name="Health")).to_have_attribute("aria-current", "page")
    charts = page.locator("[data-chart]")
    await expect(charts).to_have_count(4)
    for i in range(4):
        await expect(charts.nth(i).locator("svg.plot")).to_have_count(1)
    await page.evaluate("window.notReloaded = true")

    started = time.monotonic()
    quick = json.dumps({"sim": {"duration_s": 1.0}})
    ids = [await system.submit(admin, "--goal", f"quick {i}", "--payload", quick) for i in range(5)]
    failing = json.dumps({"sim": {"outcome": "failed"}})
    ids.append(await system.submit(admin, "--goal", "fails", "--payload", failing))
    # Three that hang on two devices: both busy and one queued until cancelled.
    hanging = [await system.submit(admin, "--goal", "hangs", "--payload", HANG) for _ in range(3)]
    await page.wait_for_function(BACKLOG, timeout=CHARTS_TIMEOUT_MS, polling=500)
    for task_id in hanging:
        await system.cli("cancel", task_id, token=admin)

    await page.wait_for_function(RENDERED, timeout=CHARTS_TIMEOUT_MS, polling=500)
    print(f"charts rendered {time.monotonic() - started:.1f} s after the first submit")
    assert await page.evaluate("window.notReloaded === true"), "the page was reloaded"

    finished = page.locator('[data-chart="finished"]')
    for outcome in ("done", "failed", "cancelled"):
        await expect(finished.locator(f'.legend li[data-series="{outcome}"]')).to_be_visible()
    label = await finished.locator("svg.plot").get_attribute("aria-label")
    assert label is not None and "Tasks finished per minute (/min) over the last" in label, label
    assert "done" in label and "cancelled" in label
    await expect(page.locator('[data-chart="devices"] .legend li')).to_have_count(3)
    await expect(page.locator('[data-chart="latency"] .legend li')).to_have_count(2)

    await finished.locator("details summary").click()
    await expect(finished.locator("details table")).to_be_visible()
    await browser.shot(page, "health")
    await page.emulate_media(color_scheme="dark")
    await browser.shot(page, "health-dark")
    await page.emulate_media(color_scheme="light")
    await browser.shot(page, "health-light")
