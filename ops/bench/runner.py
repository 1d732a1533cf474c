"""End-to-end benchmark of the whole system (``fleetlease bench``): figures, never
assertions.

Everything is measured in one run, on this machine, beside its calibration:

* **calibration**: pgbench simple-update TPS at 1 and 8 clients on the same
  PostgreSQL (a scratch database), and the nats-py request/reply round trip.
  The *transition ceiling* is pgbench TPS at 8 clients / 5: what PostgreSQL alone
  could do with one commit per transition of a task's life (submit, assign,
  claim, ack, result) and no software around it.
* **throughput**: the control plane is ``fleetlease serve`` in a subprocess (so its
  CPU and memory are its own); ``--hosts`` simulated agents (the real
  ``hostagent.agent.Agent``, in the benchmark process, journals on tmpfs when
  there is one) with ``--devices-per-host`` devices each. ``--tasks`` zero-duration
  tasks are submitted through the user API (batches of 100) and run to ``done``:
  tasks/s from the first submit to the last ``done``; commits per task
  (``pg_stat_database.xact_commit`` of the scratch database over the whole cell,
  start-up and heartbeats included); CPU seconds of the control plane per task;
  its peak RSS. Then the same tasks one by one at half that rate (or at
  ``--paced-rate``, a fixed rate that makes two runs' latencies comparable), for the
  latencies: assignment (the ``queued`` event, emitted after the submit commit,
  to the ``assigned`` event, emitted after the assignment commit) and dispatch
  (the ``assigned`` event to the agent holding the lease), p50/p99/max. Event
  times are the control plane's wall clock, the agent's is the benchmark's: one
  machine, one clock. An agent claims for a device while its last attempt
  reports the result, so a lease may reach it before that device is free: it
  holds the lease then (dispatch ends) and acks once the device is handed over
  (the wait is in the ack phase); ``handovers_waited`` counts those. A lease
  claimed by the transaction that assigned it (an agent's claim was parked for
  the device) is held at the assignment's commit: ``claimed_at_assignment`` is
  the share of attempts claimed so, saturated and paced.
* **renewals**: ``--renew-leases`` leases held by bare ``HostClient`` hosts and
  renewed as fast as they go (renewals/s, CPU per renewal, commits per renewal),
  then each once per ``--renew-period-s`` (CPU of the control plane in cores,
  and, for comparison, its cores while it holds the leases with no traffic);
  the RSS of the control plane per active lease.
* **recovery**: with ``--recovery-leases`` of those leases still active, SIGKILL
  the control plane, start it again, and time until every lease has been renewed
  again; then finish them all and count tasks lost or run twice (must be 0).
* **floor** (``--floor``, before the throughput cell): the actors and the
  write-through alone, in this process, with loops calling the ``ControlPlane``
  facade for hosts that cost nothing (``ops/bench/floor.py``): tasks/s,
  transitions/s, commits and CPU per task; the ratios floor / ceiling and
  whole system / floor. An upper bound for the whole system here.
* **peers** (``--peers``): the same N zero-duration jobs through procrastinate and
  pgqueuer (extra ``bench``), each alone on a scratch database of the same
  PostgreSQL, with the same worker concurrency (hosts x devices per host).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import psutil

from fleetlease.ops import eventloop
from fleetlease.ops.bench.transport import _admin, _with_database, pct

T = TypeVar("T")

SCHEMA = 1
SUBMIT_BATCH = 100
#: Payload of every benchmark task: the simulated runner returns at once.
ZERO = {"sim": {"duration_s": 0}}
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
_TAKE_RETRIES = 5
#: How long the renewal cell measures the control plane holding its leases idle.
_IDLE_S = 5.0


class BenchError(RuntimeError):
    """The benchmark could not run (a server, a child process, a timeout)."""


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    hosts: int = 4
    devices_per_host: int = 16
    tasks: int = 5000
    renew_leases: int = 10_000
    renew_period_s: float = 10.0
    renew_burst_s: float = 5.0
    recovery_leases: int = 1000
    calibration_s: float = 10.0
    #: Tasks/s of the latency run (None: half the throughput just measured). A
    #: fixed rate makes the latencies of two runs comparable: half of each
    #: run's own maximum moves with it.
    paced_rate: float | None = None
    peers: bool = False
    #: Also run the floor cell (``ops/bench/floor.py``): the actors and the
    #: write-through alone, no transport and no agents.
    floor: bool = False
    database_url: str | None = None
    nats_url: str | None = None
    progress: Callable[[str], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("hosts", "devices_per_host", "tasks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("renew_leases", "recovery_leases"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.recovery_leases > self.renew_leases:
            raise ValueError("recovery_leases must be <= renew_leases (they are reused)")
        for name in ("renew_period_s", "renew_burst_s", "calibration_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        rate = self.paced_rate
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate <= 100_000
        ):
            raise ValueError(f"paced_rate must be a number of tasks/s in (0, 100000], got {rate!r}")


# --- small helpers ---------------------------------------------------------------------


def _say(opts: BenchOptions, text: str) -> None:
    if opts.progress is not None:
        opts.progress(text)


def latency_ms(samples_s: Sequence[float]) -> dict[str, float | int | None]:
    """p50/p99/max in milliseconds (None without samples)."""
    if not samples_s:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    ms = [s * 1000.0 for s in samples_s]
    return {
        "n": len(ms),
        "p50_ms": round(pct(ms, 50), 3),
        "p99_ms": round(pct(ms, 99), 3),
        "max_ms": round(max(ms), 3),
    }


def _ts(iso: object) -> float | None:
    if not isinstance(iso, str):
        return None
    try:
        return datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 3)


async def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.01)


async def _until_all(
    count: Callable[[], int], total: int, what: str, stall_s: float = 60.0
) -> None:
    """Wait until ``count() == total``; give up only when it stops moving."""
    last, moved = -1, time.monotonic()
    while (n := count()) < total:
        if n != last:
            last, moved = n, time.monotonic()
        elif time.monotonic() - moved > stall_s:
            raise BenchError(f"{what}: stuck at {n} of {total} for {stall_s:.0f} s")
        await asyncio.sleep(0.01)


async def _bounded(concurrency: int, calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    sem = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with sem:
            return await call()

    return list(await asyncio.gather(*(one(c) for c in calls)))


def _machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy so far (every process; idle,
    I/O wait and steal excluded)."""
    t = psutil.cpu_times()
    return float(
        sum(getattr(t, f) for f in ("user", "nice", "system", "irq", "softirq") if hasattr(t, f))
    )


