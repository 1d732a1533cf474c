"""``fleetlease up`` runs a secured broker, and nothing but the
state dir is needed to use it: the local agent, a second agent started by hand
and the CLI all connect as themselves; an anonymous client is refused; the
Register a host sends carries no credential; ``host revoke`` kicks the host's
live connections; ``watch`` shows a user only the events of tasks it may read.

Runs ``up`` as a real subprocess (the harness of ``test_up_system``); every wait
polls a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg

from fleetlease.transport import wire
from fleetlease.transport.broker_auth import host_connect_options
from fleetlease.transport.broker_config import BrokerKeys
from fleetlease.transport.subjects import Subjects
from tests.integration.test_up_system import (  # noqa: F401 - `up` is a fixture
    ENV_VARS,
    REPO,
    Run,
    Up,
    fleetlease,
    up,
    wait_for,
)

pytestmark = [pytest.mark.embedded, pytest.mark.timeout(600)]

WAIT_S = 30.0


async def _refused(url: str, **opts: Any) -> str:
    with pytest.raises(Exception) as info:  # nats-py raises a plain Error
        nc = await nats.connect(
            url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5, **opts
        )
        await nc.close()
    return str(info.value)


async def _connections_of(url: str, keys: BrokerKeys, principal: str) -> int:
    """Live connections of ``host:X`` / ``user:U``, as the server's CONNZ says."""
    nc = await nats.connect(url, nkeys_seed_str=keys.system_seed)
    try:
        reply = await nc.request(
            "$SYS.REQ.SERVER.PING.CONNZ", json.dumps({"auth": True}).encode(), timeout=WAIT_S
        )
        conns = json.loads(reply.data)["data"]["connections"] or []
        return sum(1 for c in conns if c.get("authorized_user") == principal)
    finally:
        await nc.close()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ENV_VARS}


