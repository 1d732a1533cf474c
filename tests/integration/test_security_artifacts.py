"""Committed artifacts under attack: a real ``ControlPlaneService`` (actors,
PostgreSQL, NATS server handlers, the JetStream staging stream and object
store) driven by real host clients and by users of the user API over NATS.

* reading a range of an artifact moves only the object-store chunks the range
  needs over the control plane's storage connection (never the whole object),
  and reads are capped per user and per process (``busy`` beyond);
* committed artifacts are bounded per attempt (count and bytes), per host
  (bytes over the attempts it holds) and in all (the object store bucket's
  ``max_bytes``): a commit beyond any of them is ``quota`` and nothing of it
  is recorded or stored.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from nats.js.errors import NotFoundError

from fleetlease.ops.client import OpsClient, OpsError
from fleetlease.persistence.errors import QuotaExceeded
from fleetlease.transport import wire
from fleetlease.transport.artifacts import Artifacts, artifact_object_name
from fleetlease.transport.staging import StagingLimits
from tests.integration.test_security_staging import _system
from tests.integration.test_transport_e2e import ADMIN, Host, System

pytestmark = pytest.mark.embedded

MiB = 1024 * 1024
#: Large enough that a range near the end is far from the start of the object.
BIG = 6 * MiB
#: The object store's chunk size (nats-py's default for ``put``).
OBJ_CHUNK = 128 * 1024
LIMITS = StagingLimits(
    total_bytes=32 * MiB,
    max_artifact_bytes=8 * MiB,
    host_uploads=4,
    host_in_flight=4,
    max_age_s=600.0,
    attempt_bytes=8 * MiB,
    attempt_artifacts=3,
    host_bytes_committed=10 * MiB,
    store_bytes=24 * MiB,
    user_reads=2,
    process_reads=5,
)


@pytest.fixture
async def system(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> AsyncIterator[System]:
    async for s in _system(db_url, nats_url, subject_prefix, state_dir, staging=LIMITS):
        yield s


def rss_mib() -> float:
    """Resident memory of this process (the control plane serves in it)."""
    status = Path("/proc/self/status").read_text()
    found = re.search(r"VmRSS:\s+(\d+) kB", status)
    return int(found.group(1)) / 1024 if found else -1.0


def storage_in_bytes(system: System) -> int:
    """Bytes the control plane's storage connection has received."""
    nc = system.server._storage_nc
    assert nc is not None
    return int(nc.stats["in_bytes"])


async def user(system: System, name: str) -> OpsClient:
    token = await system.repo.add_user(name, platform_admin=True)
    return await OpsClient(
        nats_url=system.nats_url, token=token, prefix=system.svc.prefix, timeout_s=30
    ).connect()


async def upload(host: Host, a: wire.Assignment, name: str, data: bytes) -> None:
    await host.client.upload_artifact(a.task_id, a.attempt, a.lease_token, name, data)


async def refused(host: Host, a: wire.Assignment, name: str, data: bytes) -> str:
    with pytest.raises(wire.RemoteError) as info:
        await upload(host, a, name, data)
    return str(info.value.code)


async def stored(system: System, a: wire.Assignment, name: str, data: bytes) -> bool:
    """Whether the object store holds this artifact's object."""
    store = await system.server.artifacts._store()
    object_name = artifact_object_name(a.task_id, a.attempt, name, hashlib.sha256(data).hexdigest())
    try:
        await store.get_info(object_name)
    except NotFoundError:
        return False
    return True


async def names(system: System, a: wire.Assignment) -> list[str]:
    return [str(r["name"]) for r in await system.repo.list_artifacts(a.task_id, ADMIN)]


# --- reads ----------------------------------------------------------------------------