async def _xact_commit(url: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(_libpq_url(url))
    try:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        value = await conn.fetchval(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        return int(value)
    finally:
        await conn.close()


async def _claimed_at_assignment(url: str, task_ids: Sequence[str]) -> float | None:
    """The share of these tasks' attempts claimed by the transaction that
    assigned them (a long-poll was parked for the device: ``claimed_at`` is
    the assignment's own time)."""
    import asyncpg

    if not task_ids:
        return None
    conn = await asyncpg.connect(_libpq_url(url))
    try:
        row = await conn.fetchrow(
            "SELECT count(*) FILTER (WHERE claimed_at = assigned_at) AS fused, count(*) AS n"
            " FROM attempts WHERE task_id = ANY($1::uuid[])",
            list(task_ids),
        )
    finally:
        await conn.close()
    return round(row["fused"] / row["n"], 3) if row["n"] else None


def _libpq_url(url: str) -> str:
    """The URL as libpq and asyncpg spell it (no SQLAlchemy driver suffix)."""
    return re.sub(r"^postgresql\+\w+://", "postgresql://", url).replace(
        "postgres+asyncpg://", "postgresql://"
    )


def _tmpfs_dir(prefix: str) -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


# --- servers ----------------------------------------------------------------------------


@dataclass
class Servers:
    """The PostgreSQL server (an admin URL on it) and NATS the run uses."""

    database_url: str
    nats_url: str
    pgbench: str | None
    embedded: list[str]


@contextlib.asynccontextmanager
async def servers(opts: BenchOptions, work: Path) -> AsyncIterator[Servers]:
    from fleetlease.ops.embedded import EmbeddedNats, EmbeddedPostgres

    pg: EmbeddedPostgres | None = None
    nats_server: EmbeddedNats | None = None
    embedded: list[str] = []
    try:
        db_url = opts.database_url
        pgbench: str | None = None
        if db_url is None:
            pg = EmbeddedPostgres(work / "postgres", database="postgres")
            db_url = await asyncio.to_thread(pg.start)
            embedded.append("postgres")
            candidate = pg.bin("pgbench")
            pgbench = candidate if Path(candidate).exists() else None  # noqa: ASYNC240
        nats_url = opts.nats_url
        if nats_url is None:
            nats_server = EmbeddedNats(work / "nats")
            nats_url = await asyncio.to_thread(nats_server.start)
            embedded.append("nats")
        yield Servers(
            database_url=db_url,
            nats_url=nats_url,
            pgbench=pgbench or find_pgbench(),
            embedded=embedded,
        )
    finally:
        if nats_server is not None:
            await asyncio.to_thread(nats_server.stop)
        if pg is not None:
            await asyncio.to_thread(pg.stop)


def find_pgbench() -> str | None:
    found = shutil.which("pgbench")
    if found:
        return found
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / "pgbench").exists():
            return str(d / "pgbench")
    return None


@contextlib.asynccontextmanager
async def scratch_database(admin_url: str, tag: str) -> AsyncIterator[str]:
    name = f"fl_bench_{tag}_{uuid.uuid4().hex[:8]}"
    await _admin(admin_url, f'CREATE DATABASE "{name}"')
    try:
        yield _libpq_url(_with_database(admin_url, name))
    finally:
        with contextlib.suppress(Exception):
            await _admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- calibration ------------------------------------------------------------------------

_TPS_RE = re.compile(r"tps = ([0-9.]+) \(without initial connection time\)")


async def _run(cmd: list[str], timeout_s: float) -> str:
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise BenchError(f"{Path(cmd[0]).name} did not finish within {timeout_s:.0f} s") from None
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise BenchError(f"{Path(cmd[0]).name} failed ({proc.returncode}): {text[-500:]}")
    return text


async def pgbench_tps(pgbench: str, url: str, seconds: float) -> dict[str, Any]:
    scale = 10
    await _run([pgbench, "-i", "-q", "-s", str(scale), url], 300)
    out: dict[str, Any] = {"scale": scale, "seconds": seconds}
    for clients in (1, 8):
        text = await _run(
            [
                pgbench,
                "-b",
                "simple-update",
                "-c",
                str(clients),
                "-j",
                str(min(clients, 2)),
                "-T",
                str(max(1, round(seconds))),
                url,
            ],
            seconds + 120,
        )
        m = _TPS_RE.search(text) or re.search(r"tps = ([0-9.]+)", text)
        out[f"tps_{clients}"] = round(float(m.group(1)), 1) if m else None
    return out


async def nats_round_trip(nats_url: str, samples: int = 2000) -> dict[str, Any]:
    """Sequential request/reply round trips between two nats-py connections."""
    import nats
    import nats.errors

    server = await nats.connect(nats_url)
    client = await nats.connect(nats_url)
    try:
        subject = f"fl-bench-rtt.{uuid.uuid4().hex}"

        async def reply(msg: Any) -> None:
            await msg.respond(b"")

        await server.subscribe(subject, cb=reply)
        await server.flush()
        # Warm-up. Once in about forty runs the first request found no
        # responder although the subscription was flushed: wait for it.
        warm, deadline = 0, time.monotonic() + 10
        while warm < 50:
            try:
                await client.request(subject, b"x", timeout=5)
                warm += 1
            except nats.errors.NoRespondersError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.01)
        rtt: list[float] = []
        for _ in range(samples):
            t0 = time.perf_counter()
            await client.request(subject, b"x", timeout=5)
            rtt.append(time.perf_counter() - t0)
        return latency_ms(rtt)
    finally:
        await client.close()
        await server.close()


