"""Artifact staging under attack: a real ``ControlPlaneService`` (actors,
PostgreSQL, NATS server handlers, the JetStream staging stream) driven by real
host clients and by raw signed requests.

* a chunk or commit is taken only for a lease the host holds now (fenced as a
  renewal): one for a task that does not exist, another host's task, or an
  ended or stale attempt is refused with a typed error and nothing is staged;
* a host flooding chunks hits its quotas with typed errors (``busy``,
  ``quota``) and the stream stays under its byte cap;
* an attempt's staged chunks go when the upload commits and when the attempt
  ends (result, expiry);
* the normal upload path still works.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest

from fleetlease.persistence.clock import ManualClock
from fleetlease.persistence.model import LeaseTimings
from fleetlease.transport import wire
from fleetlease.transport.staging import StagingLimits
from fleetlease.transport.subjects import Channel
from tests.integration.test_transport_e2e import ADMIN, Host, System, start_service, until

pytestmark = pytest.mark.embedded

UNIT = wire.ARTIFACT_CHUNK_BYTES
#: Small limits, so that a test reaches them with a few MiB.
SMALL = StagingLimits(
    total_bytes=3 * 1024 * 1024,
    max_artifact_bytes=1024 * 1024,
    host_uploads=2,
    host_in_flight=2,
    max_age_s=600.0,
)


async def _system(
    db_url: str, nats_url: str, prefix: str, state_dir: Path, **kw: Any
) -> AsyncIterator[System]:
    svc = await start_service(db_url, nats_url, prefix, state_dir, **kw)
    nc = await nats.connect(nats_url)
    sys_ = System(svc, nats_url, nc)
    try:
        await svc.repo.add_user("admin", platform_admin=True)  # type: ignore[union-attr]
        await svc.repo.add_project("default", owner="admin")  # type: ignore[union-attr]
        yield sys_
    finally:
        for h in sys_.hosts:
            await h.client.close()
        if svc.server is not None:
            await svc.server.delete_storage()
        await nc.close()
        await svc.stop()


@pytest.fixture
async def system(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> AsyncIterator[System]:
    async for s in _system(db_url, nats_url, subject_prefix, state_dir, staging=SMALL):
        yield s


@pytest.fixture
async def manual(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> AsyncIterator[tuple[System, ManualClock]]:
    clock = ManualClock()
    async for s in _system(
        db_url,
        nats_url,
        subject_prefix,
        state_dir,
        staging=SMALL,
        clock=clock,
        timings=LeaseTimings(claim_s=30, ack_s=30, lease_s=30, liveness_s=86400),
    ):
        yield s, clock


# --- helpers ----------------------------------------------------------------------------


async def staged(system: System, subject_filter: str | None = None) -> dict[str, int]:
    """The staging stream's subjects (under ``subject_filter``), {} if none."""
    js = system.nc.jetstream()
    staging = system.server.staging
    try:
        info = await js.stream_info(
            staging.stream, subjects_filter=subject_filter or f"{staging.root}.>"
        )
    except nats.js.errors.NotFoundError:
        return {}
    return dict(info.state.subjects or {})


async def stream_state(system: System) -> tuple[int, int]:
    """(messages, bytes) in the staging stream; (0, 0) when it does not exist."""
    js = system.nc.jetstream()
    try:
        info = await js.stream_info(system.server.staging.stream)
    except nats.js.errors.NotFoundError:
        return 0, 0
    return info.state.messages, info.state.bytes


def attempt_filter(system: System, host: Host, a: wire.Assignment) -> str:
    return str(system.server.staging.attempt_filter(host.host_id, a.task_id, a.attempt))


async def send_chunk(
    system: System,
    host: Host,
    *,
    task_id: str,
    attempt: int,
    lease_token: str,
    name: str = "a.bin",
    offset: int = 0,
    data: bytes = b"x" * 1000,
) -> wire.Message:
    subject = system.subjects.artifact_chunk(host.host_id)
    chunk = wire.ArtifactChunk(
        task_id=task_id,
        attempt=attempt,
        lease_token=lease_token,
        name=name,
        offset=offset,
        data=data,
    )
    return await system.raw(subject, host.signer().seal(subject, chunk))


