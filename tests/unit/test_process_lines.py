"""A step's output split into lines as it arrives, however it is chunked."""

from __future__ import annotations

from collections import deque

from hypothesis import given
from hypothesis import strategies as st

from fleetlease.hostagent.runners.process import MAX_LINE_BYTES, _Lines


def split(chunks: list[bytes]) -> list[str]:
    out: list[str] = []
    lines = _Lines(out.append, deque(maxlen=20))
    for chunk in chunks:
        lines.feed(chunk)
    lines.end()
    return out


def expected(data: bytes) -> list[str]:
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    return [p[:MAX_LINE_BYTES].decode("utf-8", errors="replace").rstrip("\r") for p in parts]


line = st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),
    st.integers(MAX_LINE_BYTES - 2, MAX_LINE_BYTES * 3).map(lambda n: b"x" * n),
)


@given(st.lists(line, max_size=8), st.booleans(), st.lists(st.integers(1, 70_000), max_size=12))
def test_any_chunking_gives_the_lines_each_cut_at_the_limit(
    lines: list[bytes], trailing_newline: bool, cuts: list[int]
) -> None:
    data = b"\n".join(lines) + (b"\n" if trailing_newline and lines else b"")
    chunks, at = [], 0
    for cut in cuts:
        if at >= len(data):
            break
        chunks.append(data[at : at + cut])
        at += cut
    chunks.append(data[at:])
    assert split([c for c in chunks if c]) == expected(data)


def test_a_long_line_is_cut_once_and_the_next_line_comes_through() -> None:
    data = b"a" * (MAX_LINE_BYTES * 2 + 5) + b"\nnext\n"
    assert split([data[i : i + 4096] for i in range(0, len(data), 4096)]) == [
        "a" * MAX_LINE_BYTES,
        "next",
    ]