# --- the control plane as a child process ------------------------------------------------


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


def _timed_agent_class() -> type:
    from fleetlease.hostagent.agent import Agent

    class TimedAgent(Agent):
        """The real agent, noting when it receives each lease (wall clock)."""

        held_at: dict[str, float]

        async def _accept(self, a: Any, devices: list[str]) -> None:
            self.held_at[a.task_id] = time.time()
            await super()._accept(a, devices)

    return TimedAgent


# --- the cells --------------------------------------------------------------------------


@dataclass
class Fleet:
    """What the cells share: the scratch database, NATS, the user and its token."""

    db_url: str
    nats_url: str
    prefix: str
    token: str
    work: Path


async def _setup_fleet(db_url: str, nats_url: str, work: Path) -> Fleet:
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


async def _with_repo(db_url: str, fn: Callable[[Any], Awaitable[T]]) -> T:
    from fleetlease.persistence.db import create_engine
    from fleetlease.persistence.repository import Repository

    engine = create_engine(db_url, pool_size=4)
    try:
        return await fn(Repository(engine))
    finally:
        await engine.dispose()


async def _add_hosts(db_url: str, names: Sequence[str]) -> dict[str, str]:
    async def run(repo: Any) -> dict[str, str]:
        return {h: await repo.add_host(h) for h in names}

    return await _with_repo(db_url, run)


async def _revoke_hosts(db_url: str, names: Sequence[str]) -> None:
    async def run(repo: Any) -> None:
        for h in names:
            await repo.revoke_host(h)

    await _with_repo(db_url, run)


async def _submit(ops: Any, n: int, batch: int = SUBMIT_BATCH) -> list[str]:
    ids: list[str] = []

    async def one(count: int) -> list[str]:
        reply = await ops.call("submit", goal="bench", payload=ZERO, count=count)
        return list(reply["ids"])

    sizes = [min(batch, n - i) for i in range(0, n, batch)]
    for got in await _bounded(4, [lambda c=c: one(c) for c in sizes]):  # type: ignore[misc]
        ids.extend(got)
    return ids


