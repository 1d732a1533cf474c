"""Task events out, long-poll wake notices across processes.

The actor system reports each committed transition to its listeners
(``ControlPlane.add_listener``); :class:`EventFanout` publishes them on the
events subject (``Subjects.events_task``), batched per event-loop iteration.

An ``assigned`` event also sends a wake notice on ``{prefix}._wake``: every
``fleetlease serve`` process hears it (no queue group) and wakes the host's
long-polls parked with it (``ControlPlane.wake_hosts``), since a host's poll may
be parked in another process than the one whose Scheduler made the
assignment. A process ignores its own notices.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

import msgpack
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from fleetlease.transport.background import background
from fleetlease.transport.subjects import Subjects

log = structlog.get_logger("fleetlease.server")


class EventFanout:
    """Publishes the actor system's events on ``events_nc`` and exchanges wake
    notices on ``jobs_nc()`` (the server's jobs connection; None once closed).
    ``on_event`` is the listener; it may be called from any thread."""

    def __init__(
        self,
        *,
        subjects: Subjects,
        wake_hosts: Callable[[list[str]], None],
        jobs_nc: Callable[[], NatsClient | None],
    ) -> None:
        self.subjects = subjects
        self._wake_hosts = wake_hosts
        self._jobs_nc = jobs_nc
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._events_nc: NatsClient | None = None
        self._stopping = False
        self._wake_subject = f"{subjects.prefix}._wake"
        self._instance = os.urandom(8)
        self._wake_pending: set[str] = set()
        self._events_pending: list[Any] = []
        self._wake_sub: Subscription | None = None

    async def start(self, events_nc: NatsClient) -> None:
        """Publish on ``events_nc`` from now on, and hear the other processes'
        wake notices. Call on the server's loop."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._events_nc = events_nc
        jobs_nc = self._jobs_nc()
        assert jobs_nc is not None
        # Every process hears every wake notice (no queue group).
        self._wake_sub = await jobs_nc.subscribe(self._wake_subject, cb=self._on_wake_notice)
        await jobs_nc.flush()

    def stop(self) -> None:
        """Publish nothing more (the server is draining)."""
        self._stopping = True
        self._events_nc = None

    def on_event(self, event: Any) -> None:
        """Listener for the actor system's events; may be called from any thread."""
        loop = self._loop
        if loop is None or self._stopping or self._events_nc is None:
            return
        events = event if isinstance(event, list) else [event]
        if threading.get_ident() == self._loop_thread:
            # Published together at the end of this loop iteration: one task and
            # one flush for the events of many transitions.
            if not self._events_pending:
                loop.call_soon(self._publish_pending)
            self._events_pending.extend(events)
        else:
            with contextlib.suppress(RuntimeError):  # loop closed: shutting down
                loop.call_soon_threadsafe(self._publish_events, events)

    def _publish_pending(self) -> None:
        events, self._events_pending = self._events_pending, []
        self._publish_events(events)

    def _publish_events(self, events: list[Any]) -> None:
        nc = self._events_nc
        if nc is None or self._stopping:
            return
        subject = self.subjects.events_task()
        payloads: list[bytes] = []
        for event in events:
            try:
                payloads.append(msgpack.packb(event, default=str, use_bin_type=True))
            except (TypeError, ValueError):
                log.warning("event_not_encodable")
                continue
            if isinstance(event, dict) and event.get("state") == "assigned":
                host = event.get("host_id")
                if isinstance(host, str):
                    self._wake_elsewhere(host)
        if payloads:
            # One task for the batch, not one per event.
            background(_publish_all(nc, subject, payloads))

    def _wake_elsewhere(self, host_id: str) -> None:
        """A host's long-poll may be parked in another ``fleetlease serve``
        process than the one whose Scheduler made the assignment: tell the
        others. One notice per loop iteration, whatever the batch size."""
        if not self._wake_pending:
            asyncio.get_running_loop().call_soon(self._send_wake_notice)
        self._wake_pending.add(host_id)

    def _send_wake_notice(self) -> None:
        hosts, self._wake_pending = sorted(self._wake_pending), set()
        nc = self._jobs_nc()
        if not hosts or nc is None or self._stopping:
            return
        payload = msgpack.packb({"o": self._instance, "h": hosts}, use_bin_type=True)
        background(nc.publish(self._wake_subject, payload))

    async def _on_wake_notice(self, msg: Msg) -> None:
        try:
            notice = msgpack.unpackb(msg.data, raw=False)
            origin, hosts = notice["o"], notice["h"]
        except Exception:
            return
        if origin == self._instance or not isinstance(hosts, list):
            return
        self._wake_hosts([h for h in hosts if isinstance(h, str)])


async def _publish_all(nc: NatsClient, subject: str, payloads: list[bytes]) -> None:
    for payload in payloads:
        await nc.publish(subject, payload)
