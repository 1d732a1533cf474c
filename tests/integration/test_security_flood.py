"""Floods cannot knock the control plane off NATS, and long-polls of one principal
cannot take the pool (``transport/admission.py``).

Runs ``fleetlease serve`` as a real subprocess on a fresh state dir: it starts
the secured nats-server 2.15 (auth callout, per-role limits in the user JWT)
and serves the control plane on the test's PostgreSQL database. Flooders and
honest clients are real NATS connections with their own identities. Whether a
control-plane connection was closed is read from nats-server itself (CONNZ of
the open and of the closed connections, through the system account) and from
its log. CPU and memory of the serve process are printed, never asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import pytest
import sqlalchemy as sa
from nats.aio.client import Client as NatsClient
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.ops.cli import EXIT_BY_CODE, EXIT_UNAVAILABLE
from fleetlease.ops.client import OpsClient, PollPacer, task_events
from fleetlease.persistence.secrets import hash_secret, new_token
from fleetlease.persistence.tables import hosts, users
from fleetlease.transport import wire
from fleetlease.transport.broker_auth import ROLE_LIMITS, host_connect_options, user_connect_options
from fleetlease.transport.broker_config import BrokerKeys
from fleetlease.transport.client import HostClient
from fleetlease.transport.subjects import Channel, Subjects
from tests.integration.test_up_system import ENV_VARS, processes_using

pytestmark = [pytest.mark.embedded, pytest.mark.timeout(900)]

WAIT_S = 60.0
SUBJECTS = Subjects()


async def until(probe: Callable[[], Awaitable[bool]], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not await probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        await asyncio.sleep(0.1)


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    state: Path
    out: Path
    url: str
    keys: BrokerKeys

    @property
    def nats_log(self) -> Path:
        return self.state / "nats" / "nats.log"

    async def connz(self, **query: Any) -> list[dict[str, Any]]:
        nc = await nats.connect(self.url, nkeys_seed_str=self.keys.system_seed)
        try:
            reply = await nc.request(
                "$SYS.REQ.SERVER.PING.CONNZ",
                json.dumps({"auth": True, "limit": 10_000, **query}).encode(),
                timeout=WAIT_S,
            )
            body = json.loads(reply.data)
            assert "data" in body, body
            return list(body["data"]["connections"] or [])
        finally:
            await nc.close()

    async def control_plane(self) -> dict[str, int]:
        """The control plane's open connections, name -> connection id."""
        return {
            c["name"]: c["cid"]
            for c in await self.connz()
            if str(c.get("name", "")).startswith("fleetlease-server-")
        }

    async def closed_control_plane(self) -> list[dict[str, Any]]:
        return [
            c
            for c in await self.connz(state=1)  # ConnState: 1 = closed
            if str(c.get("name", "")).startswith("fleetlease-server-")
        ]

    def usage(self) -> str:
        """CPU seconds and resident memory of the serve process."""
        fields = (Path("/proc") / str(self.proc.pid) / "stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        cpu = (int(fields[11]) + int(fields[12])) / ticks
        status = (Path("/proc") / str(self.proc.pid) / "status").read_text()
        rss = re.search(r"VmRSS:\s+(\d+) kB", status)
        return f"cpu {cpu:.2f}s rss {int(rss.group(1)) // 1024 if rss else -1} MiB"


@pytest.fixture
def served(db_url: str) -> Any:
    # A short path: nothing of it may outlive the test.
    state = Path(os.environ.get("TMPDIR", "/tmp")) / f"flflood-{os.getpid()}-{time.monotonic_ns()}"
    state.mkdir()
    out = state.parent / f"{state.name}.out"
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    with out.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fleetlease.ops.cli", "serve", "--state-dir", str(state),
             "--database-url", db_url],
            stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + WAIT_S
        url = None
        while url is None:
            text = out.read_bytes()
            found = re.search(rb"NATS (nats://127\.0\.0\.1:\d+)", text)
            if found and b'"server_started"' in text:
                url = found.group(1).decode()
            elif proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"serve did not start: {out.read_text(errors='replace')}")
            else:
                time.sleep(0.2)
        yield Served(proc, state, out, url, BrokerKeys.load_or_create(state / "broker"))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        for pid, _ in processes_using(state):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(state), str(out)], check=False)


