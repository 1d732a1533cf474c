"""One command as a process group: streamed output, a timeout, and a stop that
leaves no process of the group behind.

The command runs through ``/bin/sh -c`` in a new session (its own process
group). Its stdout and stderr are read as they are written and handed over
line by line. Stopping (cancel, lease lost, timeout, shutdown) sends SIGTERM to
the whole group, then SIGKILL after a grace period; when the command ends on
its own, whatever it left running in its group is ended the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MAX_LINE_BYTES", "ProcessResult", "end_process_group", "run_process_group"]

#: A longer line is cut here (and the rest of it dropped up to its newline).
MAX_LINE_BYTES = 16 * 1024
_READ_CHUNK = 64 * 1024
TAIL_LINES = 20


@dataclass(frozen=True, kw_only=True)
class ProcessResult:
    """How the command ended: ``exit_code`` (negative: killed by that signal),
    or ``stopped`` with why (``timeout``, ``cancelled``), and its last lines."""

    exit_code: int | None
    stopped: str | None
    tail: tuple[str, ...]


async def end_process_group(pgid: int, grace_s: float) -> None:
    """SIGTERM to the group, SIGKILL to what is left after ``grace_s``."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while loop.time() < deadline:
        if not _group_alive(pgid):
            return
        await asyncio.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Lines:
    """Splits output into lines as it arrives; a line longer than
    ``MAX_LINE_BYTES`` is cut there and the rest of it dropped."""

    def __init__(self, on_line: Callable[[str], None], tail: deque[str]) -> None:
        self.on_line = on_line
        self.tail = tail
        self.buf = b""
        self.dropping = False

    def feed(self, chunk: bytes) -> None:
        buf = self.buf + chunk if self.buf else chunk
        start = 0
        while (nl := buf.find(b"\n", start)) >= 0:
            if self.dropping:
                self.dropping = False
            else:
                _emit(buf[start:nl], self.on_line, self.tail)
            start = nl + 1
        rest = buf[start:]
        if len(rest) > MAX_LINE_BYTES:
            if not self.dropping:
                _emit(rest[:MAX_LINE_BYTES], self.on_line, self.tail)
            self.dropping = True
            rest = b""
        self.buf = rest

    def end(self) -> None:
        if self.buf and not self.dropping:
            _emit(self.buf, self.on_line, self.tail)
        self.buf = b""


class _PipeReader:
    """Reads the output pipe with the loop's ``add_reader`` and closes it once.

    Not ``loop.connect_read_pipe``: under uvloop that transport closes the
    descriptor's number twice (libuv's close, then the file object's), and a
    descriptor another thread opened in between is closed under it. Here the
    number has one owner: this reader. ``done`` resolves at end of output; if
    handing a line over raised, the rest of the output is read and dropped (the
    command never blocks on a full pipe) and ``done`` raises that error.
    """

    def __init__(self, fd: int, lines: _Lines) -> None:
        self.fd = fd
        self.lines = lines
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.closed = False
        self.error: Exception | None = None
        try:
            os.set_blocking(fd, False)
            self.loop.add_reader(fd, self._readable)
        except BaseException:
            self.closed = True
            os.close(fd)
            raise

    def _readable(self) -> None:
        try:
            chunk = os.read(self.fd, _READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._finish(exc)
            return
        if not chunk:
            self._finish(self.error)
            return
        if self.error is None:
            try:
                self.lines.feed(chunk)
            except Exception as exc:
                self.error = exc

    def _finish(self, exc: BaseException | None) -> None:
        self.loop.remove_reader(self.fd)
        if self.done.done():
            return
        if exc is not None:
            self.done.set_exception(exc)
            return
        try:
            self.lines.end()
        except Exception as end_exc:
            self.done.set_exception(end_exc)
        else:
            self.done.set_result(None)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.fd)
        os.close(self.fd)
        if not self.done.done():
            self.done.cancel()
        elif not self.done.cancelled():
            self.done.exception()  # retrieved: the caller has what it needs


def _emit(raw: bytes, on_line: Callable[[str], None], tail: deque[str]) -> None:
    text = raw[:MAX_LINE_BYTES].decode("utf-8", errors="replace").rstrip("\r")
    tail.append(text)
    on_line(text)


async def run_process_group(
    command: str,
    *,
    cwd: Path,
    env: Mapping[str, str],
    on_line: Callable[[str], None],
    timeout_s: float | None,
    stop: asyncio.Event,
    grace_s: float = 10.0,
    on_start: Callable[[int], None] | None = None,
) -> ProcessResult:
    """Run ``command`` with ``/bin/sh -c`` in its own process group and wait for
    it, its output read to the end. ``stop`` being set, or ``timeout_s``
    passing, ends the group (SIGTERM, then SIGKILL after ``grace_s``).
    ``on_start`` gets the process group id as soon as it exists. Asyncio
    cancellation ends the group too, then propagates."""
    # Output goes through a pipe of our own, not the subprocess transport's:
    # the transport's wait() only returns once its pipes close, which a
    # background process still holding stdout would put off indefinitely.
    read_fd, write_fd = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            command,
            cwd=str(cwd),
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=write_fd,
            stderr=write_fd,
            start_new_session=True,
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    pgid = proc.pid  # a new session's leader: its pid is the group id
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    try:
        reader = _PipeReader(read_fd, _Lines(on_line, tail))
    except BaseException:
        await asyncio.shield(end_process_group(pgid, grace_s))
        raise
    waiter: asyncio.Task[int] | None = None
    stopper: asyncio.Task[bool] | None = None
    stopped: str | None = None
    try:
        waiter = asyncio.create_task(proc.wait())
        stopper = asyncio.create_task(stop.wait())
        if on_start is not None:
            on_start(pgid)
        done, _ = await asyncio.wait(
            {waiter, stopper}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if waiter not in done:
            stopped = "cancelled" if stopper in done else "timeout"
            await end_process_group(pgid, grace_s)
            await waiter
        # What the command left running in its group goes too (as a CI runner
        # cleans up orphans): a step owns nothing once it has ended.
        await end_process_group(pgid, min(grace_s, 2.0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(reader.done), timeout=max(grace_s, 1.0))
    except BaseException:
        # Cancelled, or something failed: the group never outlives the call.
        await asyncio.shield(end_process_group(pgid, grace_s))
        raise
    finally:
        if stopper is not None:
            stopper.cancel()
        if waiter is not None and not waiter.done():
            waiter.cancel()
        reader.close()
    return ProcessResult(exit_code=proc.returncode, stopped=stopped, tail=tuple(tail))
