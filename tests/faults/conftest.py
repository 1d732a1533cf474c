"""Fixtures of the fault suite: each test owns a whole system of real processes
(``fleetlease.ops.testing.cluster.Cluster``: embedded PostgreSQL and nats-server it can stop, kill
and restart, ``fleetlease serve`` and ``fleetlease agent`` children), so that a
fault in one test never reaches another."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from fleetlease.ops.testing.cluster import Cluster

MakeCluster = Callable[..., Awaitable[Cluster]]


@pytest.fixture
async def make_cluster(tmp_path: Path) -> AsyncIterator[MakeCluster]:
    made: list[Cluster] = []

    async def make(**options: Any) -> Cluster:
        cluster = Cluster(tmp_path / f"cluster{len(made)}", **options)
        made.append(cluster)
        await cluster.start()
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            await cluster.close()