async def add_user(engine: AsyncEngine, name: str, *, admin: bool = False) -> str:
    token = new_token()
    async with engine.begin() as conn:
        await conn.execute(
            sa.insert(users).values(
                name=name,
                token_hash=hash_secret(token),
                platform_admin=admin,
                created_at=datetime.now(UTC),
            )
        )
    return token


async def add_host(engine: AsyncEngine, host_id: str) -> str:
    credential = new_token()
    async with engine.begin() as conn:
        await conn.execute(
            sa.insert(hosts).values(
                host_id=host_id,
                credential_hash=hash_secret(credential),
                created_at=datetime.now(UTC),
            )
        )
    return credential


@contextlib.asynccontextmanager
async def user_conn(served: Served, name: str, token: str) -> AsyncIterator[NatsClient]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        served.url,
        allow_reconnect=False,
        error_cb=on_error,
        **user_connect_options(name, token, SUBJECTS),
    )
    try:
        yield nc
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


@contextlib.asynccontextmanager
async def ops(served: Served, name: str, token: str) -> AsyncIterator[OpsClient]:
    client = OpsClient(nats_url=served.url, token=token, user=name, timeout_s=WAIT_S)
    await client.connect()
    try:
        yield client
    finally:
        await client.close()


async def ready(served: Served, admin: str, admin_token: str) -> None:
    last: list[str] = []

    async def answered() -> bool:
        try:
            async with ops(served, admin, admin_token) as c:
                await c.call("events")
            return True
        except Exception as exc:
            last[:] = [repr(exc)]
            return False

    try:
        await until(answered, "the control plane answers")
    except AssertionError:
        print(last, served.out.read_text(errors="replace")[-3000:])
        print(served.nats_log.read_text(errors="replace")[-3000:])
        raise


def code_of(data: bytes) -> str:
    msg = wire.decode(data).msg
    return msg.code if isinstance(msg, wire.Error) else msg.TYPE