def test_up_is_secured_and_needs_no_flags(
    up: Up,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    def fl(*argv: str, token: str | None = None) -> Run:
        return fleetlease(capsys, up.state_dir, *argv, token=token)

    up.start()
    ctx = up.wait_ready()
    assert ctx["admin_user"] == "admin"
    url, prefix = ctx["nats_url"], ctx["prefix"]
    keys = BrokerKeys.load_or_create(up.state_dir / "broker")
    assert (up.state_dir / "broker" / "nats-secure.conf").exists()

    # The local agent got in through the callout: its host is live.
    wait_for(
        lambda: fl("hosts", "--json"),
        lambda r: r.code == 0 and any(h["live"] and h["devices"] == 4 for h in json.loads(r.out)),
        60,
        "the local host live with 4 devices",
    )
    assert asyncio.run(_connections_of(url, keys, "host:local")) >= 1
    # The CLI too, as the admin named in the context file.
    ids = fl("submit", "--goal", "open settings", "--count", "3", "--json").json()["ids"]

    def states() -> dict[str, str]:
        return {t["id"]: t["state"] for t in fl("tasks", "--json", "--limit", "100").json()}

    wait_for(states, lambda s: all(s.get(i) == "done" for i in ids), 120, "3 tasks done")

    # An anonymous client is refused by the server itself, and the callout's
    # decisions are counted on the metrics listener.
    assert "authorization violation" in asyncio.run(_refused(url)).lower()
    metrics = wait_for(
        lambda: urllib.request.urlopen(f"{ctx['metrics_url']}/metrics", timeout=30).read(),
        lambda text: b'fleetlease_broker_auth_decisions_total{decision="refused"} ' in text,
        30,
        "the refusal counted",
    ).decode()
    assert 'fleetlease_broker_auth_decisions_total{decision="granted"}' in metrics

    # Another user: named with --user (or FLEETLEASE_USER); unnamed, a clear refusal.
    bob = fl("user", "add", "bob", "--json").json()["token"]
    unnamed = fl("whoami", token=bob)
    assert unnamed.code == 3 and "--user" in unnamed.err, unnamed
    assert fl("whoami", "--user", "bob", token=bob).out.strip() == "bob"

    # A second agent, started with nothing but its id, credential file and the
    # state dir: its Register, captured by a control-plane-privileged subscriber,
    # carries a proof and no credential.
    cred_file = tmp_path / "h2.credential"
    host = fl("host", "add", "h2", "--json").json()
    cred_file.write_text(host["token"] + "\n")
    cred = host["token"]

    def start_agent() -> subprocess.Popen[bytes]:
        with open(tmp_path / "h2.log", "ab") as log:
            return subprocess.Popen(
                [
                    sys.executable, "-m", "fleetlease.ops.cli", "agent", "--host-id", "h2",
                    "--token-file", str(cred_file), "--devices", "simulated:1",
                    "--state-dir", str(up.state_dir),
                ],
                cwd=REPO,
                env=_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )  # fmt: skip

    async def second_agent() -> subprocess.Popen[bytes]:
        cp = await nats.connect(url, **keys.control_plane_connect_options())
        captured: asyncio.Queue[Msg] = asyncio.Queue()

        async def capture(msg: Msg) -> None:
            captured.put_nowait(msg)

        await cp.subscribe(Subjects(prefix).register("h2"), cb=capture)
        await cp.flush()
        proc = await asyncio.to_thread(start_agent)
        try:
            msg = await asyncio.wait_for(captured.get(), 60)
        except BaseException:
            proc.kill()
            raise
        finally:
            await cp.close()
        assert cred.encode() not in msg.data and bytes.fromhex(cred) not in msg.data
        register = wire.decode(msg.data).msg
        assert isinstance(register, wire.Register)
        assert register.credential is None and register.proof is not None
        return proc

    agent = asyncio.run(second_agent())
    try:
        wait_for(
            lambda: fl("hosts", "--json"),
            lambda r: r.code == 0 and any(h["host_id"] == "h2" and h["live"] for h in r.json()),
            60,
            "h2 live",
        )
        assert asyncio.run(_connections_of(url, keys, "host:h2")) >= 1

        # Revoking it through the CLI kicks its live connections, and it cannot come back.
        revoked = fl("host", "revoke", "h2", "--json").json()
        assert revoked["revoked"] is True and revoked["disconnected"] >= 1
        wait_for(
            lambda: asyncio.run(_connections_of(url, keys, "host:h2")),
            lambda n: n == 0,
            30,
            "h2's connections gone",
        )
        assert "authorization violation" in (
            asyncio.run(_refused(url, **host_connect_options("h2", cred))).lower()
        )
    finally:
        agent.kill()
        agent.wait(30)

    # watch: bob sees the events of his tasks and nobody else's.
    assert fl("project", "add", "bobs", "--owner", "bob").code == 0
    watch_env = _env() | {"FLEETLEASE_USER": "bob", "FLEETLEASE_TOKEN": bob}
    watcher = subprocess.Popen(
        [
            sys.executable, "-m", "fleetlease.ops.cli", "watch", "--json", "--max-events", "3",
            "--for", "120", "--state-dir", str(up.state_dir),
        ],
        cwd=REPO,
        env=watch_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    mine: list[str] = []
    try:
        while watcher.poll() is None:
            # The admin's task first, then bob's: until bob's watch has seen three.
            fl("submit", "--goal", "not bob's", "--json").json()
            run = fl(
                "submit",
                "--goal",
                "bob's",
                "--project",
                "bobs",
                "--user",
                "bob",
                "--json",
                token=bob,
            )
            mine.append(run.json()["id"])
            with contextlib.suppress(subprocess.TimeoutExpired):
                watcher.wait(0.5)
        out, err = watcher.communicate(timeout=30)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.communicate(timeout=30)
    assert watcher.returncode == 0, err
    events = [json.loads(line) for line in out.decode().splitlines()]
    assert len(events) == 3
    assert {e["task_id"] for e in events} <= set(mine), (events, mine)

    assert up.interrupt() == 0, up.log.read_text()