async def throughput_cell(opts: BenchOptions, fleet: Fleet) -> dict[str, Any]:
    """Agents run N zero-duration tasks at full speed, then at half that rate."""
    from fleetlease.hostagent.agent import AgentConfig
    from fleetlease.hostagent.devices import SimulatedDeviceManager
    from fleetlease.ops.client import OpsClient

    host_ids = [f"tp-{i}" for i in range(opts.hosts)]
    creds = await _add_hosts(fleet.db_url, host_ids)
    state = fleet.work / "serve-throughput"
    state.mkdir()
    serve = ServeProcess(
        database_url=fleet.db_url,
        nats_url=fleet.nats_url,
        state_dir=state,
        prefix=fleet.prefix,
        token=fleet.token,
    )
    commits_before = await _xact_commit(fleet.db_url)
    serve.spawn()
    events = Events()
    agents: list[tuple[Any, asyncio.Task[None]]] = []
    journals = _tmpfs_dir("fleetlease-bench-agents-")
    held_at: dict[str, float] = {}
    try:
        await serve.ready()
        await events.start(fleet.nats_url, f"{fleet.prefix}.events.task")
        timed_agent = _timed_agent_class()
        for h in host_ids:
            cfg = AgentConfig(
                host_id=h,
                credential=creds[h],
                nats_url=fleet.nats_url,
                state_dir=journals / h,
                prefix=fleet.prefix,
                resync_jitter_s=0.0,
                claim_wait_s=20.0,
            )
            agent = timed_agent(
                cfg, SimulatedDeviceManager(opts.devices_per_host, prefix=f"{h}-dev")
            )
            agent.held_at = held_at
            agents.append((agent, asyncio.ensure_future(agent.run())))
        await _until(
            lambda: all(a.started.is_set() or t.done() for a, t in agents), 60, "agents to start"
        )
        for _, t in agents:
            if t.done():
                t.result()
        async with OpsClient(
            nats_url=fleet.nats_url, token=fleet.token, prefix=fleet.prefix, timeout_s=30.0
        ) as ops:
            # Warm-up: every device runs a task once.
            warm = await _submit(ops, opts.hosts * opts.devices_per_host)
            await _until_all(events.watch(warm, "done"), len(set(warm)), "warm-up tasks")

            _say(opts, f"throughput: {opts.tasks} tasks")
            marks = _cpu_marks(serve)
            t0 = time.time()
            ids = await _submit(ops, opts.tasks)
            await _until_all(events.watch(ids, "done"), len(set(ids)), "tasks done")
            cpu, agents_cpu, machine_cpu = _cpu_since(serve, marks)
            last = max(events.at[t]["done"] for t in ids)
            tps = len(ids) / max(last - t0, 1e-9)
            saturated = _latencies(ids, events, held_at)

            # Latency at half the throughput just measured (or at --paced-rate):
            # one submit per task.
            rate = opts.paced_rate if opts.paced_rate is not None else max(tps / 2, 1.0)
            n_paced = max(1, min(opts.tasks, round(rate * 10)))
            _say(opts, f"latency: {n_paced} tasks at {rate:.0f}/s")
            paced_ids: list[str] = []
            pending: set[asyncio.Task[Any]] = set()
            paced_marks = _cpu_marks(serve)
            t_paced = time.time()
            start = time.monotonic()
            for i in range(n_paced):
                delay = start + i / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.ensure_future(ops.call("submit", goal="bench", payload=ZERO))
                pending.add(task)
            for reply in await asyncio.gather(*pending):
                paced_ids.append(str(reply["id"]))
            await _until_all(
                events.watch(paced_ids, "done"), len(set(paced_ids)), "paced tasks done"
            )
            paced = _latencies(paced_ids, events, held_at)
            paced_s = max(events.at[t]["done"] for t in paced_ids) - t_paced
            paced_cpu = _cpu_since(serve, paced_marks)
        peak = serve.peak_rss()
        for agent, _ in agents:
            agent.stop()
        await asyncio.gather(*(asyncio.wait_for(t, 60) for _, t in agents))
        handovers = sum(agent.stats.handovers_waited for agent, _ in agents)
        agents.clear()
        await serve.stop()
        total = len(warm) + len(ids) + len(paced_ids)
        commits = await _xact_commit(fleet.db_url) - commits_before
        saturated["claimed_at_assignment"] = await _claimed_at_assignment(fleet.db_url, ids)
        paced["claimed_at_assignment"] = await _claimed_at_assignment(fleet.db_url, paced_ids)
        return {
            "tasks": len(ids),
            "tasks_per_s": round(tps, 1),
            "cpu_s_per_task": round(cpu / len(ids), 6),
            # CPU of the benchmark process (the in-process agents, plus the
            # submitting user client and the event subscriber) per task.
            "agents_cpu_s_per_task": round(agents_cpu / len(ids), 6),
            # Every process of the machine (PostgreSQL and NATS included): what a
            # task costs the whole system here.
            "machine_cpu_s_per_task": round(machine_cpu / len(ids), 6),
            "control_plane_cpu_cores": round(cpu / max(last - t0, 1e-9), 3),
            "commits_per_task": round(commits / total, 3),
            "commits_counted_over_tasks": total,
            "peak_rss_mib": round(peak / 2**20, 1),
            # Assignments (of the whole cell) that reached an agent while the
            # device's last attempt still waited for its result's answer: the
            # host held the lease (dispatch ends) and acked once the device
            # was handed over (in the ack phase).
            "handovers_waited": handovers,
            "saturated": saturated,
            "at_half_throughput": {
                "rate_per_s": round(rate, 1),
                "rate_from": "--paced-rate"
                if opts.paced_rate is not None
                else "half of tasks_per_s",
                **paced,
                # CPU per task (control plane, benchmark process, whole machine)
                # and the machine's busy cores, from the first paced submit to
                # the last paced task done: one task at a time costs more than
                # in the batches of the saturated run.
                "cpu_s_per_task": round(paced_cpu[0] / len(paced_ids), 6),
                "agents_cpu_s_per_task": round(paced_cpu[1] / len(paced_ids), 6),
                "machine_cpu_s_per_task": round(paced_cpu[2] / len(paced_ids), 6),
                "machine_busy_cores": round(paced_cpu[2] / max(paced_s, 1e-9), 2),
            },
        }
    finally:
        for agent, t in agents:
            agent.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 30)
        await events.close()
        await serve.stop()
        shutil.rmtree(journals, ignore_errors=True)
        await _revoke_hosts(fleet.db_url, host_ids)


