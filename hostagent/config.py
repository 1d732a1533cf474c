"""The agent's configuration: :class:`AgentConfig` (every default declared
here, once), the host credential file, and the crash-test failpoints."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetlease.transport import wire
from fleetlease.transport.subjects import validate_token

__all__ = [
    "AGENT_VERSION",
    "FAILPOINTS",
    "FAILPOINTS_ENV",
    "FALLBACK_HEARTBEAT_S",
    "FALLBACK_LEASE_S",
    "AgentConfig",
    "config_default",
    "load_credential",
    "parse_failpoints",
]

AGENT_VERSION = "fleetlease-agent/0.1.0"

FAILPOINTS_ENV = "FLEETLEASE_AGENT_FAILPOINTS"
#: Points where a test can make the agent kill itself (SIGKILL).
FAILPOINT_AFTER_JOURNAL_ADD = "after_journal_add"
FAILPOINT_AFTER_ACK = "after_ack"
FAILPOINT_AFTER_RESULT_RECORDED = "after_result_recorded"
FAILPOINT_AFTER_RESULT_REPORTED = "after_result_reported"
FAILPOINTS: frozenset[str] = frozenset(
    {
        FAILPOINT_AFTER_JOURNAL_ADD,
        FAILPOINT_AFTER_ACK,
        FAILPOINT_AFTER_RESULT_RECORDED,
        FAILPOINT_AFTER_RESULT_REPORTED,
    }
)

_HEX64 = re.compile(r"[0-9a-f]{64}")

#: Heartbeat period when neither the configuration nor the control plane sets one.
FALLBACK_HEARTBEAT_S = 5.0
#: Lease period assumed for an assignment that names none.
FALLBACK_LEASE_S = 30.0


def parse_failpoints(text: str | None) -> frozenset[str]:
    """Failpoint names from ``FLEETLEASE_AGENT_FAILPOINTS``; ValueError for an
    unknown one."""
    names = frozenset(n.strip() for n in (text or "").split(",") if n.strip())
    unknown = names - FAILPOINTS
    if unknown:
        raise ValueError(
            f"{FAILPOINTS_ENV}: unknown failpoint(s) {sorted(unknown)}, known: {sorted(FAILPOINTS)}"
        )
    return names


def check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def check_non_negative(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Everything the agent needs besides its devices. Times are seconds."""

    host_id: str
    credential: str = field(repr=False)
    nats_url: str
    state_dir: Path
    prefix: str = "fleetlease"
    #: Runner names (entry points of ``fleetlease.runners``) per task kind.
    goal_runner: str = "sim-goal"
    workflow_runner: str = "sim-workflow"
    #: The workflows this host advertises; None: any (a runner that takes every name).
    workflows: tuple[str, ...] | None = None
    #: Long-poll duration of one claim (the control plane caps it at 60 s).
    claim_wait_s: float = 20.0
    #: An empty claim answered faster than this is paced (no busy loop).
    min_poll_interval_s: float = 1.0
    #: The idle devices are split between up to this many claims outstanding at
    #: once (more when freed devices trickle in: each new claim covers the idle
    #: devices no claim covers, at most a ``claim_polls``-th of all of them), so
    #: the claims of several tasks reaching one host together run side by side
    #: instead of one after another.
    claim_polls: int = 4
    request_timeout_s: float = 10.0
    backoff_base_s: float = 0.2
    backoff_cap_s: float = 15.0
    #: Random delay before re-registering after a reconnect (spreads a herd).
    resync_jitter_s: float = 2.0
    #: Override of the heartbeat period given by the control plane.
    heartbeat_s: float | None = None
    #: SIGTERM: time running attempts get to finish before being handed back.
    grace_s: float = 10.0
    #: Time a runner may ignore ``ctx.cancelled`` before it is cancelled outright.
    cancel_timeout_s: float = 5.0
    #: Shutdown: time to deliver the reports of handed-back attempts.
    handback_timeout_s: float = 5.0
    #: Shutdown: time to flush queued logs and artifacts.
    flush_timeout_s: float = 2.0
    #: Before reporting a result, time to ship the attempt's queued artifacts
    #: (the control plane takes them only while the lease is held).
    artifact_flush_s: float = 60.0
    log_queue_lines: int = 10_000
    artifact_queue_items: int = 32
    artifact_queue_bytes: int = 64 * 1024 * 1024
    #: A journal entry resumed this many times after agent restarts is not run
    #: again: it is reported as a retryable failure (a poison attempt).
    max_resumes: int = 2
    #: Exit (``BrokerRefused``) once the NATS server has refused the host's
    #: authorization for this long with no successful connect in between.
    broker_refused_s: float = 15.0
    failpoints: frozenset[str] = frozenset()
    connect_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_token(self.host_id, "host_id")
        if not isinstance(self.credential, str) or _HEX64.fullmatch(self.credential) is None:
            # Never echo the value: it is a secret, even when malformed.
            raise ValueError("credential must be 64 lowercase hex characters")
        if not self.nats_url:
            raise ValueError("nats_url must be non-empty")
        if not self.goal_runner or not self.workflow_runner:
            raise ValueError("goal_runner and workflow_runner must be non-empty")
        check_positive("claim_wait_s", self.claim_wait_s)
        if isinstance(self.claim_polls, bool) or not isinstance(self.claim_polls, int):
            raise ValueError(f"claim_polls must be an integer, got {self.claim_polls!r}")
        if self.claim_polls < 1:
            raise ValueError(f"claim_polls must be >= 1, got {self.claim_polls}")
        if self.claim_wait_s > wire.MAX_WAIT_S:
            raise ValueError(f"claim_wait_s must be <= {wire.MAX_WAIT_S}, got {self.claim_wait_s}")
        for name in (
            "request_timeout_s",
            "backoff_base_s",
            "backoff_cap_s",
            "cancel_timeout_s",
        ):
            check_positive(name, getattr(self, name))
        for name in (
            "min_poll_interval_s",
            "resync_jitter_s",
            "grace_s",
            "handback_timeout_s",
            "flush_timeout_s",
            "artifact_flush_s",
            "broker_refused_s",
        ):
            check_non_negative(name, getattr(self, name))
        if self.heartbeat_s is not None:
            check_positive("heartbeat_s", self.heartbeat_s)
        if (
            isinstance(self.max_resumes, bool)
            or not isinstance(self.max_resumes, int)
            or self.max_resumes < 0
        ):
            raise ValueError(f"max_resumes must be an int >= 0, got {self.max_resumes!r}")
        for name in ("log_queue_lines", "artifact_queue_items", "artifact_queue_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        unknown = set(self.failpoints) - FAILPOINTS
        if unknown:
            raise ValueError(f"failpoints: unknown {sorted(unknown)}")


def config_default(name: str) -> Any:
    """The default of :class:`AgentConfig` field ``name`` (for command-line
    options, so that every default is declared once, on the field)."""
    for f in dataclasses.fields(AgentConfig):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise ValueError(f"AgentConfig.{name} has no default")
    raise ValueError(f"AgentConfig has no field {name!r}")


def load_credential(path: str | os.PathLike[str]) -> str:
    """The host credential from ``path`` (surrounding whitespace ignored).
    ValueError without echoing the content when it is not 64 hex characters."""
    text = Path(path).read_text(encoding="utf-8").strip().lower()
    if _HEX64.fullmatch(text) is None:
        raise ValueError(f"{path}: expected the 64 hex character host credential")
    return text
