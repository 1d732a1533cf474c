"""Revocation on a secured broker holds whatever logins race it, and the short
lifetime of broker authorizations costs the fleet no work.

Real parts only: a nats-server 2.15 running the generated secure config (auth
callout), the control plane (``ControlPlaneService`` with broker security, as
``serve`` runs it) on the test's PostgreSQL, ``host revoke`` sent by an admin
through the user API, agents as real processes.

* Sixteen loops log in as a host as fast as they can while ``host revoke``
  runs; once it has returned, the server's CONNZ must soon show no connection
  of that host, every connection a loop holds must be closed, and a new login
  must be refused. Several rounds, one host each.
* With authorizations that expire every few seconds, an agent runs tasks
  longer than that lifetime to completion, and an ops client (the CLI's) keeps
  answering and watching events across the expiries.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient

from fleetlease.ops.client import OpsClient, task_events
from fleetlease.ops.embedded import EmbeddedNats
from fleetlease.transport.broker_auth import host_connect_options
from fleetlease.transport.broker_config import BrokerKeys, secure_embedded_args
from fleetlease.transport.subjects import Subjects

pytestmark = [pytest.mark.embedded, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
LOOPS = 16
#: Logins granted in a round before the revoke is sent (the race is hot).
GRANTED_BEFORE_REVOKE = 48
#: Connections a loop keeps open (it closes its oldest beyond that).
HELD_PER_LOOP = 4
ROUNDS = 3
GONE_WITHIN_S = 5.0


@dataclass
class Fleet:
    url: str
    prefix: str
    state: Path
    tmp: Path
    service: Any
    admin: OpsClient
    system: NatsClient
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    async def connections_of(self, principal: str) -> list[int]:
        """The cids of ``host:X`` / ``user:U`` in the server's CONNZ."""
        reply = await self.system.request(
            "$SYS.REQ.SERVER.PING.CONNZ",
            json.dumps({"auth": True, "limit": 1 << 20}).encode(),
            timeout=10,
        )
        conns = json.loads(reply.data)["data"]["connections"] or []
        return [c["cid"] for c in conns if c.get("authorized_user") == principal]


async def _fleet(
    tmp_path: Path, db_url: str, prefix: str, *, jwt_expires_s: float | None = 300.0
) -> AsyncIterator[Fleet]:
    from fleetlease.ops.service import ControlPlaneService

    state = tmp_path / "state"
    args = secure_embedded_args(state, subjects=Subjects(prefix))
    server = EmbeddedNats(tmp_path / "nats", extra_args=args)
    await asyncio.to_thread(server.start)
    service = ControlPlaneService(
        database_url=db_url,
        nats_url=server.url,
        state_dir=state,
        prefix=prefix,
        broker_security=True,
        broker_jwt_expires_s=jwt_expires_s,
    )
    admin: OpsClient | None = None
    system: NatsClient | None = None
    fleet: Fleet | None = None
    try:
        await service.start()
        assert service.repo is not None
        token = await service.repo.add_user("admin", platform_admin=True)
        admin = OpsClient(nats_url=server.url, token=token, prefix=prefix, user="admin")
        await admin.connect()
        keys = BrokerKeys.load_or_create(state / "broker")
        system = await nats.connect(server.url, nkeys_seed_str=keys.system_seed)
        fleet = Fleet(server.url, prefix, state, tmp_path, service, admin, system)
        yield fleet
    finally:
        if fleet is not None:
            for proc in fleet.procs:
                if proc.poll() is None:
                    proc.kill()
                await asyncio.to_thread(proc.wait)
        if system is not None:
            await system.close()
        if admin is not None:
            await admin.close()
        await service.stop()
        await asyncio.to_thread(server.stop)


