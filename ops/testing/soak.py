"""``fleetlease soak``: the whole system under a seeded fault schedule, with
figures.

It owns everything it runs (``fleetlease.ops.testing.cluster.Cluster`` in a work directory): an
embedded PostgreSQL behind a fault proxy, an embedded nats-server, two
``fleetlease serve`` processes sharing the work, and simulated hosts
(``fleetlease agent`` processes, each behind its own NATS fault proxy, restarted
by a supervisor when they die). A submitter keeps a seeded mix of tasks coming
(quick successes, failures, retryable failures); an observer samples the
invariants all along; a fault scheduler injects, one after another, seeded
faults:

``serve_kill``      SIGKILL one serve process, start it again
``pg_restart``      PostgreSQL ``stop -m immediate``, down 1-4 s, start again
``nats_restart``    nats-server SIGKILL, down 0.5-3 s, start again (same port)
``pg_latency``      50 +/- 50 ms latency between the control plane and PostgreSQL for 3-6 s
``pg_reset``        every control-plane connection to PostgreSQL reset at once
``pg_bandwidth``    the control plane's PostgreSQL traffic limited to 32 KB/s for 3-6 s
``agent_partition`` one agent blackholed from NATS for longer than a lease
``agent_stop``      one agent SIGSTOPped for longer than a lease, then SIGCONT
``agent_half_open`` one agent's NATS connections half-open (server side gone, the
                    agent not told) for longer than a lease, then reset
``agent_kill``      one agent SIGKILLed (its supervisor restarts it)
``actor_kill``      one actor crashed inside a running serve: a seeded fail point
                    of ``actors.failpoints`` armed once through the serve's chaos
                    hook (``FLEETLEASE_CHAOS_DIR``, SIGUSR1); the fault lasts until
                    the serve logged the crash and the supervisor's restart

Recovery time of a fault: from its end (restart, heal) until the next task
reaches a terminal state. At the end every fault is healed, submitting stops,
every task must reach a terminal state, and the invariants of
``fleetlease.ops.testing.invariants`` are checked on the database. The report gives tasks
submitted, finished by state, faults by kind, invariant violations (must be 0)
and the recovery times.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import structlog

from fleetlease.actors import failpoints
from fleetlease.ops.testing.cluster import Cluster, ClusterError, Timings, wait_for
from fleetlease.persistence import tables

log = structlog.get_logger("fleetlease.soak")

FAULT_WEIGHTS: dict[str, int] = {
    "serve_kill": 2,
    "pg_restart": 2,
    "nats_restart": 2,
    "pg_latency": 1,
    "pg_reset": 1,
    "pg_bandwidth": 1,
    "agent_partition": 2,
    "agent_stop": 1,
    "agent_half_open": 1,
    "agent_kill": 2,
    "actor_kill": 2,
}
RECOVERY_TIMEOUT_S = 60.0


@dataclass(kw_only=True)
class SoakConfig:
    minutes: float = 1.0
    seed: int = 1
    hosts: int = 3
    devices: int = 3
    serves: int = 2
    #: Tasks submitted per second (in small batches).
    rate: float = 3.0
    #: Seconds between the recovery of one fault and the next fault.
    fault_gap_s: tuple[float, float] = (2.0, 5.0)
    drain_timeout_s: float = 180.0
    timings: Timings = field(default_factory=Timings)


@dataclass
class FaultRecord:
    kind: str
    at_s: float
    detail: str
    recovery_s: float | None = None


@dataclass
class SoakReport:
    seed: int
    minutes: float
    submitted: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    unfinished: int = 0
    faults: list[FaultRecord] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    samples: int = 0
    elapsed_s: float = 0.0
    work_dir: str = ""

    @property
    def ok(self) -> bool:
        return not self.violations and self.unfinished == 0

    def faults_by_kind(self) -> dict[str, int]:
        return dict(Counter(f.kind for f in self.faults))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["faults_by_kind"] = self.faults_by_kind()
        data["ok"] = self.ok
        return data

    def render(self) -> str:
        lines = [
            f"fleetlease soak: seed {self.seed}, {self.minutes:g} min of faults, "
            f"{self.elapsed_s:.0f}s in all (work dir {self.work_dir})",
            f"  tasks submitted      {self.submitted}",
            "  finished by state    "
            + (", ".join(f"{k} {v}" for k, v in sorted(self.finished.items())) or "none"),
            f"  not finished         {self.unfinished}",
            "  faults injected      "
            + (", ".join(f"{k} {v}" for k, v in sorted(self.faults_by_kind().items())) or "none"),
            f"  invariant samples    {self.samples}",
            f"  invariant violations {len(self.violations)}",
        ]
        lines += [f"    - {v}" for v in self.violations[:50]]
        lines.append("  recovery after each fault (s, until the next task finished):")
        for f in self.faults:
            rec = "not recovered" if f.recovery_s is None else f"{f.recovery_s:.2f}"
            lines.append(f"    {f.at_s:7.1f}s  {f.kind:<16} {rec:>14}  {f.detail}")
        by_kind: dict[str, list[float]] = {}
        for f in self.faults:
            if f.recovery_s is not None:
                by_kind.setdefault(f.kind, []).append(f.recovery_s)
        if by_kind:
            lines.append("  recovery by kind (s): min / median / max")
            for kind, values in sorted(by_kind.items()):
                lines.append(
                    f"    {kind:<16} {min(values):.2f} / {statistics.median(values):.2f} / "
                    f"{max(values):.2f}"
                )
        lines.append("  result: " + ("OK" if self.ok else "FAILED"))
        return "\n".join(lines)


class Soak:
    def __init__(self, config: SoakConfig, work_dir: Path) -> None:
        self.config = config
        # Separate streams: the fault schedule (kinds, targets, durations) is the
        # same for a seed however the submitter's timing interleaves with it.
        self.rng = random.Random(config.seed)
        self.task_rng = random.Random(config.seed + 1)
        self.cluster = Cluster(
            work_dir,
            timings=config.timings,
            prefix="soak",
            pg_proxy=True,
            seed=config.seed,
            chaos=True,
        )
        self.report = SoakReport(seed=config.seed, minutes=config.minutes, work_dir=str(work_dir))
        self.ids: list[str] = []
        self.stopping = asyncio.Event()
        self.t0 = 0.0
        #: Agents that must not be restarted by the supervisor right now (stopped).
        self.paused: set[str] = set()

    @property
    def host_ids(self) -> list[str]:
        return [f"soak-h{i}" for i in range(self.config.hosts)]

    def now(self) -> float:
        return time.monotonic() - self.t0

    # --- the run --------------------------------------------------------------------------
    async def run(self) -> SoakReport:
        cfg = self.config
        self.t0 = time.monotonic()
        async with self.cluster as c:
            for i in range(cfg.serves):
                await c.start_serve(i)
            await asyncio.gather(
                *(c.start_agent(h, devices=cfg.devices, via_proxy=True) for h in self.host_ids)
            )
            background = [
                asyncio.ensure_future(self.submitter()),
                asyncio.ensure_future(self.sampler()),
                asyncio.ensure_future(self.supervisor()),
            ]
            try:
                await self.fault_phase(cfg.minutes * 60.0)
                self.stopping.set()
                await self.heal_everything()
                await background[0]
                await self.drain()
            finally:
                self.stopping.set()
                for t in background:
                    t.cancel()
                await asyncio.gather(*background, return_exceptions=True)
            final = await c.check()
            self.report.violations = final.violations
            self.report.finished = {
                k: v for k, v in final.by_state.items() if k in ("done", "failed", "cancelled")
            }
            self.report.unfinished = sum(
                v for k, v in final.by_state.items() if k not in ("done", "failed", "cancelled")
            )
            self.report.samples = c.observer.samples
        self.report.submitted = len(self.ids)
        self.report.elapsed_s = self.now()
        return self.report

    async def submitter(self) -> None:
        cfg = self.config
        batch = max(1, round(cfg.rate))
        while not self.stopping.is_set():
            specs = [self.task_mix() for _ in range(batch)]
            for sim, attempts in specs:
                try:
                    [tid] = await self.cluster.submit(
                        1, sim=sim, max_attempts=attempts, backoff_base_s=0.2
                    )
                except Exception as exc:  # the database is down: try again later
                    log.info("soak_submit_failed", error=str(exc)[:200])
                    break
                self.ids.append(tid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), batch / cfg.rate)

    def task_mix(self) -> tuple[dict[str, Any], int]:
        roll = self.task_rng.random()
        sim: dict[str, Any] = {"duration_s": round(self.task_rng.uniform(0.1, 1.5), 2)}
        if roll < 0.08:
            sim["outcome"] = "failed"
        elif roll < 0.2:
            sim["outcome"] = "retryable"
        return sim, 4

    async def sampler(self) -> None:
        engine = self.cluster.engine
        assert engine is not None
        while True:
            await self.cluster.observer.sample(engine)
            await asyncio.sleep(1.0)

    async def supervisor(self) -> None:
        """Restart dead agents (as ``fleetlease up`` does), and dead serves."""
        c = self.cluster
        while True:
            for h, agent in c.agents.items():
                if not agent.proc.alive and h not in self.paused:
                    with contextlib.suppress(ClusterError):
                        await c.start_agent(h, wait=False)
            await asyncio.sleep(0.5)

    # --- faults ---------------------------------------------------------------------------
    async def fault_phase(self, seconds: float) -> None:
        # A seeded deck (each kind as often as its weight), dealt in full before
        # it is made again.
        deck: list[str] = []
        end = self.t0 + seconds
        # Warm up: a first task done before the first fault.
        await self.wait_progress(await self.terminal_count(), timeout=60)
        while time.monotonic() < end:
            gap = self.rng.uniform(*self.config.fault_gap_s)
            if time.monotonic() + gap >= end:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), gap)
            if not deck:
                # Every kind once (shuffled), then the extra copies the weights ask
                # for (shuffled): a short run covers the most kinds.
                once = list(FAULT_WEIGHTS)
                extra = [k for k, w in FAULT_WEIGHTS.items() for _ in range(w - 1)]
                self.rng.shuffle(once)
                self.rng.shuffle(extra)
                deck = once + extra
            kind = deck.pop(0)
            record = FaultRecord(kind=kind, at_s=self.now(), detail="")
            log.info("soak_fault", kind=kind, at_s=round(record.at_s, 1))
            record.detail = await getattr(self, f"fault_{kind}")()
            baseline = await self.terminal_count()
            healed = time.monotonic()
            if await self.wait_progress(baseline, timeout=RECOVERY_TIMEOUT_S):
                record.recovery_s = time.monotonic() - healed
            self.report.faults.append(record)
            print(
                f"  {record.at_s:7.1f}s {kind:<16} recovered in "
                + ("-" if record.recovery_s is None else f"{record.recovery_s:.2f}s"),
                file=sys.stderr,
                flush=True,
            )

    async def terminal_count(self) -> int:
        engine = self.cluster.engine
        assert engine is not None
        t = tables.tasks

        async def count() -> int:
            try:
                async with engine.connect() as conn:
                    return int(
                        (
                            await conn.execute(
                                sa.select(sa.func.count())
                                .select_from(t)
                                .where(t.c.status.in_(["done", "failed", "cancelled"]))
                            )
                        ).scalar_one()
                    )
            except (sa.exc.DBAPIError, OSError):
                return -1

        n: int = await wait_for(count, lambda n: n >= 0, timeout=60, what="the database")
        return n

    async def wait_progress(self, baseline: int, *, timeout: float) -> bool:
        try:
            await wait_for(
                self.terminal_count,
                lambda n: n > baseline,
                timeout=timeout,
                what="a task finishing",
                interval=0.1,
            )
        except ClusterError:
            return False
        return True

    async def fault_serve_kill(self) -> str:
        c = self.cluster
        index = self.rng.randrange(len(c.serves))
        await c.kill_serve(index)
        await c.start_serve(index)
        return f"serve-{index}"

    async def fault_pg_restart(self) -> str:
        down = self.rng.uniform(1.0, 4.0)
        await self.cluster.stop_pg("immediate")
        await asyncio.sleep(down)  # the fault's duration
        await self.cluster.start_pg()
        return f"down {down:.1f}s"

    async def fault_nats_restart(self) -> str:
        down = self.rng.uniform(0.5, 3.0)
        await self.cluster.kill_nats()
        await asyncio.sleep(down)  # the fault's duration
        await self.cluster.start_nats()
        return f"down {down:.1f}s"

    async def fault_pg_latency(self) -> str:
        proxy = self.cluster.pg_proxy
        assert proxy is not None
        length = self.rng.uniform(3.0, 6.0)
        proxy.latency(0.05, 0.05)
        await asyncio.sleep(length)  # the fault's duration
        proxy.heal()
        return f"{length:.1f}s"

    async def fault_pg_reset(self) -> str:
        proxy = self.cluster.pg_proxy
        assert proxy is not None
        n = proxy.connections
        proxy.reset()
        return f"{n} connections"

    async def fault_pg_bandwidth(self) -> str:
        proxy = self.cluster.pg_proxy
        assert proxy is not None
        length = self.rng.uniform(3.0, 6.0)
        proxy.bandwidth(32 * 1024)
        await asyncio.sleep(length)  # the fault's duration
        proxy.heal()
        return f"{length:.1f}s"

    async def fault_agent_half_open(self) -> str:
        host = self.rng.choice(self.host_ids)
        proxy = self.cluster.agents[host].proxy
        assert proxy is not None
        length = self.config.timings.lease_s + self.rng.uniform(1.0, 3.0)
        proxy.half_open()
        await asyncio.sleep(length)  # the fault's duration
        proxy.heal()
        return f"{host} {length:.1f}s"

    async def fault_agent_partition(self) -> str:
        host = self.rng.choice(self.host_ids)
        proxy = self.cluster.agents[host].proxy
        assert proxy is not None
        length = self.config.timings.lease_s + self.rng.uniform(1.0, 3.0)
        proxy.blackhole()
        await asyncio.sleep(length)  # the fault's duration
        proxy.heal()
        return f"{host} {length:.1f}s"

    async def fault_agent_stop(self) -> str:
        host = self.rng.choice(self.host_ids)
        proc = self.cluster.agents[host].proc
        length = self.config.timings.lease_s + self.rng.uniform(0.5, 2.0)
        self.paused.add(host)
        try:
            proc.signal(signal.SIGSTOP)
            await asyncio.sleep(length)  # the fault's duration
        finally:
            proc.signal(signal.SIGCONT)
            self.paused.discard(host)
        return f"{host} {length:.1f}s"

    async def fault_agent_kill(self) -> str:
        host = self.rng.choice(self.host_ids)
        await self.cluster.agents[host].proc.kill()
        return host

    async def fault_actor_kill(self) -> str:
        c = self.cluster
        index = self.rng.randrange(len(c.serves))
        point = self.rng.choice(sorted(failpoints.POINTS))
        seed = self.rng.randrange(1_000_000)
        if not c.serves[index].alive:
            return f"serve-{index} {point}: serve not running"
        try:
            restarted = await c.crash_actor(index, point, seed=seed, timeout=RECOVERY_TIMEOUT_S)
        except ClusterError as exc:
            log.warning("soak_actor_kill_not_fired", serve=index, point=point, error=str(exc))
            return f"serve-{index} {point}: did not fire ({exc})"
        return f"serve-{index} {point} -> {restarted.get('actor')} restarted"

    async def heal_everything(self) -> None:
        c = self.cluster
        if not c.pg_running:
            await c.start_pg()
        if c.nats.proc is None or c.nats.proc.poll() is not None:
            await c.start_nats()
        if c.pg_proxy is not None:
            c.pg_proxy.heal()
        for agent in c.agents.values():
            if agent.proxy is not None:
                agent.proxy.heal()
            agent.proc.signal(signal.SIGCONT)
        for i, serve in enumerate(c.serves):
            if not serve.alive:
                await c.start_serve(i)

    async def drain(self) -> None:
        try:
            await self.cluster.wait_terminal(self.ids, timeout=self.config.drain_timeout_s)
        except ClusterError as exc:
            log.warning("soak_drain_incomplete", error=str(exc))


async def run_soak(config: SoakConfig, work_dir: Path) -> SoakReport:
    return await Soak(config, work_dir).run()
