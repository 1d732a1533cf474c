"""Which chunks a range needs (``transport.object_range.ChunkIndex``) and the
validation of the artifact limits (``StagingLimits``): pure logic."""

from __future__ import annotations

from array import array

import pytest

from fleetlease.transport.object_range import ChunkIndex
from fleetlease.transport.staging import StagingLimits


def index(*sizes: int) -> ChunkIndex:
    ends, total = array("q"), 0
    for size in sizes:
        total += size
        ends.append(total)
    return ChunkIndex(array("q", range(10, 10 + len(sizes))), ends)


def covered(ix: ChunkIndex, offset: int, length: int) -> bytes:
    """The bytes ``[offset, offset + length)`` of an object whose byte at
    position p is p % 251, rebuilt from the chunks the index names."""
    whole = bytes(p % 251 for p in range(ix.size))
    end = min(ix.size, offset + length)
    out = bytearray()
    for i in ix.covering(offset, end):
        start = ix.start(i)
        chunk = whole[start : ix.ends[i]]
        out += chunk[max(0, offset - start) : end - start]
    return bytes(out)


@pytest.mark.parametrize(
    ("offset", "length", "chunks"),
    [
        (0, 1, [0]),
        (0, 10, [0]),
        (9, 2, [0, 1]),
        (10, 10, [1]),
        (15, 100, [1, 2]),
        (29, 1, [2]),
        (0, 30, [0, 1, 2]),
    ],
)
def test_a_range_covers_only_the_chunks_it_overlaps(
    offset: int, length: int, chunks: list[int]
) -> None:
    ix = index(10, 10, 10)
    assert list(ix.covering(offset, min(ix.size, offset + length))) == chunks


def test_every_range_is_rebuilt_exactly_from_its_chunks() -> None:
    ix = index(7, 1, 13, 7, 2)
    whole = bytes(p % 251 for p in range(ix.size))
    for offset in range(ix.size + 2):
        for length in range(1, ix.size + 3):
            assert covered(ix, offset, length) == whole[offset : offset + length]


def test_an_empty_object_has_no_chunks() -> None:
    ix = index()
    assert ix.size == 0 and list(ix.covering(0, 0)) == []


@pytest.mark.parametrize(
    "field",
    [
        "attempt_bytes",
        "attempt_artifacts",
        "host_bytes_committed",
        "store_bytes",
        "user_reads",
        "process_reads",
    ],
)
@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_artifact_limits_are_positive_ints(field: str, bad: object) -> None:
    with pytest.raises(ValueError, match=field):
        StagingLimits(**{field: bad})  # type: ignore[arg-type]