async def _wait(
    what: str, check: Callable[[], bool | Awaitable[bool]], timeout: float, poll_s: float = 0.05
) -> float:
    """Poll ``check`` (plain or async) until it is true; the seconds it took."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def ok() -> bool:
        result = check()
        return await result if inspect.isawaitable(result) else result

    while not await ok():
        if loop.time() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(poll_s)
    return loop.time() - start


# -- revocation against racing logins ------------------------------------------------------


@dataclass
class Racers:
    """``LOOPS`` tasks logging in as one host, each holding its newest few
    connections open (never reconnecting: a kicked one stays closed)."""

    url: str
    host_id: str
    credential: str
    granted: int = 0
    refused: int = 0
    opened: list[NatsClient] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    hot: asyncio.Event = field(default_factory=asyncio.Event)

    async def _quiet(self, exc: Exception) -> None:
        pass

    async def _loop(self) -> None:
        held: deque[NatsClient] = deque()
        while not self.stop.is_set():
            try:
                nc = await nats.connect(
                    self.url,
                    allow_reconnect=False,
                    max_reconnect_attempts=0,
                    connect_timeout=5,
                    error_cb=self._quiet,
                    **host_connect_options(self.host_id, self.credential),
                )
            except Exception:
                self.refused += 1
                await asyncio.sleep(0.005)
                continue
            self.granted += 1
            self.opened.append(nc)
            held.append(nc)
            if len(held) > HELD_PER_LOOP:
                await held.popleft().close()
            if self.granted >= GRANTED_BEFORE_REVOKE:
                self.hot.set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(self._loop()) for _ in range(LOOPS)]
        try:
            yield
        finally:
            self.stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            for nc in self.opened:
                with contextlib.suppress(Exception):
                    await nc.close()


@pytest.fixture
async def fleet(tmp_path: Path, db_url: str, subject_prefix: str) -> AsyncIterator[Fleet]:
    async for f in _fleet(tmp_path, db_url, subject_prefix):
        yield f


async def _race_round(fleet: Fleet, host_id: str) -> tuple[int, int, float, float]:
    """One round: revoke ``host_id`` while the loops log in as it. Returns the
    logins granted before the revoke, the connections it kicked, how long it
    took and how long after it CONNZ showed none of the host's connections."""
    assert fleet.service.repo is not None
    credential = await fleet.service.repo.add_host(host_id)
    principal = f"host:{host_id}"
    racers = Racers(fleet.url, host_id, credential)
    async with racers.running():
        await asyncio.wait_for(racers.hot.wait(), 60)
        t0 = time.monotonic()
        revoked = await fleet.admin.call("host_revoke", host_id=host_id)
        revoke_s = time.monotonic() - t0
        assert revoked["revoked"] is True
        granted = racers.granted

        async def none_left() -> bool:
            return not await fleet.connections_of(principal)

        gone_s = await _wait(f"no connection of {principal}", none_left, GONE_WITHIN_S)
        # The loops keep trying meanwhile: none gets in any more.
        refused_before = racers.refused
        await _wait("more refused logins", lambda: racers.refused > refused_before + LOOPS, 30)
        assert not await fleet.connections_of(principal)
        await _wait(
            "every held connection closed",
            lambda: not any(nc.is_connected for nc in racers.opened),
            GONE_WITHIN_S,
        )
    # Publishing as the host needs a connection, and none is let in.
    with pytest.raises(Exception) as refused:
        nc = await nats.connect(
            fleet.url,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=5,
            **host_connect_options(host_id, credential),
        )
        await nc.close()
    assert "authorization violation" in str(refused.value).lower()
    return granted, int(revoked["disconnected"]), revoke_s, gone_s


async def test_no_connection_survives_a_revoke_racing_sixteen_login_loops(fleet: Fleet) -> None:
    for round_no in range(ROUNDS):
        granted, kicked, revoke_s, gone_s = await _race_round(fleet, f"race{round_no}")
        assert kicked >= 1
        print(
            f"round {round_no}: {granted} logins granted before the revoke, {kicked} kicked, "
            f"host revoke took {revoke_s * 1000:.0f} ms, CONNZ empty "
            f"{gone_s * 1000:.0f} ms after it returned"
        )


# -- expiry: work goes on across it ---------------------------------------------------------


@pytest.fixture
async def short_lived(tmp_path: Path, db_url: str, subject_prefix: str) -> AsyncIterator[Fleet]:
    async for f in _fleet(tmp_path, db_url, subject_prefix, jwt_expires_s=3.0):
        yield f