def _cpu_marks(serve: ServeProcess) -> tuple[float, float, float]:
    """CPU seconds so far of the control plane, of this process (the agents,
    mostly) and of the whole machine."""
    return serve.cpu_s(), time.process_time(), _machine_busy_s()


def _cpu_since(
    serve: ServeProcess, marks: tuple[float, float, float]
) -> tuple[float, float, float]:
    """``_cpu_marks`` now, less ``marks``."""
    now = _cpu_marks(serve)
    return now[0] - marks[0], now[1] - marks[1], now[2] - marks[2]


def _latencies(ids: Sequence[str], events: Events, held_at: dict[str, float]) -> dict[str, Any]:
    assign: list[float] = []
    dispatch: list[float] = []
    for t in ids:
        at = events.at.get(t, {})
        if "queued" in at and "assigned" in at:
            assign.append(max(0.0, at["assigned"] - at["queued"]))
        if "assigned" in at and t in held_at:
            dispatch.append(max(0.0, held_at[t] - at["assigned"]))
    # Where a task's life goes, as the control plane stamped it: claim
    # (assignment commit to claim commit), ack (claim to ack commit), report (ack
    # to result commit: a zero-duration run, journal writes and the report).
    phases: dict[str, list[float]] = {"claim": [], "ack": [], "report": []}
    steps = (
        ("claim", "assigned", "dispatched"),
        ("ack", "dispatched", "running"),
        ("report", "running", "done"),
    )
    for t in ids:
        at = events.at.get(t, {})
        for name, a, b in steps:
            if a in at and b in at:
                phases[name].append(max(0.0, at[b] - at[a]))
    return {
        "assignment": latency_ms(assign),
        "dispatch": latency_ms(dispatch),
        "phases": {name: latency_ms(v) for name, v in phases.items()},
    }


@dataclass
class _Lease:
    client: Any
    task_id: str
    attempt: int
    token: str
    renewed_at: float = 0.0


