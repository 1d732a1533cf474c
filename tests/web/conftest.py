"""Fixtures of the web console tests: the colleagues' real system (PostgreSQL,
NATS, ``ControlPlaneService`` and the CLI runner of ``test_ops_cli``; the
in-process agent of ``test_agent``), plus the console itself served by uvicorn
on a free port of 127.0.0.1, in the test's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hostagent.agent import Agent
from ops.web.app import WebSettings
from ops.web.server import RunningConsole, start_console
from tests.integration.test_agent import RunningAgent
from tests.integration.test_agent import System as AgentHarness
from tests.integration.test_ops_cli import System
from tests.integration.test_ops_cli import host as host
from tests.integration.test_ops_cli import system as system

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "web"


@pytest.fixture
async def console(system: System) -> AsyncIterator[RunningConsole]:
    running = await start_console(
        WebSettings(nats_url=system.nats_url, prefix=system.prefix, timeout_s=20.0),
        host="127.0.0.1",
        port=0,
    )
    try:
        yield running
    finally:
        await running.stop()


@pytest.fixture
async def agent(system: System, tmp_path: Path) -> AsyncIterator[Agent]:
    """A real host agent (host ``local``, devices ``local-dev-0`` and ``-1``)
    running simulated goal runners, as ``test_agent`` starts it."""
    service = system.service
    harness = AgentHarness(
        system.db_url,
        system.nats_url,
        system.prefix,
        tmp_path / "agents",
        service.timings,
        service=service,
    )
    running: RunningAgent = await harness.start_agent("local", devices=2)
    try:
        yield running.agent
    finally:
        await running.stop()


@pytest.fixture
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
