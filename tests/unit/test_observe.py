"""The metrics' pure logic and the listener on a real socket: address parsing,
the event listener's latencies and bounded memory, retry reasons, error codes
and principal kinds, the ``--metrics`` flag, ``/healthz``/``/readyz``/``/metrics``
and ``fleetlease status`` when nothing answers."""

from __future__ import annotations

import argparse
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import pytest

from fleetlease.ops.cli import main
from fleetlease.ops.commands.status import metrics_from_args
from fleetlease.ops.observe import metrics
from fleetlease.ops.observe.http import (
    ListenError,
    MetricsAddressError,
    MetricsListener,
    parse_address,
)
from fleetlease.persistence.model import EndReason, TaskState


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_address(":9464") == ("0.0.0.0", 9464)
    assert parse_address("[::1]:9000") == ("::1", 9000)
    for bad in ("9464", "host:", "host:port", "h:70000", ""):
        with pytest.raises(MetricsAddressError):
            parse_address(bad)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def event(task_id: str, state: str, attempt: int = 1) -> dict[str, Any]:
    return {"task_id": task_id, "state": state, "attempt": attempt, "host_id": "h", "at": ""}


def test_event_metrics_measure_assignment_and_dispatch_latency() -> None:
    clock = FakeClock()
    listen = metrics.EventMetrics(clock=clock)
    a0 = sample("fleetlease_assignment_latency_seconds_count")
    d0 = sample("fleetlease_dispatch_latency_seconds_count")
    big0 = sample("fleetlease_assignment_latency_seconds_bucket", le="5.0")
    t0 = sample("fleetlease_task_transitions_total", state="assigned")
    listen(event("t1", "queued", 0))
    clock.now += 3.0
    listen(event("t1", "assigned"))
    clock.now += 0.004
    listen(event("t1", "dispatched"))
    listen(event("t1", "running"))
    assert sample("fleetlease_assignment_latency_seconds_count") == a0 + 1
    assert sample("fleetlease_assignment_latency_seconds_bucket", le="5.0") == big0 + 1
    assert sample("fleetlease_dispatch_latency_seconds_count") == d0 + 1
    assert sample("fleetlease_task_transitions_total", state="assigned") == t0 + 1
    assert len(listen) == 0  # forgotten once dispatched
    # An assignment whose queued event this process never saw is not measured.
    listen(event("t2", "assigned"))
    assert sample("fleetlease_assignment_latency_seconds_count") == a0 + 1


def test_event_metrics_memory_is_bounded() -> None:
    listen = metrics.EventMetrics(limit=10, clock=FakeClock())
    for i in range(100):
        listen(event(f"t{i}", "queued", 0))
    assert len(listen) == 10


def test_an_unknown_state_is_counted_as_other() -> None:
    before = sample("fleetlease_task_transitions_total", state="other")
    metrics.EventMetrics()(event("t", "made-up"))
    assert sample("fleetlease_task_transitions_total", state="other") == before + 1


@dataclass
class Ended:
    task_id: str
    attempt: int
    reason: EndReason
    new_state: TaskState


def test_retries_take_the_reapers_reason_else_failure() -> None:
    listen = metrics.EventMetrics(clock=FakeClock())
    lease0 = sample("fleetlease_task_retries_total", reason="lease_expired")
    fail0 = sample("fleetlease_task_retries_total", reason="failure")
    exp0 = sample("fleetlease_lease_expiries_total", reason="lease_expired")
    claim0 = sample("fleetlease_lease_expiries_total", reason="claim_expired")
    metrics.expired(
        [
            Ended("r1", 1, EndReason.LEASE_EXPIRED, TaskState.RETRYING),
            Ended("r2", 3, EndReason.CLAIM_EXPIRED, TaskState.FAILED),
        ]
    )
    listen(event("r1", "retrying", 1))
    listen(event("r3", "retrying", 1))  # a retryable failure the host reported
    assert sample("fleetlease_lease_expiries_total", reason="lease_expired") == exp0 + 1
    assert sample("fleetlease_lease_expiries_total", reason="claim_expired") == claim0 + 1
    assert sample("fleetlease_task_retries_total", reason="lease_expired") == lease0 + 1
    assert sample("fleetlease_task_retries_total", reason="failure") == fail0 + 1