def tally(results: list[Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        key = code_of(r.data) if hasattr(r, "data") else type(r).__name__
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_a_busy_refusal_exits_like_unavailable() -> None:
    assert EXIT_BY_CODE["busy"] == EXIT_UNAVAILABLE == 6
    assert wire.RemoteError("busy", "x").retryable


MALLORY_EVENTS = SUBJECTS.ops("mallory", "events")


async def test_floods_never_get_a_control_plane_connection_closed(
    served: Served, engine: AsyncEngine
) -> None:
    alice_token = await add_user(engine, "alice", admin=True)
    mallory_token = await add_user(engine, "mallory")
    await ready(served, "alice", alice_token)
    before = await served.control_plane()
    # One connection per channel, and the storage connection (JetStream).
    channels = {"control", "jobs", "logs", "artifacts", "ops", "storage"}
    assert set(before) == {f"fleetlease-server-{c}" for c in channels}, before
    print(f"\nserve at rest: {served.usage()}")

    # 1. 300 x 900 KB ops requests with a bad token, all at once, while alice
    # asks for something: over the user role's size limit, each is refused
    # undecoded (bad_request) or shed (busy); alice is answered.
    big = wire.encode(wire.OpsRequest(token="bad", verb="events", args={"pad": "x" * (900 * 1024)}))
    assert ROLE_LIMITS["user"]["payload"] < len(big) < 1024 * 1024
    async with (
        user_conn(served, "mallory", mallory_token) as nc,
        ops(served, "alice", alice_token) as alice,
    ):
        started = time.monotonic()
        flood = [
            asyncio.ensure_future(nc.request(MALLORY_EVENTS, big, timeout=WAIT_S))
            for _ in range(300)
        ]
        assert "next" in await alice.call("events")
        results = await asyncio.gather(*flood, return_exceptions=True)
        counts = tally(results)
        print(
            f"900 KB x 300 bad-token flood: {counts} in "
            f"{time.monotonic() - started:.1f}s; {served.usage()}"
        )
        if not set(counts) <= {"bad_request", "busy"}:
            print([ln for ln in served.nats_log.read_text().splitlines() if "low" in ln][-30:])
            print([ln for ln in served.out.read_text().splitlines() if "nats" in ln][-30:])
        assert set(counts) <= {"bad_request", "busy"}, counts

    # 2. Under the limit: 300 x 400 KB requests with a bad token, all at once,
    # while alice asks for something; the flood is shed, alice is answered.
    mid = wire.encode(wire.OpsRequest(token="bad", verb="events", args={"pad": "x" * (400 * 1024)}))
    async with (
        user_conn(served, "mallory", mallory_token) as nc,
        ops(served, "alice", alice_token) as alice,
    ):
        started = time.monotonic()
        flood = [
            asyncio.ensure_future(nc.request(MALLORY_EVENTS, mid, timeout=WAIT_S))
            for _ in range(300)
        ]
        answer = await alice.call("events")
        assert "next" in answer
        results = await asyncio.gather(*flood, return_exceptions=True)
        print(
            f"400 KB x 300 bad-token flood: {tally(results)} in "
            f"{time.monotonic() - started:.1f}s; {served.usage()}"
        )

    # 3. 200 signed heartbeats of 1,024 devices (~450 KB each) from one host, at
    # once, while another host heartbeats and alice asks.
    creds = {h: await add_host(engine, h) for h in ("h1", "h2")}
    clients = {
        h: HostClient(
            nats_url=served.url,
            host_id=h,
            credential=c,
            connect_options=host_connect_options(h, c),
            timeout_s=WAIT_S,
        )
        for h, c in creds.items()
    }
    try:
        for c in clients.values():
            await c.connect()
            await c.register()
        devices = [
            wire.Device(
                device_id=f"h1-device-{i:04d}-" + "d" * 80, capabilities={"model": "m" * 300}
            )
            for i in range(wire.MAX_DEVICES)
        ]
        h1 = clients["h1"]
        subject = SUBJECTS.heartbeat("h1")
        assert h1._signer is not None
        sealed = [h1._signer.seal(subject, wire.Heartbeat(devices=devices)) for _ in range(200)]
        total = sum(len(s) for s in sealed)
        nc = h1._conns[Channel.CONTROL]
        started = time.monotonic()
        flood = [
            asyncio.ensure_future(nc.request(subject, data, timeout=WAIT_S)) for data in sealed
        ]
        await clients["h2"].heartbeat([wire.Device(device_id="h2-d0")])
        async with ops(served, "alice", alice_token) as alice:
            assert "next" in await alice.call("events")
        results = await asyncio.gather(*flood, return_exceptions=True)
        counts = tally(results)
        print(
            f"heartbeat flood ({total // (1024 * 1024)} MiB): {counts} in "
            f"{time.monotonic() - started:.1f}s; {served.usage()}"
        )
        assert counts.get("busy", 0) > 0 and counts.get("ok", 0) > 0
    finally:
        for c in clients.values():
            await c.close()

    # nats-server closed none of the control plane's connections.
    assert await served.closed_control_plane() == []
    assert await served.control_plane() == before
    slow = [
        line
        for line in served.nats_log.read_text(errors="replace").splitlines()
        if "Slow Consumer" in line
    ]
    print(f"slow-consumer lines in the nats-server log: {len(slow)}")
    cids = {f"cid:{cid}" for cid in before.values()}
    assert not [line for line in slow if any(c in line for c in cids)]


async def test_one_user_cannot_take_the_long_poll_pool(served: Served, engine: AsyncEngine) -> None:
    alice_token = await add_user(engine, "alice")
    bob_token = await add_user(engine, "bob", admin=True)
    await ready(served, "bob", bob_token)
    async with ops(served, "alice", alice_token) as alice, ops(served, "bob", bob_token) as bob:
        first = await alice.call("events")
        args = {"after": int(first["next"]), "wait_s": 30.0}
        request = wire.encode(wire.OpsRequest(token=alice_token, verb="events", args=args))
        polls = [
            asyncio.ensure_future(
                alice.nc.request(SUBJECTS.ops("alice", "events"), request, timeout=WAIT_S)
            )
            for _ in range(1100)
        ]

        async def most_refused() -> bool:
            return sum(1 for p in polls if p.done()) >= 1000

        await until(most_refused, "the polls over alice's cap are answered")
        done = [p.result() for p in polls if p.done() and p.exception() is None]
        counts = tally(done)
        parked = sum(1 for p in polls if not p.done())
        print(f"\n1,100 polls of one user: answered {counts}, still parked {parked}")
        assert counts.get("busy", 0) >= 1000
        assert counts.get("ops_reply", 0) == 0  # nothing answered early and empty
        assert 0 < parked <= 64

        # Bob's poll still parks: it is answered by the event of a task
        # submitted after it reached the server.
        await bob.call("project_add", name="probe", owner="bob")
        mine = await bob.call("events")
        poll = asyncio.ensure_future(bob.call("events", after=int(mine["next"]), wait_s=30.0))
        await bob.nc.flush()
        async with ops(served, "bob", bob_token) as submitter:
            await submitter.call("submit", goal="flood-probe", project="probe")
        page = await asyncio.wait_for(poll, WAIT_S)
        assert page["events"], page

        # A watch of alice's, facing nothing but busy refusals, backs off.
        calls = 0
        real_call = alice.call

        async def counted(verb: str, **kw: Any) -> Any:
            nonlocal calls
            calls += 1
            return await real_call(verb, **kw)

        alice.call = counted  # type: ignore[method-assign]
        watch = task_events(alice, wait_s=30.0, pacer=PollPacer())

        async def drive() -> None:
            async for _ in watch:
                pass

        task = asyncio.ensure_future(drive())
        window = 6.0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), window)
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        print(f"watch against a full budget: {calls} requests in {window:g}s; {served.usage()}")
        # A busy loop makes thousands of requests in that window.
        assert 1 <= calls <= 50
        for p in polls:
            p.cancel()


