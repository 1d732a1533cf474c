"""The options of ``fleetlease bench``, its error, and the constants its cells share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

SUBMIT_BATCH = 100
#: Payload of every benchmark task: the simulated runner returns at once.
ZERO = {"sim": {"duration_s": 0}}


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
    #: The cancel-reach cell (``ops/bench/cancel.py``): hang tasks queued
    #: behind the running ones (0 skips the cell), cancels issued in each of
    #: its two runs, and the lease of its control plane (hosts renew every
    #: third of it).
    cancel_backlog: int = 2000
    cancel_count: int = 50
    cancel_lease_s: float = 9.0
    #: Run the fleet cell only (``ops/bench/fleetcell.py``): ``hosts`` simulated
    #: hosts of ``devices_per_host`` devices, idle for ``fleet_idle_s``, then
    #: zero-duration tasks at ``fleet_rate`` for ``fleet_load_s``.
    fleet: bool = False
    fleet_rate: float = 100.0
    fleet_idle_s: float = 30.0
    fleet_load_s: float = 30.0
    #: NATS connections the simulated hosts share.
    fleet_connections: int = 4
    #: The simulated hosts send their complete snapshot in every heartbeat, as
    #: agents that do not send digests do (False: only the digest of an
    #: unchanged snapshot, as the agent does).
    fleet_full_snapshots: bool = False
    #: The long-poll wait of the simulated hosts' claims (the agent's default).
    fleet_claim_wait_s: float = 20.0
    database_url: str | None = None
    nats_url: str | None = None
    progress: Callable[[str], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("hosts", "devices_per_host", "tasks", "cancel_count", "fleet_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("renew_leases", "recovery_leases", "cancel_backlog"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.recovery_leases > self.renew_leases:
            raise ValueError("recovery_leases must be <= renew_leases (they are reused)")
        for name in (
            "renew_period_s",
            "renew_burst_s",
            "calibration_s",
            "cancel_lease_s",
            "fleet_rate",
            "fleet_idle_s",
            "fleet_load_s",
            "fleet_claim_wait_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        rate = self.paced_rate
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate <= 100_000
        ):
            raise ValueError(f"paced_rate must be a number of tasks/s in (0, 100000], got {rate!r}")
        if self.fleet_claim_wait_s > 60:
            raise ValueError("fleet_claim_wait_s must be <= 60 (the protocol's longest claim)")


def say(opts: BenchOptions, text: str) -> None:
    if opts.progress is not None:
        opts.progress(text)
