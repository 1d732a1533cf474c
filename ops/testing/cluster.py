"""A whole fleetlease system as real processes, for the fault tests and
``fleetlease soak``: an embedded PostgreSQL and nats-server it owns (and can stop,
kill and start again on the same data and port), ``fleetlease serve`` and
``fleetlease agent`` children logging JSON lines to files, optional fault
proxies (control plane -> PostgreSQL, agent -> NATS), and the database side of
the harness (submits, reads, the invariant checks of ``fleetlease.ops.testing.invariants``).

Every wait is for a condition with a deadline; nothing sleeps in place of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import structlog
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.ops.embedded import EmbeddedNats, EmbeddedPostgres
from fleetlease.ops.testing.faultproxy import FaultProxy
from fleetlease.ops.testing.invariants import (
    TERMINAL,
    Acknowledged,
    Observer,
    Report,
    check,
    install_reservation_audit,
)
from fleetlease.ops.testing.replication import ReplicatedPostgres
from fleetlease.persistence.db import create_engine
from fleetlease.persistence.errors import Unavailable
from fleetlease.persistence.model import RetryPolicy, TaskKind, TaskSpec

log = structlog.get_logger("fleetlease.cluster")

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[2]


class ClusterError(Exception):
    """A condition the cluster waited for did not come (or a child died).

    A plain exception, not an ``AssertionError``: a test that waits on the
    cluster fails with it as an error, and ``python -O`` changes nothing."""


async def wait_for(
    probe: Callable[[], Any],
    ok: Callable[[Any], bool] = bool,
    *,
    timeout: float,
    what: str,
    interval: float = 0.1,
) -> Any:
    """Poll ``probe`` until ``ok(value)``; ClusterError naming ``what`` on timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = probe()
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = await value
        if ok(value):
            return value
        if loop.time() > deadline:
            raise ClusterError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(interval)


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLEASE_")}
    env["PYTHONPATH"] = str(REPO_ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    return env


class Proc:
    """A child process logging JSON lines (structlog) to ``log_path``."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self.popen: subprocess.Popen[bytes] | None = None
        self._events: list[dict[str, Any]] = []
        self._offset = 0
        self.starts = 0

    def start(self) -> Proc:
        with open(self.log_path, "ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                cwd=REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.starts += 1
        log.info("cluster_child_started", child=self.name, pid=self.popen.pid)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.popen is not None
            self.popen.send_signal(sig)

    async def kill(self) -> None:
        """SIGKILL (a SIGSTOPped child dies too) and reap."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.kill()
        await asyncio.to_thread(self.popen.wait)

    async def terminate(self, timeout: float = 30.0) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.to_thread(self.popen.wait), timeout)
            except TimeoutError:
                await self.kill()
        return self.popen.returncode

    async def wait_exit(self, timeout: float) -> int:
        assert self.popen is not None
        popen = self.popen
        return await asyncio.wait_for(asyncio.to_thread(popen.wait), timeout)

    # --- events ---------------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return self._events
        end = chunk.rfind(b"\n")
        if end >= 0:
            for line in chunk[: end + 1].splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    self._events.append(event)
            self._offset += end + 1
        return self._events

    def mark(self) -> int:
        """A position: ``named(..., since=mark)`` sees only later events."""
        return len(self.events())

    def named(self, name: str, *, since: int = 0, **match: Any) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events()[since:]
            if e.get("event") == name and all(e.get(k) == v for k, v in match.items())
        ]

    async def wait_event(
        self, name: str, *, timeout: float = 60.0, since: int = 0, **match: Any
    ) -> dict[str, Any]:
        def probe() -> list[dict[str, Any]]:
            found = self.named(name, since=since, **match)
            if not found and not self.alive:
                raise ClusterError(
                    f"{self.name} exited ({self.returncode}) before logging {name}: " + self.tail()
                )
            return found

        found: list[dict[str, Any]] = await wait_for(
            probe, timeout=timeout, what=f"{self.name}: {name} {match}"
        )
        return found[0]

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""


@dataclass
class Agent:
    host_id: str
    proc: Proc
    devices: int
    proxy: FaultProxy | None = None
    runs: list[Proc] = field(default_factory=list)