async def test_one_host_cannot_take_the_claim_pool(served: Served, engine: AsyncEngine) -> None:
    creds = {h: await add_host(engine, h) for h in ("h1", "h2")}
    clients = {
        h: HostClient(
            nats_url=served.url,
            host_id=h,
            credential=c,
            connect_options=host_connect_options(h, c),
            timeout_s=WAIT_S,
        )
        for h, c in creds.items()
    }
    try:
        for h, c in clients.items():
            await c.connect()
            await c.register()
            await c.heartbeat([wire.Device(device_id=f"{h}-d0")])
        # The jobs channel parks at most 64 claims of one host.
        claims = [asyncio.ensure_future(clients["h1"].claim(30.0, ["h1-d0"])) for _ in range(100)]

        async def over_cap_answered() -> bool:
            return sum(1 for c in claims if c.done()) >= 36

        await until(over_cap_answered, "h1's claims over its cap are answered")
        refused = [c.exception() for c in claims if c.done()]
        codes = sorted({getattr(e, "code", repr(e)) for e in refused})
        parked = sum(1 for c in claims if not c.done())
        print(f"\n100 claims of one host: {len(refused)} refused {codes}, {parked} parked")
        assert codes == ["busy"] and 0 < parked <= 64
        # Another host's claim is not refused: it parks for its wait, then
        # answers "no work".
        assert await clients["h2"].claim(1.0, ["h2-d0"]) is None
        for c in claims:
            c.cancel()
    finally:
        for c in clients.values():
            await c.close()
