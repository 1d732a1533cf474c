"""Fixtures of the web console tests: the colleagues' real system (PostgreSQL,
NATS, ``ControlPlaneService`` and the CLI runner of ``test_ops_cli``; the
in-process agent of ``test_agent``), plus the console itself served by uvicorn
on a free port of 127.0.0.1, in the test's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleetlease.hostagent.agent import Agent
from fleetlease.ops.embedded import EmbeddedNats
from fleetlease.ops.service import ControlPlaneService
from fleetlease.ops.web.app import WebSettings
from fleetlease.ops.web.server import RunningConsole, start_console
from fleetlease.transport.broker_config import secure_embedded_args
from fleetlease.transport.subjects import Subjects
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


@dataclass
class SecureSystem:
    """A control plane behind a secured broker, as ``fleetlease up``
    runs it: every NATS client must connect as itself."""

    service: ControlPlaneService
    nats_url: str
    prefix: str
    admin_token: str


@pytest.fixture
async def secure_system(
    db_url: str, subject_prefix: str, tmp_path: Path
) -> AsyncIterator[SecureSystem]:
    state = tmp_path / "secure-state"
    server = EmbeddedNats(
        tmp_path / "secure-nats",
        extra_args=secure_embedded_args(state, subjects=Subjects(subject_prefix)),
    )
    await asyncio.to_thread(server.start)
    service = ControlPlaneService(
        database_url=db_url,
        nats_url=server.url,
        state_dir=state,
        prefix=subject_prefix,
        migrate=False,
        broker_security=True,
        scheduler_interval_s=0.2,
    )
    try:
        await service.start()
        assert service.repo is not None
        admin = await service.repo.add_user("admin", platform_admin=True)
        await service.repo.add_project("default", owner="admin")
        yield SecureSystem(service, server.url, subject_prefix, admin)
    finally:
        await service.stop()
        await asyncio.to_thread(server.stop)
