"""The fleet health page over HTTP: signed-in users only, and its data is the
control plane's own history, which counts the tasks a real host finishes and
the dispatches it claims, and the fleet's devices."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fleetlease.ops.web.server import RunningConsole
from tests.integration.test_ops_cli import SimHost, System
from tests.web.support import WebUser

DEADLINE_S = 60.0


@pytest.fixture
async def web(console: RunningConsole) -> AsyncIterator[WebUser]:
    user = WebUser(console.url)
    try:
        yield user
    finally:
        await user.close()


async def history_until(web: WebUser, holds: Any) -> dict[str, Any]:
    """``/health/data`` polled until ``holds(points)``, or the test fails with
    the last answer."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        r = await web.get("/health/data")
        assert r.status_code == 200, r.text[:300]
        assert r.headers["content-type"] == "application/json"
        data: dict[str, Any] = r.json()
        if holds(data["points"]):
            return data
        assert time.monotonic() < deadline, data
        await asyncio.sleep(0.5)


async def test_the_page_and_its_data_need_a_session_of_any_user(
    system: System, web: WebUser
) -> None:
    for path in ("/health", "/health/data"):
        r = await web.get(path)
        assert r.status_code == 401, path
        assert "fleet_history" not in r.text and '"points"' not in r.text
    bob = await system.user("bob")
    assert (await web.sign_in("bob", bob)).status_code == 303
    for path in ("/health", "/health/data"):
        assert (await web.get(path)).status_code == 200, path
    data = (await web.get("/health/data")).json()
    assert set(data) == {"interval_s", "window_s", "outcomes", "device_states", "points"}


async def test_the_history_counts_finished_tasks_dispatches_and_devices(
    system: System, web: WebUser, host: SimHost
) -> None:
    admin = system.admin_token
    assert (await web.sign_in("admin", admin)).status_code == 303
    page = await web.get("/health")
    assert page.status_code == 200
    for text in (
        'href="/health" aria-current="page"',
        'data-source="/health/data"',
        "/static/charts.js",
        'data-chart="latency"',
    ):
        assert text in page.text, text
    for static in ("/static/charts.js", "/static/health.css"):
        assert (await web.get(static)).status_code == 200, static

    ids = [await system.submit(admin, "--goal", f"step {i}") for i in range(3)]
    outcomes = ("done", "done", "failed")
    for outcome in outcomes:
        a = await host.take()
        await host.finish(a, outcome)
    assert len(ids) == 3

    def finished(points: list[dict[str, Any]]) -> bool:
        done = sum(p["finished"]["done"] for p in points)
        failed = sum(p["finished"]["failed"] for p in points)
        dispatches = sum(p["dispatches"] for p in points)
        return done > 0 and failed > 0 and dispatches >= 3

    data = await history_until(web, finished)
    assert data["outcomes"] == ["done", "failed", "cancelled"]
    assert data["window_s"] == 3600.0 and data["interval_s"] > 0
    points = data["points"]
    assert [p["at"] for p in points] == sorted(p["at"] for p in points)
    latencies = [p for p in points if p["dispatches"]]
    assert all(0 <= p["dispatch_p50"] <= p["dispatch_p99"] for p in latencies)
    # The host's two devices, as the fleet view counts them; none left busy.
    last = points[-1]
    assert sum(last["devices"].values()) == 2, last
    assert last["queued"] == 0 and last["retrying"] == 0, last
    print(
        f"history points: {len(points)}, dispatch p50/p99 of the busiest point: "
        f"{max(latencies, key=lambda p: p['dispatches'])}"
    )