async def lease_cells(opts: BenchOptions, fleet: Fleet) -> dict[str, Any]:
    """The renewal cell, then the recovery cell on the same control plane."""
    from fleetlease.ops.client import OpsClient
    from fleetlease.transport import wire
    from fleetlease.transport.client import HostClient

    k = opts.renew_leases
    if k == 0:
        return {"renewals": None, "recovery": None}
    per_host = 1000
    host_ids = [f"rn-{i}" for i in range(math.ceil(k / per_host))]
    creds = await _add_hosts(fleet.db_url, host_ids)
    state = fleet.work / "serve-leases"
    state.mkdir()
    serve = ServeProcess(
        database_url=fleet.db_url,
        nats_url=fleet.nats_url,
        state_dir=state,
        prefix=fleet.prefix,
        token=fleet.token,
        # Long enough to outlast leasing every task (the first leases must not
        # expire while the last are claimed); renewals cost the same whatever it is.
        lease_s=max(600.0, 3 * opts.renew_period_s),
        claim_s=600.0,
        ack_s=600.0,
        liveness_s=3600.0,
    )
    serve.spawn()
    clients: list[HostClient] = []
    try:
        await serve.ready()
        for i, h in enumerate(host_ids):
            c = HostClient(
                nats_url=fleet.nats_url,
                host_id=h,
                credential=creds[h],
                prefix=fleet.prefix,
                timeout_s=30.0,
            )
            await c.connect()
            clients.append(c)
            await c.register()
            n_dev = min(per_host, k - i * per_host)
            await c.heartbeat([wire.Device(device_id=f"{h}-d{j}") for j in range(n_dev)])
        await asyncio.sleep(1.0)
        rss_before = serve.rss()
        _say(opts, f"renewals: leasing {k} tasks")
        async with OpsClient(
            nats_url=fleet.nats_url, token=fleet.token, prefix=fleet.prefix, timeout_s=60.0
        ) as ops:
            await _submit(ops, k, batch=1000)
        leases: list[_Lease] = []
        # A request that times out (``unavailable``) is retried, as an agent
        # does, instead of failing the cell: an ack is idempotent; a claim
        # whose reply was lost may have committed, leaving that task claimed
        # by nobody until its claim deadline, so a host stops polling once
        # every task it was given is leased or may have been lost that way.
        lost_claims = 0

        async def retrying(call: Callable[[], Awaitable[T]]) -> T:
            for _ in range(_TAKE_RETRIES):
                try:
                    return await call()
                except Exception as exc:
                    if getattr(exc, "code", None) != "unavailable":
                        raise
            return await call()

        async def renew(lease: _Lease) -> None:
            await retrying(lambda: lease.client.renew(lease.task_id, lease.attempt, lease.token))

        async def take(c: HostClient, host: dict[str, int]) -> None:
            nonlocal lost_claims
            while host["got"] + host["suspect"] < host["want"]:
                try:
                    a = await c.claim(5.0)
                except Exception as exc:
                    if getattr(exc, "code", None) != "unavailable":
                        raise
                    host["suspect"] += 1
                    lost_claims += 1
                    continue
                if a is None:
                    continue
                await retrying(functools.partial(c.ack, a.task_id, a.attempt, a.lease_token))
                leases.append(_Lease(c, a.task_id, a.attempt, a.lease_token))
                host["got"] += 1
                if host["suspect"]:
                    # That claim had not committed after all: poll for it again.
                    host["suspect"] -= 1
                    lost_claims -= 1

        t_lease = time.monotonic()
        jobs: list[Awaitable[None]] = []
        for i, c in enumerate(clients):
            want = min(per_host, k - i * per_host)
            # A few claims in flight per host.
            host = {"want": want, "got": 0, "suspect": 0}
            jobs.extend(take(c, host) for _ in range(min(8, want)))
        await asyncio.gather(*jobs)
        t_lease = time.monotonic() - t_lease
        await asyncio.sleep(1.0)
        rss_full = serve.rss()
        # What holding the leases costs with no traffic (timers, the watchdog,
        # the garbage collector), apart from what each renewal costs.
        cpu0, t0 = serve.cpu_s(), time.monotonic()
        await asyncio.sleep(_IDLE_S)
        idle_cores = (serve.cpu_s() - cpu0) / (time.monotonic() - t0)

        # Renewals as fast as they go.
        _say(opts, f"renewals: burst for {opts.renew_burst_s:.0f} s")
        done = 0
        stop_at = time.monotonic() + opts.renew_burst_s
        cursor = 0

        async def renewer() -> None:
            nonlocal done, cursor
            while time.monotonic() < stop_at:
                lease = leases[cursor % len(leases)]
                cursor += 1
                await renew(lease)
                done += 1

        commits0 = await _xact_commit(fleet.db_url)
        cpu0, t0 = serve.cpu_s(), time.monotonic()
        await asyncio.gather(*(renewer() for _ in range(min(128, len(leases)))))
        burst_wall = time.monotonic() - t0
        burst_cpu = serve.cpu_s() - cpu0
        burst_rate = done / burst_wall
        # Statistics reach pg_stat_database at most once a second per backend.
        await asyncio.sleep(1.5)
        commits = await _xact_commit(fleet.db_url) - commits0

        # Each lease once per period, spread evenly.
        period = opts.renew_period_s
        _say(opts, f"renewals: {len(leases)} leases every {period:.0f} s")
        renew_lat: list[float] = []

        async def paced(i: int, lease: _Lease, t_start: float) -> None:
            await asyncio.sleep(max(0.0, t_start + period * i / len(leases) - time.monotonic()))
            t = time.perf_counter()
            await renew(lease)
            renew_lat.append(time.perf_counter() - t)

        commits0 = await _xact_commit(fleet.db_url)
        cpu0, t0 = serve.cpu_s(), time.monotonic()
        await asyncio.gather(*(paced(i, le, t0) for i, le in enumerate(leases)))
        paced_wall = time.monotonic() - t0
        paced_cpu = serve.cpu_s() - cpu0
        await asyncio.sleep(1.5)
        paced_commits = await _xact_commit(fleet.db_url) - commits0
        renewals = {
            "leases": len(leases),
            "lease_and_ack_s": round(t_lease, 2),
            "claim_timeouts_unrecovered": lost_claims,
            "rss_per_lease_kib": round((rss_full - rss_before) / len(leases) / 1024, 2),
            "burst_renewals_per_s": round(burst_rate, 1),
            "burst_cpu_s_per_renewal": round(burst_cpu / max(done, 1), 6),
            "burst_commits_per_renewal": round(commits / max(done, 1), 3),
            "period_s": period,
            "paced_renewals_per_s": round(len(leases) / paced_wall, 1),
            "paced_control_plane_cpu_cores": round(paced_cpu / paced_wall, 3),
            "idle_control_plane_cpu_cores": round(idle_cores, 3),
            "paced_commits_per_renewal": round(paced_commits / max(len(leases), 1), 3),
            "paced_round_trip": latency_ms(renew_lat),
        }

        # Recovery: keep R leases, finish the rest.
        r = opts.recovery_leases
        keep, finish = leases[:r], leases[r:]
        await _bounded(
            64,
            [
                lambda le=le: le.client.result(  # type: ignore[misc]
                    le.task_id, le.attempt, le.token, outcome="done", fingerprint="bench"
                )
                for le in finish
            ],
        )
        recovery = await _recovery(opts, fleet, serve, keep) if keep else None
        return {"renewals": renewals, "recovery": recovery}
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                await c.close()
        await serve.stop()
        await _revoke_hosts(fleet.db_url, host_ids)