async def chunk_of(system: System, host: Host, a: wire.Assignment, **kw: Any) -> wire.Message:
    return await send_chunk(
        system, host, task_id=a.task_id, attempt=a.attempt, lease_token=a.lease_token, **kw
    )


def code(msg: wire.Message) -> str:
    assert isinstance(msg, wire.Error), msg
    return msg.code


# --- fencing ------------------------------------------------------------------------------


async def test_chunks_and_commits_for_leases_the_host_does_not_hold_are_refused(
    system: System,
) -> None:
    ha = await system.host("ha", devices=0)  # all work goes to hb
    hb = await system.host("hb")
    b = await system.running(hb)
    # hb's own chunk makes the stream exist: what follows must not add to it.
    assert isinstance(await chunk_of(system, hb, b), wire.Ok)
    assert await stream_state(system) == (1, (await stream_state(system))[1])
    before = await system.snapshot()
    token = os.urandom(32).hex()
    refusals = {
        # A task that does not exist.
        "no such task": (
            dict(task_id=str(uuid.uuid4()), attempt=1, lease_token=token),
            {"not_found"},
        ),
        # Another host's task: with its real lease token, and with a guessed one.
        "another host's lease": (
            dict(task_id=b.task_id, attempt=b.attempt, lease_token=b.lease_token),
            {"forbidden"},
        ),
        "another host's task": (
            dict(task_id=b.task_id, attempt=b.attempt, lease_token=token),
            {"conflict"},
        ),
        # An attempt of that task that does not exist.
        "no such attempt": (
            dict(task_id=b.task_id, attempt=b.attempt + 1, lease_token=b.lease_token),
            {"conflict"},
        ),
    }
    for what, (ref, codes) in refusals.items():
        assert code(await send_chunk(system, ha, **ref)) in codes, what
        commit_s = system.subjects.artifact_commit("ha")
        commit = wire.ArtifactCommit(
            **ref, name="a.bin", size=1000, sha256=hashlib.sha256(b"x" * 1000).hexdigest()
        )
        assert code(await system.raw(commit_s, ha.signer().seal(commit_s, commit))) in codes, what
    # hb with a wrong token for its own attempt: conflict, as a renewal.
    bad = dict(task_id=b.task_id, attempt=b.attempt, lease_token=token)
    assert code(await send_chunk(system, hb, name="other", **bad)) == "conflict"
    # Nothing staged for ha, nothing more for hb, nothing written anywhere.
    assert await staged(system, system.server.staging.host_filter("ha")) == {}
    assert (await stream_state(system))[0] == 1
    assert await system.snapshot() == before
    # The server keeps serving the holder.
    await hb.client.upload_artifact(b.task_id, b.attempt, b.lease_token, "ok.bin", b"fine")
    (row,) = await system.repo.list_artifacts(b.task_id, ADMIN)
    assert await system.server.read_artifact(row["object_name"]) == b"fine"


async def test_an_ended_attempt_takes_no_chunks(system: System) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    assert isinstance(await chunk_of(system, h, a), wire.Ok)
    await h.client.result(a.task_id, a.attempt, a.lease_token, outcome="done", fingerprint="f")
    assert code(await chunk_of(system, h, a, name="late")) in {"gone", "conflict"}
    # Nor is the upload staged before the result committed afterwards.
    commit_s = system.subjects.artifact_commit("h1")
    commit = wire.ArtifactCommit(
        task_id=a.task_id,
        attempt=a.attempt,
        lease_token=a.lease_token,
        name="a.bin",
        size=1000,
        sha256=hashlib.sha256(b"x" * 1000).hexdigest(),
    )
    await system.refused_without_change(commit_s, h.signer().seal(commit_s, commit), "gone")

    async def purged() -> bool:
        return not await staged(system)

    await until(purged)


