"""Simulated hosts for the fleet cell of ``fleetlease bench --fleet``: thousands
of hosts speaking the real host protocol over NATS from one asyncio process.

Each simulated host registers with its credential (a proof of possession, as
the agent sends), heartbeats its devices every ``heartbeat_s`` the control
plane told it at registration, keeps its idle devices covered by up to
``claim_polls`` parked long-poll claims, and runs what it is assigned at once:
``ack``, then ``result`` (``done``). Every message after ``register`` is signed
for the host's session with its own timestamp and nonce, as the agent's are.

What makes them cheap, and how they differ from ``hostagent.Agent``:

* many hosts share a few NATS connections (``connections``): a reply comes
  back on ``_INBOX_{prefix}.host.{host_id}.c{k}.{n}``, inside the host's own
  inbox as the control plane requires, and one wildcard subscription per
  connection routes it to the waiting request. The agent opens four
  connections of its own (one per channel) and reconnects, re-registers and
  reconciles on its own;
* a heartbeat's body is encoded once per change of the host's devices and only
  signed per send; like the agent, a host sends only the digest of a snapshot
  the control plane acknowledged, and reports its devices busy while they run
  a task (at the next periodic heartbeat);
* no journal, no runner, no renewals (tasks take no time), no reconcile, no
  retry of a failed report, no device discovery: the devices are fixed;
* a failed request is counted (by error code) and the claim retried after a
  pause; nothing else is recovered.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import os
import random
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fleetlease.hostagent.session import snapshot_digest
from fleetlease.persistence.model import Outcome
from fleetlease.transport import wire
from fleetlease.transport.auth import Signer
from fleetlease.transport.broker_auth import register_proof
from fleetlease.transport.subjects import Subjects

#: The fingerprint of a result is the sender's choice: any non-empty name.
_FINGERPRINT = "sim-done"
_CAPS = {"model": "sim", "os": "bench"}
#: A claim back empty sooner than this waits out the rest (the agent's default).
_MIN_POLL_INTERVAL_S = 1.0


def _unchanged_body(digest: str) -> bytes:
    return wire.encode_body(wire.Heartbeat(digest=digest, unchanged=True))


class _Mux:
    """Request/reply of many hosts over one NATS connection."""

    def __init__(self, nc: Any, k: int, subjects: Subjects) -> None:
        self.nc = nc
        self.k = k
        self.subjects = subjects
        self._pending: dict[str, asyncio.Future[bytes]] = {}
        self._seq = itertools.count()

    async def start(self) -> None:
        root = f"_INBOX_{self.subjects.prefix}.host.*.c{self.k}.*"
        await self.nc.subscribe(root, cb=self._on_reply)

    async def _on_reply(self, msg: Any) -> None:
        fut = self._pending.pop(msg.subject.rpartition(".")[2], None)
        if fut is not None and not fut.done():
            fut.set_result(msg.data)

    async def request(self, host_id: str, subject: str, data: bytes, timeout_s: float) -> bytes:
        token = str(next(self._seq))
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[token] = fut
        inbox = self.subjects.host_inbox_prefix(host_id)
        try:
            await self.nc.publish(subject, data, reply=f"{inbox}.c{self.k}.{token}")
            async with asyncio.timeout(timeout_s):
                return await fut
        finally:
            self._pending.pop(token, None)


@dataclass(eq=False)
class SimHost:
    host_id: str
    credential: str
    devices: list[str]
    mux: _Mux
    signer: Signer | None = None
    busy: set[str] = field(default_factory=set)
    #: Idle devices covered by a claim in flight -> that claim's number.
    covered: dict[str, int] = field(default_factory=dict)
    #: The complete heartbeat's body and digest (None: to encode again).
    snapshot: tuple[bytes, str] | None = None
    #: The digest of the last complete snapshot the control plane acknowledged.
    acked: str | None = None
    heartbeat_busy: bool = False
    heartbeat_again: bool = False


class SimFleet:
    """``hosts`` (id -> credential) with ``devices_per_host`` devices each."""

    def __init__(
        self,
        *,
        nats_url: str,
        prefix: str,
        credentials: dict[str, str],
        devices_per_host: int,
        connections: int = 4,
        claim_polls: int = 4,
        claim_wait_s: float = 20.0,
        timeout_s: float = 30.0,
        digests: bool = True,
    ) -> None:
        self.nats_url = nats_url
        self.subjects = Subjects(prefix)
        self.credentials = credentials
        self.devices_per_host = devices_per_host
        self.connections = connections
        self.claim_polls = claim_polls
        self.claim_wait_s = claim_wait_s
        self.timeout_s = timeout_s
        self.hosts: list[SimHost] = []
        self._ncs: list[Any] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._numbers = itertools.count(1)
        self._stopping = False
        self.heartbeat_s = 5.0
        #: When each task's assignment reached its host (wall clock).
        self.held_at: dict[str, float] = {}
        self.errors: Counter[str] = Counter()
        self.heartbeats_sent = 0
        self.heartbeats_unchanged = 0
        #: Send only the digest of an unchanged snapshot (as the agent does);
        #: False: the complete snapshot every time.
        self.digests = digests
        self.heartbeat_rtt_s: list[float] = []
        self.claims_sent = 0
        self.claims_outstanding = 0
        self.done = 0
        #: (when, host index) of the next heartbeat of every registered host.
        self._due: list[tuple[float, int]] = []

    async def start(self, register_concurrency: int = 64) -> None:
        """Connect, register every host, start heartbeats and claims."""
        import nats

        muxes: list[_Mux] = []
        for k in range(self.connections):
            nc = await nats.connect(
                self.nats_url,
                name=f"fleetlease-bench-simhosts-{k}",
                max_reconnect_attempts=-1,
                pending_size=64 * 1024 * 1024,
            )
            self._ncs.append(nc)
            mux = _Mux(nc, k, self.subjects)
            await mux.start()
            muxes.append(mux)
        for i, (host_id, credential) in enumerate(self.credentials.items()):
            devices = [f"{host_id}-d{j}" for j in range(self.devices_per_host)]
            self.hosts.append(SimHost(host_id, credential, devices, muxes[i % len(muxes)]))
        index = {h.host_id: i for i, h in enumerate(self.hosts)}
        self._spawn(self._heartbeat_loop())
        sem = asyncio.Semaphore(register_concurrency)

        async def attach(h: SimHost) -> None:
            async with sem:
                try:
                    await self._register(h)
                except (wire.RemoteError, TimeoutError) as exc:
                    self.errors[f"register:{getattr(exc, 'code', 'timeout')}"] += 1
                    return
            # Heartbeats start within one period (hosts start at different
            # times), claims at once.
            first = time.monotonic() + random.random() * self.heartbeat_s
            heapq.heappush(self._due, (first, index[h.host_id]))
            self._claim_uncovered(h)

        await asyncio.gather(*(attach(h) for h in self.hosts))

    async def _register(self, h: SimHost) -> None:
        ts_ms = int(time.time() * 1000)
        nonce = secrets.token_bytes(wire.NONCE_LEN)
        msg = wire.Register(
            host_id=h.host_id,
            agent_version="bench-sim",
            proof=register_proof(h.credential, h.host_id, ts_ms, nonce),
            ts_ms=ts_ms,
            nonce=nonce,
        )
        data = await h.mux.request(
            h.host_id, self.subjects.register(h.host_id), wire.encode(msg), self.timeout_s
        )
        ok = wire.decode_reply(data, wire.RegisterOk)
        h.signer = Signer(h.host_id, ok.generation, ok.session_key)
        self.heartbeat_s = ok.heartbeat_s

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _signed(
        self, h: SimHost, subject: str, msg_type: str, body: bytes, wait_s: float = 0.0
    ) -> bytes:
        """A signed request; its reply may take ``wait_s`` (a claim's wait) more."""
        assert h.signer is not None
        auth = h.signer.auth(subject, msg_type, body)
        data = wire.encode_envelope(msg_type, body, auth)
        return await h.mux.request(h.host_id, subject, data, self.timeout_s + wait_s)

    # --- heartbeats --------------------------------------------------------------
    def _snapshot(self, h: SimHost) -> tuple[bytes, str]:
        """The complete heartbeat's body and its digest (encoded once per change)."""
        if h.snapshot is None:
            devices = [
                wire.Device(
                    device_id=d, state="busy" if d in h.busy else "idle", capabilities=_CAPS
                )
                for d in h.devices
            ]
            digest = snapshot_digest(devices, None, "")
            body = wire.encode_body(wire.Heartbeat(devices=devices, digest=digest))
            h.snapshot = (body, digest)
        return h.snapshot

    def _changed(self, h: SimHost) -> None:
        """A device turned busy or idle: the next periodic heartbeat says so (as
        the agent's, which does not heartbeat at once for its own leases)."""
        h.snapshot = None

    async def _heartbeat_loop(self) -> None:
        """Every registered host's periodic heartbeats, from one timer queue."""
        while not self._stopping:
            now = time.monotonic()
            while self._due and self._due[0][0] <= now:
                _, i = heapq.heappop(self._due)
                heapq.heappush(self._due, (now + self.heartbeat_s, i))
                self._spawn(self._heartbeat(self.hosts[i]))
            await asyncio.sleep(0.02)

    async def _heartbeat(self, h: SimHost) -> None:
        """One heartbeat (another after it if one was asked for meanwhile): only
        the digest when the control plane holds this snapshot, else the
        complete one; the complete one again when it answers ``conflict``."""
        if h.heartbeat_busy:
            h.heartbeat_again = True
            return
        h.heartbeat_busy = True
        try:
            again = True
            while again and not self._stopping:
                h.heartbeat_again = False
                await self._heartbeat_once(h)
                again = h.heartbeat_again
        finally:
            h.heartbeat_busy = False

    async def _heartbeat_once(self, h: SimHost) -> None:
        t0 = time.monotonic()
        subject = self.subjects.heartbeat(h.host_id)
        body, digest = self._snapshot(h)
        try:
            if self.digests and h.acked == digest:
                try:
                    data = await self._signed(h, subject, "heartbeat", _unchanged_body(digest))
                    wire.decode_reply(data, wire.Ok)
                    self.heartbeats_unchanged += 1
                    self.heartbeats_sent += 1
                    self.heartbeat_rtt_s.append(time.monotonic() - t0)
                    return
                except wire.RemoteError as exc:
                    if exc.code != "conflict":
                        raise
                    self.errors["heartbeat:snapshot_unknown"] += 1
            h.acked = None
            data = await self._signed(h, subject, "heartbeat", body)
            wire.decode_reply(data, wire.Ok)
            h.acked = digest
        except wire.RemoteError as exc:
            self.errors[f"heartbeat:{exc.code}"] += 1
            return
        except TimeoutError:
            self.errors["heartbeat:timeout"] += 1
            return
        self.heartbeats_sent += 1
        self.heartbeat_rtt_s.append(time.monotonic() - t0)

    # --- claims and tasks ----------------------------------------------------------
    def _claim_uncovered(self, h: SimHost) -> None:
        """Cover every idle device not covered yet, the agent's way: claims of at
        most a ``claim_polls``-th of the host's devices each."""
        if self._stopping:
            return
        uncovered = [d for d in h.devices if d not in h.busy and d not in h.covered]
        size = max(1, -(-len(h.devices) // self.claim_polls))
        for i in range(0, len(uncovered), size):
            devices = uncovered[i : i + size]
            number = next(self._numbers)
            for d in devices:
                h.covered[d] = number
            self._spawn(self._claim(h, devices, number))

    async def _claim(self, h: SimHost, devices: list[str], number: int) -> None:
        body = wire.encode_body(wire.Claim(wait_s=self.claim_wait_s, devices=devices))
        assignment: wire.Assignment | None = None
        pause = 0.0
        started = time.monotonic()
        self.claims_sent += 1
        self.claims_outstanding += 1
        try:
            data = await self._signed(
                h, self.subjects.claim(h.host_id), "claim", body, self.claim_wait_s
            )
            reply = wire.decode_reply(data, (wire.Assignment, wire.NoWork))
            if isinstance(reply, wire.Assignment):
                assignment = reply
                self.held_at[reply.task_id] = time.time()
        except wire.RemoteError as exc:
            self.errors[f"claim:{exc.code}"] += 1
            pause = 1.0
        except TimeoutError:
            self.errors["claim:timeout"] += 1
        finally:
            self.claims_outstanding -= 1
            for d in devices:
                if h.covered.get(d) == number:
                    del h.covered[d]
        if assignment is not None:
            h.busy.add(assignment.device_id)
            self._changed(h)
        elif pause == 0.0 and time.monotonic() - started < _MIN_POLL_INTERVAL_S:
            # Back empty at once (no long-poll slot free): paced as the agent paces.
            pause = _MIN_POLL_INTERVAL_S - (time.monotonic() - started)
        if pause:
            await asyncio.sleep(pause)
        self._claim_uncovered(h)
        if assignment is not None:
            await self._run(h, assignment)

    async def _run(self, h: SimHost, a: wire.Assignment) -> None:
        try:
            ack = wire.encode_body(
                wire.Ack(task_id=a.task_id, attempt=a.attempt, lease_token=a.lease_token)
            )
            wire.decode_reply(
                await self._signed(h, self.subjects.ack(h.host_id), "ack", ack), wire.LeaseReply
            )
            result = wire.encode_body(
                wire.Result(
                    task_id=a.task_id,
                    attempt=a.attempt,
                    lease_token=a.lease_token,
                    outcome=Outcome.DONE,
                    fingerprint=_FINGERPRINT,
                )
            )
            wire.decode_reply(
                await self._signed(h, self.subjects.result(h.host_id), "result", result),
                wire.ResultReply,
            )
            self.done += 1
        except wire.RemoteError as exc:
            self.errors[f"task:{exc.code}"] += 1
        except TimeoutError:
            self.errors["task:timeout"] += 1
        finally:
            h.busy.discard(a.device_id)
            self._changed(h)
            self._claim_uncovered(h)

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for nc in self._ncs:
            with contextlib.suppress(Exception):
                await nc.close()
        self._ncs.clear()


def cpu_s() -> float:
    """CPU seconds of this process (the simulated hosts, mostly)."""
    t = os.times()
    return t.user + t.system