@dataclass(kw_only=True)
class Timings:
    lease_s: float = 2.0
    claim_s: float = 3.0
    ack_s: float = 2.0
    #: Above the control plane's heartbeat period (5 s) or hosts flap to not-live.
    liveness_s: float = 12.0

    def args(self) -> list[str]:
        return [
            "--lease-s", str(self.lease_s), "--claim-s", str(self.claim_s),
            "--ack-s", str(self.ack_s), "--liveness-s", str(self.liveness_s),
        ]  # fmt: skip


class Cluster:
    """See the module docstring. ``async with Cluster(dir) as c:`` starts
    PostgreSQL and NATS and prepares the database; serve and agents are started
    by the caller."""

    def __init__(
        self,
        directory: Path,
        *,
        timings: Timings | None = None,
        prefix: str = "faults",
        pg_proxy: bool = False,
        seed: int = 0,
        chaos: bool = False,
        replicated: bool = False,
        synchronous: bool = True,
    ) -> None:
        self.directory = Path(directory)
        self.timings = timings or Timings()
        self.prefix = prefix
        self.seed = seed
        #: ``replicated``: a primary and a standby (``synchronous`` or not) on
        #: loopback (``kill_primary``, ``promote_standby``), reached through a
        #: multi-host URL; else one server on a unix socket.
        self.pg: EmbeddedPostgres | ReplicatedPostgres = (
            ReplicatedPostgres(self.directory / "pg", synchronous=synchronous)
            if replicated
            else EmbeddedPostgres(self.directory / "pg")
        )
        #: The platform admin's API token (for user API clients of the tests).
        self.admin_token = ""
        self.nats = EmbeddedNats(self.directory / "nats")
        self.want_pg_proxy = pg_proxy
        #: Serves get the chaos hook (FLEETLEASE_CHAOS_DIR): see ``crash_actor``.
        self.chaos = chaos
        self.pg_proxy: FaultProxy | None = None
        self.engine: AsyncEngine | None = None
        self.repo: Any = None
        self.serves: list[Proc] = []
        self.agents: dict[str, Agent] = {}
        self.credentials: dict[str, str] = {}
        self.acknowledged = Acknowledged()
        self.observer = Observer()
        self.state_dir = self.directory / "state"
        self.log_dir = self.directory / "logs"
        self._retired: list[Proc] = []

    # --- lifecycle --------------------------------------------------------------------------
    async def __aenter__(self) -> Cluster:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> Cluster:
        from fleetlease.persistence.migrate import upgrade
        from fleetlease.persistence.repository import Repository

        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.pg.start)
        await asyncio.to_thread(self.nats.start)
        await upgrade(self.pg.url)
        if self.want_pg_proxy:
            # In front of the one server, or of a replicated pair's primary.
            upstream: Any = (
                self.pg.pgdata / ".s.PGSQL.5432"
                if isinstance(self.pg, EmbeddedPostgres)
                else ("127.0.0.1", self.pg.primary.port)
            )
            self.pg_proxy = await FaultProxy(upstream, seed=self.seed, name="pg").start()
        self.engine = create_engine(self.pg.url, pool_size=4, max_overflow=4)
        await install_reservation_audit(self.engine)
        self.repo = Repository(self.engine)
        self.admin_token = await self.repo.add_user("admin", platform_admin=True)
        await self.repo.add_project("default", owner="admin")
        return self

    async def close(self) -> None:
        procs = [a.proc for a in self.agents.values()] + self.serves + self._retired
        await asyncio.gather(*(p.kill() for p in procs), return_exceptions=True)
        for agent in self.agents.values():
            if agent.proxy is not None:
                await agent.proxy.stop()
        if self.pg_proxy is not None:
            await self.pg_proxy.stop()
        if self.engine is not None:
            await self.engine.dispose()
        await asyncio.to_thread(self.nats.kill)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.pg.stop, "immediate")

    @property
    def serve_database_url(self) -> str:
        if self.pg_proxy is None:
            return self.pg.url
        if isinstance(self.pg, ReplicatedPostgres):
            # A primary that stops answering costs each connection this long.
            return self.pg.url_via(self.pg_proxy.port, connect_timeout="2")
        u = make_url(self.pg.url)
        return u.set(host="127.0.0.1", port=self.pg_proxy.port, query={}).render_as_string(
            hide_password=False
        )

    # --- PostgreSQL and NATS ------------------------------------------------------------------
    async def stop_pg(self, mode: str = "immediate") -> None:
        await asyncio.to_thread(self.pg.stop, mode)

    async def start_pg(self) -> None:
        await asyncio.to_thread(self.pg.start)

    @property
    def pg_running(self) -> bool:
        """Whether PostgreSQL (of a replicated pair: either server) is running."""
        if isinstance(self.pg, ReplicatedPostgres):
            return any(n.postmaster_pid() is not None for n in self.pg.nodes)
        return (self.pg.pgdata / "postmaster.pid").exists()

    def _replicated(self) -> ReplicatedPostgres:
        if not isinstance(self.pg, ReplicatedPostgres):
            raise ClusterError("a cluster made with replicated=True has a standby to fail over to")
        return self.pg

    async def kill_primary(self) -> None:
        """SIGKILL the primary PostgreSQL (postmaster and backends)."""
        await asyncio.to_thread(self._replicated().kill_primary)

    async def promote_standby(self) -> None:
        """Promote the standby; returns once it takes writes."""
        await asyncio.to_thread(self._replicated().promote)

    async def kill_nats(self) -> None:
        await asyncio.to_thread(self.nats.kill)

    async def start_nats(self) -> None:
        port = self.nats.port
        await asyncio.to_thread(self.nats.start)
        if self.nats.port != port:
            raise ClusterError(f"nats-server came back on port {self.nats.port}, not {port}")

    # --- serve ----------------------------------------------------------------------------
    def _serve_proc(self, index: int) -> Proc:
        argv = [
            sys.executable, "-m", "fleetlease.ops.cli", "serve",
            "--database-url", self.serve_database_url, "--nats-url", self.nats.url,
            "--prefix", self.prefix, "--state-dir", str(self.state_dir / "server"),
            *self.timings.args(),
        ]  # fmt: skip
        env = child_env()
        if self.chaos:
            chaos_dir = self.chaos_dir(index)
            chaos_dir.mkdir(parents=True, exist_ok=True)
            env["FLEETLEASE_CHAOS_DIR"] = str(chaos_dir)
        return Proc(f"serve-{index}", argv, self.log_dir / f"serve-{index}.log", env)

    def chaos_dir(self, index: int) -> Path:
        return self.directory / "chaos" / f"serve-{index}"

    async def crash_actor(
        self, index: int, point: str, *, seed: int = 0, timeout: float = 60.0
    ) -> dict[str, Any]:
        """Crash one actor inside the running serve ``index`` (a cluster made
        with ``chaos=True``): arm fail point ``point`` once through its chaos
        hook (the arm file, then SIGUSR1) and wait until an actor crashed on it
        and the supervisor restarted it. Returns the ``supervisor.restarted``
        event. ClusterError if that does not happen within ``timeout`` (the
        point is disarmed again then)."""
        if not self.chaos:
            raise ClusterError("crash_actor needs a cluster made with chaos=True")
        proc = self.serves[index]
        if not proc.alive:
            raise ClusterError(f"{proc.name} is not running")
        arm_file = self.chaos_dir(index) / "arm"
        since = proc.mark()
        arm_file.write_text(f"{point} count=1 seed={seed}\n")
        proc.signal(signal.SIGUSR1)
        try:
            await proc.wait_event("chaos_armed", since=since, point=point, timeout=timeout)
            crash = await proc.wait_event(
                "actor.crash", since=since, reason=f"fail point {point} fired", timeout=timeout
            )
            restarted = [
                e
                for e in proc.named("supervisor.restarted", since=since)
                if e.get("actor") == crash.get("actor")
            ]
            if not restarted:
                await proc.wait_event(
                    "supervisor.restarted", since=since, actor=crash.get("actor"), timeout=timeout
                )
                restarted = proc.named("supervisor.restarted", since=since)
        except ClusterError:
            if proc.alive:
                arm_file.write_text("off\n")
                proc.signal(signal.SIGUSR1)
            raise
        return restarted[0]

    async def start_serve(self, index: int = 0, *, wait: bool = True) -> Proc:
        while len(self.serves) <= index:
            self.serves.append(self._serve_proc(len(self.serves)))
        proc = self.serves[index]
        if proc.alive:
            raise ClusterError(f"{proc.name} is already running")
        since = proc.mark()
        proc.start()
        if wait:
            await proc.wait_event("server_started", since=since, timeout=60)
        return proc

    async def kill_serve(self, index: int = 0) -> None:
        await self.serves[index].kill()

    # --- hosts and agents -----------------------------------------------------------------------
    async def add_host(self, host_id: str) -> str:
        credential: str = await self.retrying(lambda: self.repo.add_host(host_id))
        self.credentials[host_id] = credential
        token = self.state_dir / "tokens" / f"{host_id}.token"
        token.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        token.write_text(credential + "\n")
        token.chmod(0o600)
        return credential

    def _agent_proc(self, host_id: str, devices: int, nats_url: str, **options: Any) -> Proc:
        run = len(self.agents[host_id].runs) if host_id in self.agents else 0
        argv = [
            sys.executable, "-m", "fleetlease.ops.cli", "agent",
            "--host-id", host_id,
            "--token-file", str(self.state_dir / "tokens" / f"{host_id}.token"),
            "--nats-url", nats_url, "--prefix", self.prefix,
            "--state-dir", str(self.state_dir),
            "--devices", f"simulated:{devices}",
            "--claim-wait-s", str(options.get("claim_wait_s", 2)),
            "--resync-jitter-s", str(options.get("resync_jitter_s", 0.5)),
            "--grace-s", str(options.get("grace_s", 2)),
        ]  # fmt: skip
        env = child_env()
        if options.get("failpoints"):
            env["FLEETLEASE_AGENT_FAILPOINTS"] = str(options["failpoints"])
        return Proc(
            f"agent-{host_id}#{run}", argv, self.log_dir / f"agent-{host_id}-{run}.log", env
        )

    async def start_agent(
        self,
        host_id: str,
        *,
        devices: int = 2,
        via_proxy: bool = False,
        wait: bool = True,
        **options: Any,
    ) -> Agent:
        """Start (or restart, same devices and proxy) the agent of ``host_id``."""
        if host_id not in self.credentials:
            await self.add_host(host_id)
        agent = self.agents.get(host_id)
        if agent is not None and agent.proc.alive:
            raise ClusterError(f"agent {host_id} is already running")
        if agent is None:
            proxy = None
            if via_proxy:
                proxy = await FaultProxy(
                    ("127.0.0.1", self.nats.port or 0), seed=self.seed, name=f"nats-{host_id}"
                ).start()
            agent = Agent(host_id, proc=None, devices=devices, proxy=proxy)  # type: ignore[arg-type]
            self.agents[host_id] = agent
        url = f"nats://{agent.proxy.address}" if agent.proxy is not None else self.nats.url
        agent.proc = self._agent_proc(host_id, agent.devices, url, **options)
        agent.runs.append(agent.proc)
        agent.proc.start()
        if wait:
            await agent.proc.wait_event("reconcile_done", timeout=60)
        return agent

    # --- tasks ------------------------------------------------------------------------------
    async def retrying(self, call: Callable[[], Awaitable[T]], *, timeout: float = 60.0) -> T:
        """A harness-side database call, repeated while the database is down."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                return await call()
            except Unavailable:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def submit(
        self,
        n: int = 1,
        *,
        sim: dict[str, Any] | None = None,
        max_attempts: int = 3,
        backoff_base_s: float = 0.0,
    ) -> list[str]:
        specs = [
            TaskSpec(
                kind=TaskKind.GOAL,
                goal="fault suite",
                payload={"sim": sim if sim is not None else {"duration_s": 0.2}},
                project="default",
                owner="admin",
                retry=RetryPolicy(
                    max_attempts=max_attempts,
                    backoff_base_s=backoff_base_s,
                    backoff_cap_s=max(backoff_base_s, 2.0),
                ),
                # A retry after a commit whose reply was lost returns the same task.
                request_id=uuid.uuid4().hex,
            )
            for _ in range(n)
        ]
        ids: list[str] = await self.retrying(lambda: self.repo.submit_many(specs))
        self.acknowledged.submitted.update(ids)
        return ids

    async def states(self, ids: Sequence[str]) -> dict[str, str]:
        import sqlalchemy as sa

        from fleetlease.persistence import tables

        assert self.engine is not None
        engine = self.engine

        async def read() -> dict[str, str]:
            try:
                async with engine.connect() as conn:
                    rows = (
                        await conn.execute(
                            sa.select(tables.tasks.c.id, tables.tasks.c.status).where(
                                tables.tasks.c.id.in_(list(ids))
                            )
                        )
                    ).all()
            except (sa.exc.DBAPIError, OSError) as exc:
                raise Unavailable("harness read failed") from exc
            return {str(r[0]): str(r[1]) for r in rows}

        return await self.retrying(read)

    async def view(self, task_id: str) -> dict[str, Any]:
        """``task show`` of one task (attempts included), as the platform admin."""
        from fleetlease.persistence.model import User

        admin = User(name="admin", platform_admin=True)
        view: dict[str, Any] = await self.retrying(lambda: self.repo.task_view(task_id, admin))
        return view

    async def wait_view(
        self, task_id: str, ok: Callable[[dict[str, Any]], bool], *, timeout: float, what: str
    ) -> dict[str, Any]:
        view: dict[str, Any] = await wait_for(
            lambda: self.view(task_id), ok, timeout=timeout, what=what
        )
        return view

    async def wait_terminal(
        self, ids: Sequence[str], *, timeout: float = 90.0, sample: bool = True
    ) -> dict[str, str]:
        """Wait until every task is terminal, sampling the invariants meanwhile."""

        async def probe() -> dict[str, str]:
            if sample and self.engine is not None:
                await self.observer.sample(self.engine)
            return await self.states(ids)

        states: dict[str, str] = await wait_for(
            probe,
            lambda s: len(s) == len(ids) and all(v in TERMINAL for v in s.values()),
            timeout=timeout,
            what=f"{len(ids)} tasks terminal",
            interval=0.2,
        )
        return states

    # --- what clients were told, and the checks -----------------------------------------------
    def all_agent_runs(self) -> list[Proc]:
        return [run for a in self.agents.values() for run in a.runs]

    def collect_acknowledged(self) -> Acknowledged:
        """Results acknowledged to agents (from their logs) into ``acknowledged``."""
        ack = self.acknowledged
        ack.results.clear()
        ack.replays.clear()
        ack.acked.clear()
        for run in self.all_agent_runs():
            for e in run.named("attempt_acked"):
                ack.acked.add((str(e["task_id"]), int(e["attempt"])))
            for e in run.named("result_reported"):
                ack.result(
                    str(e["task_id"]),
                    int(e["attempt"]),
                    str(e.get("fingerprint")),
                    replayed=bool(e.get("replayed")),
                )
        return ack

    def first_reports(self) -> dict[tuple[str, int], int]:
        """(task, attempt) -> how many times agents were told their result was
        recorded for the first time (a second one is a duplicate terminal report)."""
        counts: dict[tuple[str, int], int] = {}
        for key, fps in self.collect_acknowledged().results.items():
            counts[key] = len(fps)
        return counts

    async def check(
        self, *, task_ids: set[str] | None = None, allow_active: bool = False
    ) -> Report:
        assert self.engine is not None
        engine = self.engine
        ack = self.collect_acknowledged()
        report = await self.retrying(
            lambda: _checked(engine, ack, self.observer, task_ids, allow_active)
        )
        for key, fps in ack.results.items():
            if len(fps) > 1:
                report.violations.append(
                    f"task {key[0]} attempt {key[1]}: {len(fps)} first-time terminal reports"
                )
        return report

    async def assert_invariants(
        self, *, task_ids: set[str] | None = None, allow_active: bool = False
    ) -> Report:
        report = await self.check(task_ids=task_ids, allow_active=allow_active)
        if report.violations:
            raise ClusterError(
                f"{len(report.violations)} invariant violations:\n"
                + "\n".join(report.violations[:30])
            )
        return report


async def _checked(
    engine: AsyncEngine,
    ack: Acknowledged,
    observer: Observer,
    task_ids: set[str] | None,
    allow_active: bool,
) -> Report:
    import sqlalchemy as sa

    try:
        return await check(
            engine,
            acknowledged=ack,
            observer=observer,
            task_ids=task_ids,
            allow_active=allow_active,
        )
    except (sa.exc.DBAPIError, OSError) as exc:
        raise Unavailable("invariant check could not read the database") from exc