async def test_a_stale_attempt_takes_no_chunks_and_an_expired_ones_chunks_go(
    manual: tuple[System, ManualClock],
) -> None:
    system, clock = manual
    h = await system.host("h1", devices=1)
    first = await system.running(h)
    for offset in (0, UNIT):
        msg = await chunk_of(system, h, first, offset=offset, data=os.urandom(UNIT))
        assert isinstance(msg, wire.Ok)
    assert len(await staged(system, attempt_filter(system, h, first))) == 2
    # The lease expires: the Reaper ends the attempt and its chunks are purged.
    clock.advance(31)
    system.cp.poke_reaper()

    async def purged() -> bool:
        return not await staged(system, attempt_filter(system, h, first))

    await until(purged)
    assert code(await chunk_of(system, h, first, name="late")) == "conflict"
    # A next attempt of the task (after its retry backoff) goes to the same
    # host: the old one stays stale.
    clock.advance(120)
    await system.alive(h)
    system.cp.wake_scheduler()
    second = await h.client.claim(wait_s=30)
    assert second is not None and second.task_id == first.task_id
    assert second.attempt == first.attempt + 1
    await h.client.ack(second.task_id, second.attempt, second.lease_token)
    assert code(await chunk_of(system, h, first, name="late")) == "conflict"
    stale_token_new_attempt = dict(
        task_id=second.task_id, attempt=second.attempt, lease_token=first.lease_token
    )
    assert code(await send_chunk(system, h, **stale_token_new_attempt)) == "conflict"
    assert await staged(system) == {}
    assert isinstance(await chunk_of(system, h, second), wire.Ok)


# --- quotas ---------------------------------------------------------------------------------


async def test_chunk_offsets_and_sizes_are_bounded(system: System) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    limit = SMALL.max_artifact_bytes
    assert code(await chunk_of(system, h, a, offset=1, data=b"x")) == "bad_request"
    assert code(await chunk_of(system, h, a, data=b"x" * (UNIT + 1))) == "bad_request"
    assert code(await chunk_of(system, h, a, offset=limit, data=b"x")) == "bad_request"
    # An upload starts at offset 0.
    assert code(await chunk_of(system, h, a, offset=UNIT)) == "conflict"
    assert await staged(system) == {}
    for offset in range(0, limit, UNIT):  # exactly the largest artifact
        assert isinstance(await chunk_of(system, h, a, offset=offset, data=b"y" * UNIT), wire.Ok)
    assert len(await staged(system)) == limit // UNIT