async def _recovery(
    opts: BenchOptions, fleet: Fleet, serve: ServeProcess, keep: list[_Lease]
) -> dict[str, Any]:
    _say(opts, f"recovery: SIGKILL with {len(keep)} active leases")
    t_kill = time.monotonic()
    serve.kill()
    serve.spawn()
    restart_s = await serve.ready()

    async def renew_until_ok(lease: _Lease) -> None:
        while True:
            try:
                await lease.client.renew(lease.task_id, lease.attempt, lease.token)
            except Exception as exc:
                if getattr(exc, "code", None) not in ("unavailable", "internal"):
                    raise BenchError(f"a lease was refused after the restart: {exc}") from exc
                await asyncio.sleep(0.02)
                continue
            lease.renewed_at = time.monotonic()
            return

    await _bounded(256, [lambda le=le: renew_until_ok(le) for le in keep])  # type: ignore[misc]
    recovered_s = max(le.renewed_at for le in keep) - t_kill
    await _bounded(
        64,
        [
            lambda le=le: le.client.result(  # type: ignore[misc]
                le.task_id, le.attempt, le.token, outcome="done", fingerprint="bench"
            )
            for le in keep
        ],
    )
    ids = [le.task_id for le in keep]

    async def check(repo: Any) -> tuple[int, int]:
        import sqlalchemy as sa

        from fleetlease.persistence.tables import attempts, tasks

        async with repo.engine.connect() as conn:
            done = (
                await conn.execute(
                    sa.select(sa.func.count())
                    .select_from(tasks)
                    .where(tasks.c.id.in_(ids), tasks.c.status == "done")
                )
            ).scalar_one()
            twice = (
                await conn.execute(
                    sa.select(sa.func.count()).select_from(
                        sa.select(attempts.c.task_id)
                        .where(attempts.c.task_id.in_(ids))
                        .group_by(attempts.c.task_id)
                        .having(sa.func.count() > 1)
                        .subquery()
                    )
                )
            ).scalar_one()
        return int(done), int(twice)

    done, twice = await _with_repo(fleet.db_url, check)
    return {
        "leases": len(keep),
        "restart_s": round(restart_s, 3),
        "all_leases_served_s": round(recovered_s, 3),
        "lost": len(keep) - done,
        "duplicated": twice,
    }


# --- peers ------------------------------------------------------------------------------


async def procrastinate_jobs_per_s(url: str, n: int, concurrency: int) -> dict[str, Any]:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))

    async def noop() -> None:
        return None

    task = app.task(name="noop", queue="bench")(noop)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        t0 = time.perf_counter()
        for i in range(0, n, SUBMIT_BATCH):
            await task.batch_defer_async(*[{} for _ in range(min(SUBMIT_BATCH, n - i))])
        await app.run_worker_async(
            queues=["bench"],
            concurrency=concurrency,
            wait=False,
            install_signal_handlers=False,
            listen_notify=False,
        )
        elapsed = time.perf_counter() - t0
    version = getattr(procrastinate, "__version__", None)
    return {"version": version, "jobs": n, "jobs_per_s": round(n / elapsed, 1)}


async def pgqueuer_jobs_per_s(url: str, n: int, concurrency: int) -> dict[str, Any]:
    import asyncpg
    import pgqueuer
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.qm import QueueManager
    from pgqueuer.queries import Queries
    from pgqueuer.types import QueueExecutionMode

    batch_size = 10  # pgqueuer's default
    conn = await asyncpg.connect(url)
    try:
        driver = AsyncpgDriver(conn)
        queries = Queries(driver)
        await queries.install()
        qm = QueueManager(queries)
        finished = 0

        async def noop(job: Any) -> None:
            nonlocal finished
            finished += 1

        qm.entrypoint("noop")(noop)
        t0 = time.perf_counter()
        for i in range(0, n, SUBMIT_BATCH):
            m = min(SUBMIT_BATCH, n - i)
            await queries.enqueue(["noop"] * m, [None] * m, [0] * m)
        await qm.run(
            batch_size=batch_size,
            mode=QueueExecutionMode.drain,
            max_concurrent_tasks=max(concurrency, 2 * batch_size),
        )
        elapsed = time.perf_counter() - t0
    finally:
        with contextlib.suppress(Exception):
            await conn.close()
    return {
        "version": getattr(pgqueuer, "__version__", None),
        "jobs": n,
        "finished": finished,
        "batch_size": batch_size,
        "jobs_per_s": round(n / elapsed, 1),
    }


