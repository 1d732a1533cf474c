"""Artifact staging: the JetStream stream that holds uploaded chunks until their
commit, and every limit on it.

One subject per chunk: ``<root>.<host>.<task>.<attempt>.<name hash>.<offset>``,
the last message per subject kept (a retried chunk replaces itself). The host
id is the subject's first token, so a host's chunks are found, counted and
purged by subject filter, and no host can touch another's.

Limits (``StagingLimits``; all bounds hold whatever a host sends):

* a chunk starts at a multiple of ``wire.ARTIFACT_CHUNK_BYTES`` and holds at
  most that many bytes, and an artifact ends by ``max_artifact_bytes``; with one
  message per subject, one upload (host, attempt, name) thus stages at most
  ``max_artifact_bytes``;
* an upload starts with its chunk at offset 0 (a later chunk is refused while
  that one is not staged), and a host has at most ``host_uploads`` uploads
  staged at once (``quota`` beyond): at most ``host_uploads *
  max_artifact_bytes`` bytes per host. Uploads are counted from the stream
  (their offset-0 subjects) before an upload's first chunk; with
  ``host_in_flight`` chunks of a host handled at once per server process, a
  host can overshoot by at most that many uploads per process;
* a host has at most ``host_in_flight`` chunk or commit requests in progress
  per server process (``busy`` beyond): a flood from one host never holds the
  artifact workers other hosts need;
* the stream holds at most ``total_bytes`` (``max_bytes`` with discard policy
  *new*: the server refuses a chunk that does not fit, ``quota``);
* a staged chunk is dropped ``max_age_s`` after it was written, committed or
  not (the backstop; chunks normally go at their commit or when their attempt
  ends, see ``purge_attempts``).

Whether the host may stage for an attempt at all (it holds the lease now) is
the caller's check, made before ``stage``.

The same dataclass carries the limits on committed artifacts and on reading
them, enforced by ``transport.artifacts``:

* an attempt commits at most ``attempt_artifacts`` artifacts of at most
  ``attempt_bytes`` bytes in all, and the attempts a host holds now have at
  most ``host_bytes_committed`` bytes committed in all (``quota`` at the
  commit beyond them, nothing stored; counted from the artifacts table in the
  commit's transaction);
* the object store holds at most ``store_bytes`` (its bucket's ``max_bytes``;
  a commit that does not fit is ``quota`` and nothing is stored);
* a user has at most ``user_reads`` artifact reads in progress and a server
  process at most ``process_reads`` (``busy`` beyond); each read holds at
  most its range plus one object-store chunk in memory.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import structlog
from nats.errors import Error as NatsError
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from fleetlease.persistence.errors import Busy, Conflict, Invalid, QuotaExceeded, Unavailable
from fleetlease.transport import wire

log = structlog.get_logger("fleetlease.staging")

#: Bytes a stored message may carry beyond its data (headers).
_MSG_OVERHEAD = 4096
#: JetStream's error code for "stream name already in use".
_STREAM_NAME_IN_USE = 10058


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class StagingLimits:
    """The limits of artifact staging, committed artifacts and artifact reads
    (see the module doc). Defaults: staging 2 GiB in all, 256 MiB per artifact,
    2 uploads (512 MiB) per host, 2 chunk requests per host at once per server
    process, chunks kept at most one hour; committed: 1 GiB and 64 artifacts
    per attempt, 4 GiB over the attempts a host holds, 8 GiB in the object
    store; reads: 2 per user and 8 per server process at once. ``replicas``
    is the JetStream replica count of the staging stream and the object store
    (1 on a single nats-server; up to the cluster size on a NATS cluster)."""

    total_bytes: int = 2 * 1024**3
    max_artifact_bytes: int = 256 * 1024 * 1024
    host_uploads: int = 2
    host_in_flight: int = 2
    max_age_s: float = 3600.0
    attempt_bytes: int = 1024**3
    attempt_artifacts: int = 64
    host_bytes_committed: int = 4 * 1024**3
    store_bytes: int = 8 * 1024**3
    user_reads: int = 2
    process_reads: int = 8
    replicas: int = 1

    def __post_init__(self) -> None:
        for name in (
            "total_bytes",
            "host_uploads",
            "host_in_flight",
            "max_artifact_bytes",
            "attempt_bytes",
            "attempt_artifacts",
            "host_bytes_committed",
            "store_bytes",
            "user_reads",
            "process_reads",
            "replicas",
        ):
            _positive_int(name, getattr(self, name))
        if self.total_bytes < wire.ARTIFACT_CHUNK_BYTES + _MSG_OVERHEAD:
            raise ValueError(f"total_bytes must hold one chunk, got {self.total_bytes}")
        if not isinstance(self.max_age_s, int | float) or not self.max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0, got {self.max_age_s!r}")

    @property
    def host_bytes(self) -> int:
        """The most a host can have staged at once."""
        return self.host_uploads * self.max_artifact_bytes


class Staging:
    """The staging stream of one subject prefix. ``jetstream`` gives the
    JetStream context to use (raises ``Unavailable`` when there is none)."""

    def __init__(
        self,
        jetstream: Callable[[], Awaitable[Any]],
        *,
        stream: str,
        root: str,
        limits: StagingLimits,
    ) -> None:
        self._jetstream = jetstream
        self.stream = stream
        self.root = root
        self.limits = limits
        self._ready = False
        self._in_flight: dict[str, int] = {}

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.stream,
            subjects=[f"{self.root}.>"],
            storage=StorageType.FILE,
            max_bytes=self.limits.total_bytes,
            discard=DiscardPolicy.NEW,
            max_age=self.limits.max_age_s,
            max_msgs_per_subject=1,
            max_msg_size=wire.ARTIFACT_CHUNK_BYTES + _MSG_OVERHEAD,
            num_replicas=self.limits.replicas,
        )

    async def js(self) -> Any:
        """The JetStream context, the stream created (or brought to this
        process's limits) on first use."""
        js = await self._jetstream()
        if self._ready:
            return js
        try:
            try:
                await js.stream_info(self.stream)
            except NotFoundError:
                try:
                    await js.add_stream(self.config())
                except APIError as exc:
                    if exc.err_code != _STREAM_NAME_IN_USE:  # else another process won
                        raise
            # Existing or just made by another process: these limits from now on.
            await js.update_stream(self.config())
        except (NatsError, TimeoutError) as exc:
            log.error("staging_stream_unavailable", stream=self.stream, error=_reason(exc))
            raise Unavailable(f"artifact staging unavailable: {_reason(exc)}") from None
        self._ready = True
        return js

    def forget(self) -> None:
        """The stream was deleted: create it again on next use."""
        self._ready = False

    # --- subjects --------------------------------------------------------------------
    def chunk_subject(
        self, host_id: str, task_id: str, attempt: int, name: str, offset: int
    ) -> str:
        return f"{self.artifact_filter(host_id, task_id, attempt, name)[:-2]}.{offset}"

    def artifact_filter(self, host_id: str, task_id: str, attempt: int, name: str) -> str:
        # The name is the host's choice: hashed into one subject token.
        name_id = hashlib.sha256(name.encode("utf-8")).hexdigest()[:32]
        return f"{self.attempt_filter(host_id, task_id, attempt)[:-2]}.{name_id}.>"

    def attempt_filter(self, host_id: str, task_id: str, attempt: int) -> str:
        return f"{self.host_filter(host_id)[:-2]}.{task_id}.{attempt}.>"

    def host_filter(self, host_id: str) -> str:
        return f"{self.root}.{host_id}.>"

    # --- staging ---------------------------------------------------------------------
    @contextlib.contextmanager
    def host_slot(self, host_id: str) -> Iterator[None]:
        """One of the host's ``host_in_flight`` request slots for the duration
        (``Busy`` when all are taken)."""
        used = self._in_flight.get(host_id, 0)
        if used >= self.limits.host_in_flight:
            raise Busy(
                f"at most {self.limits.host_in_flight} artifact requests of a host at once",
                reason="in_flight",
            )
        self._in_flight[host_id] = used + 1
        try:
            yield
        finally:
            left = self._in_flight[host_id] - 1
            if left:
                self._in_flight[host_id] = left
            else:
                del self._in_flight[host_id]

    async def _subjects(self, subject_filter: str) -> dict[str, int]:
        js = await self.js()
        try:
            info = await js.stream_info(self.stream, subjects_filter=subject_filter)
        except (NatsError, TimeoutError) as exc:
            raise Unavailable(f"artifact staging unavailable: {_reason(exc)}") from None
        return dict(info.state.subjects or {})

    async def staged_uploads(self, host_id: str) -> int:
        """How many uploads the host has staged (by their offset-0 chunks)."""
        return len(await self._subjects(f"{self.host_filter(host_id)[:-2]}.*.*.*.0"))

    async def stage(
        self, host_id: str, task_id: str, attempt: int, name: str, offset: int, data: bytes
    ) -> None:
        """Store one chunk within the limits (``Invalid``, ``Conflict`` or
        ``QuotaExceeded`` beyond them)."""
        limits, unit = self.limits, wire.ARTIFACT_CHUNK_BYTES
        if offset % unit or len(data) > unit:
            raise Invalid(
                f"chunks start at multiples of {unit} bytes and hold at most {unit}",
                field="offset",
            )
        if offset + len(data) > limits.max_artifact_bytes:
            raise Invalid(
                f"artifacts are limited to {limits.max_artifact_bytes} bytes", field="offset"
            )
        subject = self.chunk_subject(host_id, task_id, attempt, name, offset)
        js = await self.js()
        if offset == 0:
            if await self.staged_uploads(host_id) >= limits.host_uploads and not (
                await self._subjects(subject)
            ):
                raise QuotaExceeded(
                    f"this host has {limits.host_uploads} artifact uploads staged, the most it"
                    " may: commit them first",
                    reason="host_quota",
                )
        elif not await self._subjects(self.chunk_subject(host_id, task_id, attempt, name, 0)):
            raise Conflict(
                f"artifact {name!r}: an upload starts with its chunk at offset 0", field="offset"
            )
        try:
            await js.publish(subject, data, stream=self.stream)
        except APIError as exc:
            if "maximum" in (exc.description or "").lower():
                raise QuotaExceeded(
                    "artifact staging is full: retry later", reason="total_quota"
                ) from None
            raise Unavailable(f"artifact staging refused the chunk: {_reason(exc)}") from None
        except (NatsError, TimeoutError) as exc:
            raise Unavailable(f"artifact staging unavailable: {_reason(exc)}") from None

    async def chunk(
        self, host_id: str, task_id: str, attempt: int, name: str, offset: int
    ) -> bytes:
        """The staged chunk at ``offset`` (``Conflict`` when there is none)."""
        js = await self.js()
        subject = self.chunk_subject(host_id, task_id, attempt, name, offset)
        try:
            raw = await js.get_last_msg(self.stream, subject)
        except NotFoundError:
            raise Conflict(
                f"artifact {name!r}: no chunk at offset {offset}", field="size"
            ) from None
        except (NatsError, TimeoutError) as exc:
            raise Unavailable(f"artifact staging unavailable: {_reason(exc)}") from None
        return bytes(raw.data or b"")

    # --- purging ---------------------------------------------------------------------
    async def purge(self, subject_filter: str) -> None:
        """Drop the staged chunks under ``subject_filter`` (best effort: what
        stays is dropped at ``max_age_s``). Never creates the stream."""
        try:
            js = await self._jetstream()
            await js.purge_stream(self.stream, subject=subject_filter)
        except NotFoundError:
            return
        except (NatsError, TimeoutError, Unavailable) as exc:
            log.warning("staging_purge_failed", filter=subject_filter, error=_reason(exc))

    async def purge_attempts(self, ended: Iterable[tuple[str, str, int]]) -> int:
        """Drop the staged chunks of these ended (host, task, attempt)s: nothing
        but one stream read when nothing is staged (the usual case), else one
        purge per attempt. Returns the number of purges made."""
        wanted = sorted(set(ended))
        if not wanted:
            return 0
        try:
            js = await self._jetstream()
            info = await js.stream_info(self.stream)
        except NotFoundError:
            return 0  # nothing was ever staged
        except (NatsError, TimeoutError, Unavailable) as exc:
            log.warning("staging_purge_failed", error=_reason(exc))
            return 0
        if not info.state.messages:
            return 0
        for host_id, task_id, attempt in wanted:
            await self.purge(self.attempt_filter(host_id, task_id, attempt))
        return len(wanted)


def _reason(exc: BaseException) -> str:
    return str(getattr(exc, "description", None) or exc) or type(exc).__name__
