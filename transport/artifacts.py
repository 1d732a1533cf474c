"""Host artifacts: staged chunks, the commit that assembles and verifies them,
and the JetStream object store they end in.

Chunks are staged in a JetStream stream of their own
(``transport.staging``: one subject per host, attempt, artifact and offset, and
the limits on it), so any ``fleetlease serve`` process of a queue group can take
any chunk and any of them can take the commit. A chunk or commit is taken only
for a lease the host holds now, fenced as a renewal is
(``Repository.check_holds``); an attempt's staged chunks are purged when it
ends. The commit reassembles the chunks in offset order, checks size and
SHA-256, stores the object under a content-addressed name in the object store,
and only then records it through the repository. A mismatch is a ``conflict``
and nothing is recorded.

Committed artifacts are bounded (``StagingLimits``): per attempt (count and
bytes) and per host (bytes over the attempts it holds), checked by the
repository in the commit's transaction, and in all by the object store
bucket's ``max_bytes``; beyond any of them the commit is ``quota`` and nothing
is stored. Reads take a range (``transport.object_range``: only the chunks the
range needs), at most ``user_reads`` per user and ``process_reads`` per process
at once (``busy`` beyond).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Any

import structlog
from nats.aio.client import Client as NatsClient
from nats.errors import Error as NatsError
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.errors import APIError, NotFoundError
from nats.js.object_store import OBJ_META_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

from fleetlease.persistence.errors import (
    Busy,
    Conflict,
    Invalid,
    QuotaExceeded,
    Unavailable,
)
from fleetlease.persistence.model import Session
from fleetlease.persistence.repository.sidechannels import ArtifactQuota
from fleetlease.transport import wire
from fleetlease.transport.background import background
from fleetlease.transport.object_range import ObjectRanges
from fleetlease.transport.staging import Staging, StagingLimits

if TYPE_CHECKING:
    from fleetlease.persistence.repository import Repository

log = structlog.get_logger("fleetlease.server")

ARTIFACT_BUCKET = "fleetlease-artifacts"
#: JetStream's error code for "stream name already in use".
_STREAM_NAME_IN_USE = 10058
#: Task states in which an attempt still holds its lease (staging is kept).
_HELD_STATES = frozenset({"assigned", "dispatched", "running"})


def artifact_object_name(task_id: str, attempt: int, name: str, sha256: str) -> str:
    """Content-addressed within the attempt: writing it again can only ever
    write the same bytes, whoever writes it."""
    return f"{task_id}/{attempt}/{sha256}/{name}"


class Artifacts:
    """The artifacts of one ``Server``: staging (``transport.staging``), commit,
    object store, and the purge of an ended attempt's staged chunks. JetStream is
    reached through ``storage()``, the server's storage connection (None once
    closed)."""

    def __init__(
        self,
        *,
        repo: Repository,
        prefix: str,
        storage: Callable[[], NatsClient | None],
        limits: StagingLimits | None = None,
    ) -> None:
        self.repo = repo
        self._storage = storage
        self._js_lock = asyncio.Lock()
        self._object_store: Any = None
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fleetlease-artifact-io")
        prefix_id = prefix.replace(".", "-")
        self.artifact_bucket = f"{ARTIFACT_BUCKET}-{prefix_id}"
        self.staging_stream = f"FLEETLEASE_UPLOADS_{prefix_id}"
        #: Artifact staging and its limits (``transport.staging``).
        self.staging = Staging(
            self._js,
            stream=self.staging_stream,
            root=f"{prefix}._uploads",
            limits=limits or StagingLimits(),
        )
        self._ended: set[tuple[str, str, int]] = set()
        self._purging = False
        self._stopping = False
        self._stopped = False
        self.ranges = ObjectRanges(self.artifact_bucket)
        self._reads: dict[str, int] = {}

    def stop_purging(self) -> None:
        """No new purges (the server is draining)."""
        self._stopping = True

    def stop(self) -> None:
        """The purge running stops after its current batch."""
        self._stopping = True
        self._stopped = True

    def close(self) -> None:
        """Release the file-writing threads (the server has stopped)."""
        self._io.shutdown(wait=False, cancel_futures=True)

    async def _js(self) -> Any:
        nc = self._storage()
        if nc is None:
            raise Unavailable("the artifact store connection is closed")
        return nc.jetstream(timeout=10.0)

    @property
    def limits(self) -> StagingLimits:
        return self.staging.limits

    async def _store(self) -> Any:
        """The object store, created with (or brought to) ``store_bytes`` on
        first use."""
        if self._object_store is None:
            js = await self._js()
            async with self._js_lock:
                if self._object_store is None:
                    try:
                        try:
                            store = await js.object_store(self.artifact_bucket)
                        except NotFoundError:
                            try:
                                await js.create_object_store(
                                    self.artifact_bucket,
                                    ObjectStoreConfig(
                                        max_bytes=self.limits.store_bytes,
                                        storage=StorageType.FILE,
                                        replicas=self.limits.replicas,
                                    ),
                                )
                            except APIError as exc:
                                if exc.err_code != _STREAM_NAME_IN_USE:  # else another won
                                    log.error(
                                        "artifact_store_unavailable",
                                        bucket=self.artifact_bucket,
                                        error=exc.description,
                                    )
                                    raise
                            store = await js.object_store(self.artifact_bucket)
                        await self._apply_store_bytes(js)
                    except (NatsError, TimeoutError) as exc:
                        reason = getattr(exc, "description", None) or exc
                        raise Unavailable(f"the artifact store is unavailable: {reason}") from None
                    self._object_store = store
        return self._object_store

    async def _apply_store_bytes(self, js: Any) -> None:
        """Bring the bucket's ``max_bytes`` to ``store_bytes``, but never below
        what it holds: JetStream would drop the oldest objects to fit. Commits
        are refused while the store is over ``store_bytes`` (``_check_room``).
        The bucket's replica count is brought to ``replicas`` too."""
        info = await js.stream_info(self.ranges.stream)
        want, held = self.limits.store_bytes, int(info.state.bytes or 0)
        changed = False
        if info.config.max_bytes != want:
            if held > want:
                log.warning(
                    "artifact_store_over_limit",
                    bucket=self.artifact_bucket,
                    bytes=held,
                    limit=want,
                )
            else:
                info.config.max_bytes = want
                changed = True
        if (info.config.num_replicas or 1) != self.limits.replicas:
            info.config.num_replicas = self.limits.replicas
            changed = True
        if changed:
            await js.update_stream(info.config)

    def _quota(self) -> ArtifactQuota:
        limits = self.limits
        return ArtifactQuota(
            attempt_bytes=limits.attempt_bytes,
            attempt_artifacts=limits.attempt_artifacts,
            host_bytes=limits.host_bytes_committed,
        )

    async def _check_room(self, size: int) -> None:
        """``QuotaExceeded`` when the object store has no room for ``size`` more
        bytes (a first check; the bucket's ``max_bytes`` is the bound)."""
        js = await self._js()
        try:
            info = await js.stream_info(self.ranges.stream)
        except (NatsError, TimeoutError) as exc:
            raise Unavailable(f"the artifact store is unavailable: {exc}") from None
        if int(info.state.bytes or 0) + size > self.limits.store_bytes:
            raise QuotaExceeded("the artifact store is full", reason="store_quota")

    async def chunk(self, s: Session, m: wire.ArtifactChunk) -> None:
        """Stage one chunk: only for a lease the host holds now (fenced as a
        renewal, nothing staged otherwise), within the staging limits."""
        with self.staging.host_slot(s.host_id):
            await self.repo.check_holds(s, m.task_id, m.attempt, m.lease_token)
            if not m.data:
                return  # nothing to stage; an empty artifact is a commit of size 0
            await self.staging.stage(s.host_id, m.task_id, m.attempt, m.name, m.offset, m.data)

    async def commit(self, s: Session, m: wire.ArtifactCommit) -> None:
        """Reassemble and verify the staged chunks (``conflict`` on any mismatch,
        nothing recorded, the upload's chunks dropped); record the artifact
        (fenced: only for a lease the host holds now); then store the object. A
        failed store leaves a record whose object is missing until the host's
        retry of the commit (the record is idempotent) stores it."""
        limit = self.staging.limits.max_artifact_bytes
        if m.size > limit:
            raise Invalid(f"artifacts are limited to {limit} bytes", field="size")
        await self.repo.check_holds(s, m.task_id, m.attempt, m.lease_token)
        upload = self.staging.artifact_filter(s.host_id, m.task_id, m.attempt, m.name)
        object_name = artifact_object_name(m.task_id, m.attempt, m.name, m.sha256)
        store = await self._store()
        stored = await self._stored(store, object_name, m.size)
        if not stored:
            await self._check_room(m.size)
        fd, path = tempfile.mkstemp(prefix="fleetlease-artifact-")
        f = os.fdopen(fd, "w+b")
        try:
            if not stored:
                try:
                    await self._assemble(s, m, f)
                except Conflict:
                    await self.staging.purge(upload)
                    raise
            added = await self.repo.record_artifact(
                s,
                m.task_id,
                m.attempt,
                name=m.name,
                size=m.size,
                sha256=m.sha256,
                object_name=object_name,
                quota=self._quota(),
            )
            if not stored:
                await self._put(s, m, store, object_name, f, forget=bool(added))
        finally:
            f.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
        log.info(
            "artifact_committed",
            host_id=s.host_id,
            task_id=m.task_id,
            attempt=m.attempt,
            name=m.name,
            size=m.size,
        )
        await self.staging.purge(upload)

    async def _put(
        self,
        s: Session,
        m: wire.ArtifactCommit,
        store: Any,
        object_name: str,
        f: IO[bytes],
        *,
        forget: bool,
    ) -> None:
        """Store the object; when the store is full (its ``max_bytes``) the
        commit is ``quota`` and the record just made is removed."""
        try:
            await store.put(object_name, f)
        except APIError as exc:
            if "maximum" not in (exc.description or "").lower():
                raise
            if forget:
                await self.repo.forget_artifact(
                    s, m.task_id, m.attempt, name=m.name, sha256=m.sha256
                )
            raise QuotaExceeded("the artifact store is full", reason="store_quota") from None

    @staticmethod
    async def _stored(store: Any, object_name: str, size: int) -> bool:
        try:
            info = await store.get_info(object_name)
        except NotFoundError:
            return False
        return int(info.size or 0) == size

    async def _assemble(self, s: Session, m: wire.ArtifactCommit, f: IO[bytes]) -> None:
        """The staged chunks from offset 0, in order, into ``f``; ``Conflict``
        unless they add up to exactly ``m.size`` bytes with digest ``m.sha256``."""
        loop = asyncio.get_running_loop()
        digest = hashlib.sha256()
        offset = 0
        while offset < m.size:
            data = await self.staging.chunk(s.host_id, m.task_id, m.attempt, m.name, offset)
            if not data or offset + len(data) > m.size:
                raise Conflict(
                    f"artifact {m.name!r}: chunks do not add up to {m.size} bytes", field="size"
                )
            digest.update(data)
            await loop.run_in_executor(self._io, f.write, data)
            offset += len(data)
        if digest.hexdigest() != m.sha256:
            raise Conflict(
                f"artifact {m.name!r}: digest does not match the chunks received", field="sha256"
            )
        await loop.run_in_executor(self._io, _rewind, f)

    def on_attempt_event(self, event: Any) -> None:
        """Listener for the actor system's events (on the loop): an attempt that
        no longer holds its lease (result, expiry) has its staged chunks purged."""
        if not isinstance(event, dict):
            return
        host, task, attempt = event.get("host_id"), event.get("task_id"), event.get("attempt")
        if event.get("state") in _HELD_STATES or not isinstance(host, str):
            return
        if not isinstance(task, str) or not isinstance(attempt, int) or attempt < 1:
            return
        self.purge_staged([(host, task, attempt)])

    def purge_staged(self, ended: Iterable[tuple[str, str, int]]) -> None:
        """Purge the staged chunks of these ended (host, task, attempt)s soon:
        in batches, one purge task at a time (``Staging.purge_attempts``)."""
        if self._stopping:
            return
        self._ended.update(ended)
        if self._ended and not self._purging:
            self._purging = True
            background(self._purge_ended())

    async def _purge_ended(self) -> None:
        try:
            while self._ended and not self._stopped:
                ended, self._ended = self._ended, set()
                await self.staging.purge_attempts(ended)
        finally:
            self._purging = False

    @contextlib.contextmanager
    def read_slot(self, reader: str) -> Iterator[None]:
        """One of the reader's ``user_reads`` and the process's
        ``process_reads`` read slots for the duration (``Busy`` beyond)."""
        limits = self.limits
        used = self._reads.get(reader, 0)
        if used >= limits.user_reads:
            raise Busy(
                f"at most {limits.user_reads} artifact reads of a user at once",
                reason="in_flight",
            )
        if sum(self._reads.values()) >= limits.process_reads:
            raise Busy("the server is reading as many artifacts as it may", reason="in_flight")
        self._reads[reader] = used + 1
        try:
            yield
        finally:
            left = self._reads[reader] - 1
            if left:
                self._reads[reader] = left
            else:
                del self._reads[reader]

    async def read_range(
        self, object_name: str, *, offset: int, length: int, reader: str
    ) -> tuple[bytes, int]:
        """``length`` bytes of the stored object from ``offset`` (fewer at its
        end) and the object's size: only the chunks the range needs are read
        (``transport.object_range``). ``NotFound`` if the object is missing,
        ``Busy`` beyond the read slots of ``reader`` or of the process."""
        with self.read_slot(reader):
            store = await self._store()
            return await self.ranges.read(await self._js(), store, object_name, offset, length)

    async def read_artifact(self, object_name: str) -> bytes:
        """The whole stored object (for small objects and tests: the user API
        reads ranges, ``read_range``)."""
        store = await self._store()
        js = await self._js()
        _, size = await self.ranges.read(js, store, object_name, 0, 0)
        data, _ = await self.ranges.read(js, store, object_name, 0, size)
        return data

    async def delete_objects(self, object_names: Iterable[str]) -> tuple[int, int]:
        """Delete these objects (retention: their artifact rows are already
        gone; an object name is its task's and attempt's own, so no other row
        refers to it) and their metadata. A missing object counts as deleted.
        Returns (deleted, failed); a failure is logged, not raised."""
        names = sorted(set(object_names))
        if not names:
            return 0, 0
        store = await self._store()
        js = await self._js()
        stream = OBJ_STREAM_TEMPLATE.format(bucket=self.artifact_bucket)
        deleted = failed = 0
        for name in names:
            if self._stopped:
                break
            try:
                with contextlib.suppress(NotFoundError):
                    await store.delete(name)
                # ObjectStore.delete leaves a tombstone; nothing will read it.
                meta = OBJ_META_PRE_TEMPLATE.format(
                    bucket=self.artifact_bucket,
                    obj=base64.urlsafe_b64encode(name.encode()).decode(),
                )
                await js.purge_stream(stream, subject=meta)
                deleted += 1
            except (NatsError, TimeoutError, Unavailable) as exc:
                failed += 1
                log.warning("artifact_delete_failed", object_name=name, error=repr(exc))
        return deleted, failed

    async def delete_storage(self) -> None:
        """Remove this prefix's object store bucket and staging stream (tests)."""
        js = await self._js()
        with contextlib.suppress(Exception):
            await js.delete_object_store(self.artifact_bucket)
        with contextlib.suppress(Exception):
            await js.delete_stream(self.staging_stream)
        self._object_store = None
        self.staging.forget()


def _rewind(f: IO[bytes]) -> None:
    f.flush()
    f.seek(0)