async def test_concurrent_range_reads_near_the_end_move_only_the_chunks_they_need(
    system: System,
) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    data = os.urandom(BIG)
    await upload(h, a, "big.bin", data)
    readers = [await user(system, f"reader{i}") for i in range(2)]
    try:
        offset, length = BIG - 300_000, 200_000

        async def read(client: OpsClient, at: int, n: int) -> dict[str, Any]:
            reply: dict[str, Any] = await client.call(
                "artifact_get", id=a.task_id, name="big.bin", offset=at, length=n
            )
            return reply

        # Warm up (the object store handle, the chunk index of the object).
        first = await read(readers[0], BIG - 1, 1)
        assert first["data"] == data[-1:] and first["eof"] is True
        rss0, in0 = rss_mib(), storage_in_bytes(system)
        rounds = 3
        for _ in range(rounds):
            # Two reads per user at once: each user's full share of read slots.
            replies = await asyncio.gather(
                *(read(c, offset, length) for c in readers for _ in range(2))
            )
            for reply in replies:
                assert reply["data"] == data[offset : offset + length]
                assert reply["eof"] is False
                assert reply["size"] == BIG
        moved = storage_in_bytes(system) - in0
        reads = rounds * 2 * len(readers)
        print(
            f"\n{reads} reads of {length} bytes near the end of a {BIG // MiB} MiB artifact: "
            f"storage connection received {moved / MiB:.2f} MiB "
            f"({moved / reads / 1024:.0f} KiB per read), "
            f"RSS {rss0:.0f} -> {rss_mib():.0f} MiB"
        )
        # Each read fetches the chunks overlapping its range (at most
        # length / chunk + 2 of them), never the object: a whole-object read
        # would move 6 MiB per read.
        per_read = (length // OBJ_CHUNK + 2) * OBJ_CHUNK + 64 * 1024
        assert moved <= reads * per_read, moved
        # The last byte, a range across the end and one past it.
        tail = await read(readers[1], BIG - 10, 100)
        assert tail["data"] == data[-10:] and tail["eof"] is True
        past = await read(readers[1], BIG + 5, 10)
        assert past["data"] == b"" and past["eof"] is True
        # The whole artifact in 512 KiB slices, as the CLI and web download it.
        got = bytearray()
        at = 0
        while True:
            reply = await read(readers[0], at, 512 * 1024)
            got += reply["data"]
            at += len(reply["data"])
            if reply["eof"]:
                break
        assert hashlib.sha256(got).hexdigest() == hashlib.sha256(data).hexdigest()
    finally:
        for c in readers:
            await c.close()


async def test_reads_beyond_a_users_or_the_processs_slots_are_busy(system: System) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    await upload(h, a, "a.txt", b"artifact bytes")
    alice, bob = await user(system, "alice"), await user(system, "bob")
    slots = system.server.artifacts.read_slot
    try:

        async def get(client: OpsClient) -> bytes:
            reply = await client.call("artifact_get", id=a.task_id, name="a.txt", length=8)
            return bytes(reply["data"])

        with slots("alice"), slots("alice"):
            # alice has both her reads in progress: a third is busy, bob reads.
            with pytest.raises(OpsError) as info:
                await get(alice)
            assert info.value.code == "busy"
            assert await get(bob) == b"artifact"
            with slots("carol"), slots("carol"), slots("dave"):
                # The process has all its read slots taken: bob is busy too.
                with pytest.raises(OpsError) as info:
                    await get(bob)
                assert info.value.code == "busy"
        # Slots come back when the reads end.
        assert await get(alice) == b"artifact"
        assert system.server.artifacts._reads == {}
    finally:
        await alice.close()
        await bob.close()


# --- commit quotas --------------------------------------------------------------------


async def test_an_attempt_commits_at_most_its_count_and_bytes_of_artifacts(
    system: System,
) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    five = os.urandom(5 * MiB)
    await upload(h, a, "one.bin", five)
    # 5 + 4 MiB is beyond the attempt's 8 MiB: quota, nothing recorded or stored.
    four = os.urandom(4 * MiB)
    assert await refused(h, a, "two.bin", four) == "quota"
    assert await names(system, a) == ["one.bin"]
    assert not await stored(system, a, "two.bin", four)
    # Committing the same artifact again is not a new artifact: still fine.
    await upload(h, a, "one.bin", five)
    # Count: 3 artifacts per attempt.
    await upload(h, a, "two.bin", b"2")
    await upload(h, a, "three.bin", b"3")
    assert await refused(h, a, "four.bin", b"4") == "quota"
    assert await names(system, a) == ["one.bin", "three.bin", "two.bin"]
    assert not await stored(system, a, "four.bin", b"4")
    # Another attempt has its own quota.
    b = await system.running(h)
    await upload(h, b, "four.bin", b"4")


async def test_the_attempts_a_host_holds_commit_at_most_its_bytes(system: System) -> None:
    h = await system.host("h1", devices=3)
    a, b, c = [await system.running(h) for _ in range(3)]
    # Registered once h1's devices are all busy: the next task is h2's.
    other = await system.host("h2", devices=1)
    await upload(h, a, "a.bin", os.urandom(5 * MiB))
    await upload(h, b, "b.bin", os.urandom(4 * MiB))
    # 9 MiB held; 2 more is beyond the host's 10 MiB.
    two = os.urandom(2 * MiB)
    assert await refused(h, c, "c.bin", two) == "quota"
    assert await names(system, c) == []
    assert not await stored(system, c, "c.bin", two)
    # Another host is not charged for h1's artifacts.
    d = await system.running(other)
    await upload(other, d, "d.bin", two)
    # An attempt that ends frees its share of the host's bytes.
    await h.client.result(a.task_id, a.attempt, a.lease_token, outcome="done", fingerprint="f")
    await upload(h, c, "c.bin", two)
    assert await names(system, c) == ["c.bin"]


async def test_the_object_store_is_bounded_and_a_commit_that_does_not_fit_stores_nothing(
    system: System,
) -> None:
    js = system.nc.jetstream()
    held = []
    for i in range(4):  # one device each, registered in turn: each takes its own task
        h = await system.host(f"h{i}", devices=1)
        held.append((h, await system.running(h)))
    # The bucket is created with the configured bound.
    await upload(*held[0], "first.bin", b"x")
    info = await js.stream_info(system.server.artifacts.ranges.stream)
    assert info.config.max_bytes == LIMITS.store_bytes
    # Fill it: 3 hosts x 7 MiB is within each attempt's and host's quota.
    for h, a in held[:3]:
        await upload(h, a, "fill.bin", os.urandom(7 * MiB))
    last_host, last = held[3]
    big = os.urandom(4 * MiB)
    assert await refused(last_host, last, "big.bin", big) == "quota"
    assert await names(system, last) == []
    assert not await stored(system, last, "big.bin", big)
    info = await js.stream_info(system.server.artifacts.ranges.stream)
    assert info.state.bytes <= LIMITS.store_bytes
    print(f"\nobject store holds {info.state.bytes / MiB:.1f} MiB of {LIMITS.store_bytes // MiB}")
    # What fits still commits.
    await upload(last_host, last, "small.bin", b"fits")
    assert await names(system, last) == ["small.bin"]
    # A process started with a bound below what the store holds keeps the
    # bucket's bound (JetStream would drop the oldest objects to fit) and
    # refuses commits until there is room.
    held_now = await js.stream_info(system.server.artifacts.ranges.stream)
    lower = Artifacts(
        repo=system.repo,
        prefix=system.svc.prefix,
        storage=lambda: system.server._storage_nc,
        limits=replace(LIMITS, store_bytes=4 * MiB),
    )
    try:
        await lower._store()
        info = await js.stream_info(system.server.artifacts.ranges.stream)
        assert info.config.max_bytes == LIMITS.store_bytes
        assert info.state.messages == held_now.state.messages
        with pytest.raises(QuotaExceeded):
            await lower._check_room(1)
    finally:
        lower.close()


async def test_concurrent_commits_cannot_both_take_the_last_of_an_attempts_quota(
    system: System,
) -> None:
    h = await system.host("h1")
    a = await system.running(h)
    await upload(h, a, "one.bin", b"1")
    await upload(h, a, "two.bin", b"2")
    results = await asyncio.gather(
        upload(h, a, "three.bin", b"3"), upload(h, a, "four.bin", b"4"), return_exceptions=True
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1, results
    assert isinstance(errors[0], wire.RemoteError) and errors[0].code == "quota"
    assert len(await names(system, a)) == 3


async def test_a_commit_the_bucket_refuses_midway_leaves_no_record_and_no_chunks(
    system: System,
) -> None:
    js = system.nc.jetstream()
    h = await system.host("h1")
    a = await system.running(h)
    await upload(h, a, "first.bin", b"x")
    stream = system.server.artifacts.ranges.stream
    # The bucket's bound below what the server believes (another process set
    # it, or concurrent commits took the room): the room check passes, the
    # object store refuses the object's chunks partway through.
    info = await js.stream_info(stream)
    held = info.state.bytes
    info.config.max_bytes = held + MiB
    await js.update_stream(info.config)
    two = os.urandom(2 * MiB)
    assert await refused(h, a, "two.bin", two) == "quota"
    assert await names(system, a) == ["first.bin"]
    assert not await stored(system, a, "two.bin", two)
    assert (await js.stream_info(stream)).state.bytes == held
    # What fits still commits.
    await upload(h, a, "small.bin", b"fits")
    assert await names(system, a) == ["first.bin", "small.bin"]
