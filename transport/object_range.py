"""Ranged reads of JetStream object-store objects, never the whole object.

The object store keeps an object as its meta message (``$O.<bucket>.M.<name>``:
size, chunk count, the ``nuid`` of its chunks) and its chunk messages on
``$O.<bucket>.C.<nuid>`` in stream ``OBJ_<bucket>``, in order. ``ObjectStore.get``
reads every chunk into memory; a range read here instead:

1. builds the object's chunk index, the stream sequence and size of each chunk,
   by walking the chunk subject with an ordered consumer that delivers headers
   only (``Nats-Msg-Size``, no data); the index is a few bytes per chunk and is
   kept per ``nuid`` (an object's chunks never change: writing a name again makes
   a new ``nuid``) in a small LRU;
2. fetches only the chunks that overlap the range, one at a time, by sequence
   (direct get), keeping the part of each that the range needs.

So one read holds the range plus one chunk in memory, and moves only those
chunks over the storage connection. The object's digest covers the whole
object and is not checked here: it was checked when the object was committed.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from fleetlease.persistence.errors import NotFound, Unavailable

#: Chunk indexes kept (the most recently read objects).
INDEX_CACHE = 64
#: The longest wait for the next header of an index walk.
_WALK_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ChunkIndex:
    """Stream sequence and end offset of each chunk of one object."""

    seqs: array[int]
    ends: array[int]

    @property
    def size(self) -> int:
        return self.ends[-1] if self.ends else 0

    def covering(self, offset: int, end: int) -> range:
        """Indexes of the chunks holding bytes ``[offset, end)``."""
        first = bisect.bisect_right(self.ends, offset)
        last = bisect.bisect_left(self.ends, end)
        return range(first, min(last + 1, len(self.seqs)))

    def start(self, i: int) -> int:
        return self.ends[i - 1] if i else 0


class ObjectRanges:
    """Ranged reads from the object-store bucket ``bucket`` through the
    JetStream context ``js`` gives."""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.stream = f"OBJ_{bucket}"
        self._indexes: OrderedDict[str, ChunkIndex] = OrderedDict()
        self._building: dict[str, asyncio.Future[ChunkIndex]] = {}

    async def read(
        self, js: Any, store: Any, name: str, offset: int, length: int
    ) -> tuple[bytes, int]:
        """``length`` bytes of object ``name`` from ``offset`` (fewer at its end)
        and the object's size. ``NotFound`` when the object is missing."""
        try:
            info = await store.get_info(name)
        except NotFoundError:
            raise NotFound(f"artifact object {name!r} is missing", field="name") from None
        except (NatsError, TimeoutError) as exc:
            raise Unavailable(f"the artifact store is unavailable: {_reason(exc)}") from None
        size = int(info.size or 0)
        if not info.nuid or info.is_link():
            raise NotFound(f"artifact object {name!r} is missing", field="name")
        end = min(size, offset + length)
        if offset >= end:
            return b"", size
        index = await self._index(js, str(info.nuid), size, int(info.chunks or 0))
        out = bytearray()
        for i in index.covering(offset, end):
            data = await self._chunk(js, index.seqs[i])
            start = index.start(i)
            if len(data) != index.ends[i] - start:
                self._indexes.pop(str(info.nuid), None)
                raise Unavailable(f"artifact object {name!r} changed while it was read")
            out += data[max(0, offset - start) : end - start]
        return bytes(out), size

    async def _chunk(self, js: Any, seq: int) -> bytes:
        try:
            msg = await js.get_msg(self.stream, seq=seq, direct=True)
        except NotFoundError:
            raise Unavailable("an artifact chunk is missing from the store") from None
        except (NatsError, TimeoutError) as exc:
            raise Unavailable(f"the artifact store is unavailable: {_reason(exc)}") from None
        return bytes(msg.data or b"")

    async def _index(self, js: Any, nuid: str, size: int, chunks: int) -> ChunkIndex:
        index = self._indexes.get(nuid)
        if index is not None:
            self._indexes.move_to_end(nuid)
            return index
        building = self._building.get(nuid)
        if building is not None:  # another read of the same object walks it
            return await asyncio.shield(building)
        fut: asyncio.Future[ChunkIndex] = asyncio.get_running_loop().create_future()
        self._building[nuid] = fut
        try:
            index = await self._walk(js, nuid, chunks)
            if index.size != size or len(index.seqs) != chunks:
                raise Unavailable("an artifact's chunks do not match its size")
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters re-raise it, nobody else needs to
            raise
        finally:
            self._building.pop(nuid, None)
        fut.set_result(index)
        self._indexes[nuid] = index
        while len(self._indexes) > INDEX_CACHE:
            self._indexes.popitem(last=False)
        return index

    async def _walk(self, js: Any, nuid: str, chunks: int) -> ChunkIndex:
        seqs, ends = array("q"), array("q")
        if chunks == 0:
            return ChunkIndex(seqs, ends)
        subject = f"$O.{self.bucket}.C.{nuid}"
        try:
            sub = await js.subscribe(
                subject, stream=self.stream, ordered_consumer=True, headers_only=True
            )
        except (NatsError, TimeoutError) as exc:
            raise Unavailable(f"the artifact store is unavailable: {_reason(exc)}") from None
        try:
            total = 0
            while True:
                msg = await sub.next_msg(timeout=_WALK_TIMEOUT_S)
                headers = msg.headers or {}
                total += int(headers.get("Nats-Msg-Size", len(msg.data or b"")))
                meta = msg.metadata
                seqs.append(int(meta.sequence.stream))
                ends.append(total)
                if meta.num_pending == 0 or len(seqs) >= chunks:
                    break
        except (NatsError, TimeoutError) as exc:
            raise Unavailable(f"the artifact store is unavailable: {_reason(exc)}") from None
        finally:
            with contextlib.suppress(NatsError, TimeoutError):
                await sub.unsubscribe()
        return ChunkIndex(seqs, ends)


def _reason(exc: BaseException) -> str:
    return str(getattr(exc, "description", None) or exc) or type(exc).__name__