async def test_a_flooding_host_hits_its_quotas_and_the_stream_stays_under_its_cap(
    system: System,
) -> None:
    h1 = await system.host("h1", devices=1)
    a1 = await system.running(h1)
    h2 = await system.host("h2", devices=1)
    a2 = await system.running(h2)
    h3 = await system.host("h3", devices=1)
    a3 = await system.running(h3)
    data = os.urandom(UNIT)

    # Uploads per host: the third one at once is refused.
    assert isinstance(await chunk_of(system, h1, a1, name="n0"), wire.Ok)
    assert isinstance(await chunk_of(system, h1, a1, name="n1"), wire.Ok)
    refused = await chunk_of(system, h1, a1, name="n2")
    assert code(refused) == "quota" and "uploads" in refused.message  # type: ignore[attr-defined]
    # A retried first chunk of a counted upload is not a new upload.
    assert isinstance(await chunk_of(system, h1, a1, name="n1"), wire.Ok)

    # A flood of chunks at once from one host: some through, the rest "busy"
    # (chunks of a host at once) or "quota"; never anything else.
    # The chunks are piled up on a stalled channel and released at once.
    async def flood(host: Host, a: wire.Assignment, n: int) -> list[str]:
        system.server.stall(Channel.ARTIFACTS)
        received = system.server.received(Channel.ARTIFACTS)
        piled = [
            asyncio.ensure_future(
                chunk_of(system, host, a, name=f"n{i % 2}", offset=(i % 8) * UNIT, data=data)
            )
            for i in range(n)
        ]

        async def piled_up() -> bool:
            return system.server.received(Channel.ARTIFACTS) >= received + 8

        await until(piled_up)
        system.server.unstall(Channel.ARTIFACTS)
        msgs = await asyncio.gather(*piled)
        return ["ok" if isinstance(m, wire.Ok) else code(m) for m in msgs]

    codes1 = await flood(h1, a1, 64)
    assert set(codes1) <= {"ok", "busy", "conflict"}, codes1
    assert "busy" in codes1, codes1

    # Fill every host's uploads in order: the stream's byte cap is hit by the
    # last of them, with a typed "quota".
    outcomes: list[str] = []
    for host, a in ((h1, a1), (h2, a2), (h3, a3)):
        for name in ("n0", "n1"):
            for offset in range(0, SMALL.max_artifact_bytes, UNIT):
                msg = await chunk_of(system, host, a, name=name, offset=offset, data=data)
                outcomes.append("ok" if isinstance(msg, wire.Ok) else code(msg))
    messages, size = await stream_state(system)
    print(f"staged: {messages} chunks, {size} bytes (cap {SMALL.total_bytes})")
    assert size <= SMALL.total_bytes
    # (A chunk after a refused offset-0 chunk is a conflict: no upload started.)
    assert set(outcomes) <= {"ok", "quota", "conflict"}, outcomes
    assert outcomes.index("quota") < outcomes.index("conflict"), outcomes
    assert outcomes.count("ok") == messages
    # Space comes back when uploads end: h1's attempt ends, its chunks go.
    await h1.client.result(a1.task_id, a1.attempt, a1.lease_token, outcome="done", fingerprint="f")

    async def h1_purged() -> bool:
        return not await staged(system, system.server.staging.host_filter("h1"))

    await until(h1_purged)
    for offset in range(0, SMALL.max_artifact_bytes, UNIT):
        msg = await chunk_of(system, h3, a3, name="n1", offset=offset, data=data)
        assert isinstance(msg, wire.Ok), msg


# --- cleanup ---------------------------------------------------------------------------------


async def test_staged_chunks_go_at_commit_and_when_the_attempt_ends(system: System) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    data = os.urandom(3 * UNIT + 5)
    await h.client.upload_artifact(a.task_id, a.attempt, a.lease_token, "shot.png", data)
    assert await staged(system, attempt_filter(system, h, a)) == {}
    rows = await system.repo.list_artifacts(a.task_id, ADMIN)
    assert [(r["name"], r["size"]) for r in rows] == [("shot.png", len(data))]
    # An upload never committed: its chunks go with the attempt's result.
    for offset in (0, UNIT):
        assert isinstance(await chunk_of(system, h, a, name="half", offset=offset), wire.Ok)
    assert len(await staged(system, attempt_filter(system, h, a))) == 2
    await h.client.result(a.task_id, a.attempt, a.lease_token, outcome="done", fingerprint="f")

    async def purged() -> bool:
        return not await staged(system, attempt_filter(system, h, a))

    await until(purged)
    assert await stream_state(system) == (0, 0)


async def test_staged_chunks_go_when_a_reconciliation_gives_the_attempt_up(
    system: System,
) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    assert isinstance(await chunk_of(system, h, a, name="half"), wire.Ok)
    assert len(await staged(system, attempt_filter(system, h, a))) == 1
    # The agent restarted without the attempt in its journal.
    await h.client.register()
    report = await h.client.reconcile([])
    assert report.generation > h.ok.generation

    async def purged() -> bool:
        return not await staged(system, attempt_filter(system, h, a))

    await until(purged)


async def test_staging_limits_are_checked() -> None:
    for bad in (
        {"total_bytes": 0},
        {"total_bytes": 1024},
        {"host_uploads": 0},
        {"host_in_flight": True},
        {"max_artifact_bytes": -1},
        {"max_age_s": 0},
    ):
        with pytest.raises(ValueError):
            StagingLimits(**bad)
    assert StagingLimits().host_bytes == 2 * 256 * 1024 * 1024