def test_request_errors_by_code_and_refusals_by_principal_kind() -> None:
    host0 = sample("fleetlease_refusals_total", principal_kind="host")
    user0 = sample("fleetlease_refusals_total", principal_kind="user")
    other0 = sample("fleetlease_nats_request_errors_total", code="other")
    conflict0 = sample("fleetlease_nats_request_errors_total", code="conflict")
    metrics.request_error("p.host.h1.jobs.ack", "unauthorized")
    metrics.request_error("p.ops.alice.submit", "forbidden")
    metrics.request_error("p.host.h1.jobs.ack", "conflict")
    metrics.request_error("p.host.h1.jobs.ack", "something-new")
    assert sample("fleetlease_refusals_total", principal_kind="host") == host0 + 1
    assert sample("fleetlease_refusals_total", principal_kind="user") == user0 + 1
    assert sample("fleetlease_nats_request_errors_total", code="conflict") == conflict0 + 1
    assert sample("fleetlease_nats_request_errors_total", code="other") == other0 + 1
    assert metrics.principal_kind("weird") == "unknown"


def test_slow_consumers_are_counted_per_connection() -> None:
    from nats.errors import SlowConsumerError

    before = sample("fleetlease_nats_slow_consumers_total", connection="c1")
    metrics.nats_error("c1", SlowConsumerError(subject="s", reply="", sid=1, sub=None))
    metrics.nats_error("c1", ValueError("not slow"))
    assert sample("fleetlease_nats_slow_consumers_total", connection="c1") == before + 1


def test_the_metrics_flag() -> None:
    ns = argparse.Namespace
    assert metrics_from_args(ns(metrics=None), default_on=True) == ("127.0.0.1:9464", True)
    assert metrics_from_args(ns(metrics=None), default_on=False) == (None, False)
    assert metrics_from_args(ns(metrics="off"), default_on=True) == (None, False)
    assert metrics_from_args(ns(metrics="0.0.0.0:9100"), default_on=False) == (
        "0.0.0.0:9100",
        False,
    )
    with pytest.raises(Exception, match="HOST:PORT") as err:
        metrics_from_args(ns(metrics="nope"), default_on=True)
    assert getattr(err.value, "exit_code", None) == 2


def get(url: str, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_listener_serves_metrics_health_and_readiness() -> None:
    ready = {"ready": False, "checks": {"database": {"ok": False, "detail": "down"}}}
    listener = MetricsListener("127.0.0.1:0", readiness=lambda: ready).start()
    try:
        url = listener.url
        assert get(f"{url}/healthz") == (200, "ok\n")
        code, body = get(f"{url}/readyz")
        assert code == 503 and '"ready": false' in body
        ready["ready"] = True
        assert get(f"{url}/readyz")[0] == 200
        code, body = get(f"{url}/metrics")
        assert code == 200
        assert "process_resident_memory_bytes" in body
        assert "fleetlease_task_transitions_total" in body
        assert "_created" not in body
        assert get(f"{url}/nothing")[0] == 404
        assert get(f"{url}/metrics", method="POST")[0] == 405
        with pytest.raises(ListenError, match="cannot listen"):
            MetricsListener(f"127.0.0.1:{listener.port}", readiness=lambda: ready).start()
    finally:
        listener.stop()


def test_status_exits_6_when_nothing_answers(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["status", "--metrics-url", f"http://127.0.0.1:{port}"]) == 6
    assert "cannot reach" in capsys.readouterr().err
    assert main(["status", "--metrics-url", "ftp://x"]) == 2


async def test_the_loop_lag_probe_records_how_late_a_busy_loop_ran_it() -> None:
    import asyncio
    import time

    from fleetlease.ops.observe.looplag import LoopLagProbe

    def late() -> float:  # probes that came more than 50 ms late
        return sample("fleetlease_event_loop_lag_seconds_count") - sample(
            "fleetlease_event_loop_lag_seconds_bucket", le="0.05"
        )

    def count() -> float:
        return sample("fleetlease_event_loop_lag_seconds_count")

    before_late, before = late(), count()
    probe = LoopLagProbe(interval_s=0.01).start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10.0
        while count() == before:  # the probe's first wake-up
            assert loop.time() < deadline
            await asyncio.sleep(0.005)
        time.sleep(0.2)  # noqa: ASYNC251 - the loop blocked on purpose, past the probe's timer
        seen = count()
        while count() == seen:
            assert loop.time() < deadline
            await asyncio.sleep(0.005)
        assert late() > before_late
    finally:
        await probe.stop()