async def peers_cell(opts: BenchOptions, admin_url: str) -> dict[str, Any]:
    concurrency = opts.hosts * opts.devices_per_host
    out: dict[str, Any] = {"concurrency": concurrency}
    for name, fn in (
        ("procrastinate", procrastinate_jobs_per_s),
        ("pgqueuer", pgqueuer_jobs_per_s),
    ):
        _say(opts, f"peers: {name}")
        try:
            async with scratch_database(admin_url, name) as url:
                out[name] = await fn(url, opts.tasks, concurrency)
        except ModuleNotFoundError as exc:
            out[name] = {"error": f"not installed ({exc.name}): pip install 'fleetlease[bench]'"}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


# --- the run ----------------------------------------------------------------------------


async def run(opts: BenchOptions) -> dict[str, Any]:
    """Run every cell; returns the report (the JSON of ``fleetlease bench --json``)."""
    work = Path(tempfile.mkdtemp(prefix="fleetlease-bench-"))
    try:
        async with servers(opts, work) as srv:
            report: dict[str, Any] = {
                "schema": SCHEMA,
                "setup": {
                    "hosts": opts.hosts,
                    "devices_per_host": opts.devices_per_host,
                    "tasks": opts.tasks,
                    "agents": f"in-process (the benchmark process, {eventloop.loop_name()} loop), "
                    "journals on tmpfs",
                    "control_plane": f"fleetlease serve subprocess, {eventloop.loop_name()} loop",
                    "submit": f"user API over NATS, batches of {SUBMIT_BATCH}",
                    "cpus": os.cpu_count(),
                    "embedded": srv.embedded,
                    "python": sys.version.split()[0],
                },
            }
            _say(opts, "calibration: NATS round trip")
            calibration: dict[str, Any] = {"nats_round_trip": await nats_round_trip(srv.nats_url)}
            if srv.pgbench is None:
                calibration["pgbench"] = {"error": "pgbench not found"}
            else:
                _say(opts, "calibration: pgbench")
                async with scratch_database(srv.database_url, "pgbench") as url:
                    calibration["pgbench"] = await pgbench_tps(srv.pgbench, url, opts.calibration_s)
            tps8 = calibration["pgbench"].get("tps_8")
            ceiling = round(tps8 / 5, 1) if tps8 else None
            calibration["transition_ceiling_tasks_per_s"] = ceiling
            report["calibration"] = calibration

            if opts.floor:
                _say(opts, "floor: the control plane's core alone")
                from fleetlease.ops.bench.floor import floor_cell

                try:
                    async with scratch_database(srv.database_url, "floor") as url:
                        report["floor"] = await floor_cell(
                            url,
                            hosts=opts.hosts,
                            devices_per_host=opts.devices_per_host,
                            tasks=opts.tasks,
                            machine_busy_s=_machine_busy_s,
                            xact_commit=_xact_commit,
                        )
                except Exception as exc:  # one failed cell must not lose the others
                    report["floor"] = {"error": f"{type(exc).__name__}: {exc}"}
            async with scratch_database(srv.database_url, "fleet") as db_url:
                fleet = await _setup_fleet(db_url, srv.nats_url, work)
                _say(opts, "throughput")
                report["throughput"] = await throughput_cell(opts, fleet)
                try:
                    cells = await lease_cells(opts, fleet)
                except Exception as exc:  # one failed cell must not lose the others
                    error = {"error": f"{type(exc).__name__}: {exc}"}
                    cells = {"renewals": error, "recovery": error}
                report["renewals"] = cells["renewals"]
                report["recovery"] = cells["recovery"]
            ours = report["throughput"]["tasks_per_s"]
            ratios: dict[str, Any] = {"of_transition_ceiling": _ratio(ours, ceiling)}
            if opts.floor:
                floor = report["floor"].get("tasks_per_s")
                ratios["floor_of_transition_ceiling"] = _ratio(floor, ceiling)
                ratios["of_floor"] = _ratio(ours, floor)
            if opts.peers:
                peers = await peers_cell(opts, srv.database_url)
                report["peers"] = peers
                for name in ("procrastinate", "pgqueuer"):
                    ratios[f"vs_{name}"] = _ratio(ours, peers.get(name, {}).get("jobs_per_s"))
            report["ratios"] = ratios
    except Exception as exc:
        # Keep the control plane's logs for a post-mortem.
        raise BenchError(f"{type(exc).__name__}: {exc} (logs kept in {work})") from exc
    shutil.rmtree(work, ignore_errors=True)
    return report


def options_dict(opts: BenchOptions) -> dict[str, Any]:
    d = asdict(opts)
    d.pop("progress", None)
    return d