def _spawn_agent(
    fleet: Fleet, host_id: str, credential: str
) -> tuple[subprocess.Popen[bytes], Path]:
    token = fleet.tmp / f"{host_id}.token"
    token.write_text(credential + "\n")
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLEASE_")}
    env["PYTHONPATH"] = str(REPO)
    log_path = fleet.tmp / f"agent-{host_id}.log"
    argv = [
        sys.executable, "-m", "fleetlease.ops.cli", "agent", "--host-id", host_id,
        "--token-file", str(token), "--nats-url", fleet.url, "--prefix", fleet.prefix,
        "--state-dir", str(fleet.tmp / "agent-state"), "--devices", "simulated:1",
        "--claim-wait-s", "2", "--resync-jitter-s", "0",
    ]  # fmt: skip
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    fleet.procs.append(proc)
    return proc, log_path


def _events(log_path: Path, name: str) -> list[dict[str, Any]]:
    found = []
    for line in log_path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") == name:
                found.append(event)
    return found


async def test_agents_and_the_cli_work_on_across_authorization_expiry(short_lived: Fleet) -> None:
    fleet = short_lived
    assert fleet.service.repo is not None
    credential = await fleet.service.repo.add_host("h1")
    agent, log_path = _spawn_agent(fleet, "h1", credential)

    # A watch (the CLI's long-poll of task events) runs all along.
    seen: dict[str, str] = {}
    watching = asyncio.Event()

    async def watch() -> None:
        async for event in task_events(fleet.admin, subscribed=watching, wait_s=2.0):
            seen[event["task_id"]] = event["state"]

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(watching.wait(), 30)
        # Each task outlives one authorization (3 s, less up to 20%); one device
        # runs them one after the other.
        await fleet.admin.call("project_add", name="p1", owner="admin")
        submitted = await fleet.admin.call(
            "submit",
            goal="long",
            project="p1",
            payload={"sim": {"duration_s": 4.0, "log_lines": 8}},
            count=3,
        )
        ids = submitted["ids"]

        async def all_done() -> bool:
            if agent.poll() is not None:
                raise AssertionError(
                    f"agent exited ({agent.returncode}): "
                    + log_path.read_text(errors="replace")[-3000:]
                )
            states = [(await fleet.admin.call("task_show", id=i))["state"] for i in ids]
            return all(s == "done" for s in states)

        took = await _wait("three long tasks done", all_done, 180, poll_s=0.5)
        expiries = len(_events(log_path, "nats_authorization_expired"))
        reconnects = len(_events(log_path, "nats_reconnected"))
        registrations = len(_events(log_path, "agent_registered"))
        # The agent's four connections each came back through several expiries.
        assert expiries >= 4 and reconnects >= 4, (expiries, reconnects)
        # No attempt the agent ran was lost: none stopped, given up or refused. (A
        # claim reply published while a connection was away is lost as on any
        # reconnect; its attempt expires at its ack deadline and runs again.)
        for name in ("broker_refused", "lease_lost", "attempt_given_up", "result_rejected"):
            assert not _events(log_path, name), name
        attempts = [(await fleet.admin.call("task_show", id=i))["attempt"] for i in ids]
        assert len(_events(log_path, "result_reported")) == 3  # one finished attempt each
        # The ops client too, and it still answers; the watch saw the tasks end.
        assert fleet.admin.nc.stats["reconnects"] >= 1
        assert (await fleet.admin.call("whoami"))["name"] == "admin"

        async def watched() -> bool:
            if watcher.done():
                watcher.result()  # raises what ended the watch
            return all(seen.get(i) == "done" for i in ids)

        await _wait("the watch to see every task done", watched, 30)
        print(
            f"3 tasks of 4 s done in {took:.1f} s across {expiries} agent connection "
            f"expiries ({reconnects} reconnects, {registrations} registrations, attempts "
            f"{attempts}); ops client reconnects: "
            f"{fleet.admin.nc.stats['reconnects']}"
        )
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
