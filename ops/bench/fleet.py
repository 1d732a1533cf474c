"""What the cells of ``fleetlease bench`` run against: ``fleetlease serve`` as a
child process, its task events, the real agent timed, and the scratch
database's user and hosts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import psutil

from fleetlease.ops.bench.measure import bounded
from fleetlease.ops.bench.options import SUBMIT_BATCH, ZERO, BenchError

_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])

T = TypeVar("T")


@dataclass
class ServeProcess:
    """``fleetlease serve`` in a subprocess, so its CPU and memory are its own."""

    database_url: str
    nats_url: str
    state_dir: Path
    prefix: str
    token: str
    lease_s: float = 60.0
    claim_s: float = 60.0
    ack_s: float = 60.0
    liveness_s: float = 600.0
    #: HOST:PORT of its metrics listener (None: the default, optional).
    metrics: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    ps: psutil.Process | None = None
    starts: int = 0

    def spawn(self) -> None:
        self.starts += 1
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PROJECT_ROOT, env.get("PYTHONPATH", "")) if p
        )
        log = open(self.state_dir / f"serve-{self.starts}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fleetlease.ops.cli",
                "serve",
                "--database-url",
                self.database_url,
                "--nats-url",
                self.nats_url,
                "--state-dir",
                str(self.state_dir),
                "--prefix",
                self.prefix,
                "--lease-s",
                str(self.lease_s),
                "--claim-s",
                str(self.claim_s),
                "--ack-s",
                str(self.ack_s),
                "--liveness-s",
                str(self.liveness_s),
                *(["--metrics", self.metrics] if self.metrics else []),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        log.close()
        self.ps = psutil.Process(self.proc.pid)

    async def ready(self, timeout_s: float = 90.0) -> float:
        """Wait until the user API answers; returns the seconds waited."""
        from fleetlease.ops.client import OpsClient

        t0 = time.monotonic()
        async with OpsClient(
            nats_url=self.nats_url, token=self.token, prefix=self.prefix, timeout_s=2.0
        ) as ops:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    raise BenchError(
                        f"fleetlease serve exited with {self.proc.returncode}: {self.log_tail()}"
                    )
                try:
                    await ops.call("whoami")
                    return time.monotonic() - t0
                except Exception:
                    if time.monotonic() - t0 > timeout_s:
                        raise BenchError(
                            f"fleetlease serve did not answer within {timeout_s:.0f} s"
                        ) from None
                    await asyncio.sleep(0.02)

    async def metrics_url(self, timeout_s: float = 30.0) -> str:
        """The URL of its metrics listener, from its ``metrics_listening`` log
        line (it binds ``metrics``, port 0 included, after the user API answers)."""
        path = self.state_dir / f"serve-{self.starts}.log"
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError):
                for line in path.read_text(errors="replace").splitlines():
                    with contextlib.suppress(ValueError):
                        event = json.loads(line)
                        if isinstance(event, dict) and event.get("event") == "metrics_listening":
                            return str(event["url"])
            if self.proc is not None and self.proc.poll() is not None:
                raise BenchError(f"fleetlease serve exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"fleetlease serve did not listen for metrics: {self.log_tail()}")
            await asyncio.sleep(0.05)

    def log_tail(self) -> str:
        path = self.state_dir / f"serve-{self.starts}.log"
        try:
            return path.read_text(errors="replace")[-800:]
        except OSError:
            return ""

    def cpu_s(self) -> float:
        assert self.ps is not None
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def rss(self) -> int:
        assert self.ps is not None
        return int(self.ps.memory_info().rss)

    def peak_rss(self) -> int:
        """VmHWM (peak resident set) where /proc has it, else the current RSS."""
        assert self.proc is not None
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return self.rss()

    async def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait, 10)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Events:
    """Task events of the control plane (``{prefix}.events.task``): the wall-clock
    time of each state per task, as the control plane stamped it."""

    def __init__(self) -> None:
        self.at: dict[str, dict[str, float]] = {}
        self.count: dict[str, int] = {}
        #: The tasks that reached each state (``watch`` starts from these).
        self.tasks_in: dict[str, set[str]] = {}
        self._watches: dict[str, list[set[str]]] = {}
        self._nc: Any = None

    async def start(self, nats_url: str, subject: str) -> None:
        import nats

        self._nc = await nats.connect(nats_url)

        async def on_msg(msg: Any) -> None:
            try:
                event = msgpack.unpackb(msg.data, raw=False)
            except (ValueError, msgpack.UnpackException):
                return
            if not isinstance(event, dict):
                return
            task_id, state, at = event.get("task_id"), event.get("state"), _ts(event.get("at"))
            if not isinstance(task_id, str) or not isinstance(state, str) or at is None:
                return
            self.at.setdefault(task_id, {}).setdefault(state, at)
            self.tasks_in.setdefault(state, set()).add(task_id)
            self.count[state] = self.count.get(state, 0) + 1
            for waiting in self._watches.get(state, ()):
                waiting.discard(task_id)

        await self._nc.subscribe(subject, cb=on_msg)
        await self._nc.flush()

    def watch(self, ids: Sequence[str], state: str) -> Callable[[], int]:
        """A counter of ``ids`` that reached ``state``, kept up to date as events
        arrive: polling it costs nothing (intersecting thousands of ids every
        10 ms was a fifth of the benchmark process's CPU, taken from the agents
        and the control plane under test)."""
        waiting = set(ids) - self.tasks_in.get(state, set())
        self._watches.setdefault(state, []).append(waiting)
        total = len(set(ids))
        return lambda: total - len(waiting)

    async def close(self) -> None:
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()


def timed_agent_class() -> type:
    from fleetlease.hostagent.agent import Agent
    from fleetlease.hostagent.claims import Claims

    class TimedAgent(Agent):
        """The real agent, noting when it receives each lease (wall clock)."""

        held_at: dict[str, float]

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            agent = self

            class TimedClaims(Claims):
                async def accept(self, a: Any, devices: list[str]) -> None:
                    agent.held_at[a.task_id] = time.time()
                    await super().accept(a, devices)

            self.claims = TimedClaims(self.state, self.session, start=self.attempts.start)

    return TimedAgent


def _ts(iso: object) -> float | None:
    if not isinstance(iso, str):
        return None
    try:
        return datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return None


@dataclass
class Fleet:
    """What the cells share: the scratch database, NATS, the user and its token."""

    db_url: str
    nats_url: str
    prefix: str
    token: str
    work: Path


async def setup_fleet(db_url: str, nats_url: str, work: Path) -> Fleet:
    from fleetlease.persistence.db import create_engine
    from fleetlease.persistence.migrate import upgrade_engine
    from fleetlease.persistence.repository import Repository

    engine = create_engine(db_url, pool_size=2)
    try:
        await upgrade_engine(engine)
        repo = Repository(engine)
        token = await repo.add_user("bench", platform_admin=True)
        await repo.add_project("default", owner="bench")
    finally:
        await engine.dispose()
    return Fleet(
        db_url=db_url,
        nats_url=nats_url,
        prefix=f"flbench{uuid.uuid4().hex[:8]}",
        token=token,
        work=work,
    )


async def with_repo(db_url: str, fn: Callable[[Any], Awaitable[T]]) -> T:
    from fleetlease.persistence.db import create_engine
    from fleetlease.persistence.repository import Repository

    engine = create_engine(db_url, pool_size=4)
    try:
        return await fn(Repository(engine))
    finally:
        await engine.dispose()


async def add_hosts(db_url: str, names: Sequence[str]) -> dict[str, str]:
    async def run(repo: Any) -> dict[str, str]:
        return {h: await repo.add_host(h) for h in names}

    return await with_repo(db_url, run)


async def revoke_hosts(db_url: str, names: Sequence[str]) -> None:
    async def run(repo: Any) -> None:
        for h in names:
            await repo.revoke_host(h)

    await with_repo(db_url, run)


async def submit(
    ops: Any,
    n: int,
    batch: int = SUBMIT_BATCH,
    *,
    payload: dict[str, Any] = ZERO,
    selector: dict[str, str] | None = None,
) -> list[str]:
    ids: list[str] = []
    extra = {"selector": selector} if selector else {}
    if not ops.user:
        # The client learns its user on its first call and reconnects as that
        # user: first calls made concurrently would lose their replies.
        await ops.call("whoami")

    async def one(count: int) -> list[str]:
        reply = await ops.call("submit", goal="bench", payload=payload, count=count, **extra)
        return list(reply["ids"])

    sizes = [min(batch, n - i) for i in range(0, n, batch)]
    for got in await bounded(4, [lambda c=c: one(c) for c in sizes]):  # type: ignore[misc]
        ids.extend(got)
    return ids
