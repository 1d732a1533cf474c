"""asyncio <-> pykka threads, without ever blocking the event loop.

The asyncio loop belongs to the caller (the NATS client and the asyncpg engine
live on it). Actors run on their own threads.

* Actor thread -> loop: :meth:`Bridge.run` submits a coroutine with
  ``asyncio.run_coroutine_threadsafe`` and blocks *the actor thread* (never the
  loop) until it finishes or the timeout passes.
* Actor thread -> loop, without waiting: :meth:`Bridge.spawn` starts a
  coroutine as a task on the loop and returns at once (a Lease actor hands its
  host transitions over this way; the loop answers the host right after the
  commit, with :meth:`Reply.settle_on_loop`).
* Loop -> actor: the loop never calls ``ask()`` and never awaits a pykka future
  (pykka's ``Future.__await__`` calls the blocking ``get()``). It creates a
  :class:`Reply` (an asyncio future plus its loop) and passes it inside a
  ``tell``; the actor completes it with ``loop.call_soon_threadsafe``, so
  ``await reply.wait(timeout)`` only ever suspends the coroutine.

A reply that never comes (dead actor, lost message) surfaces as the retryable
:class:`~persistence.errors.Unavailable` after the timeout, never as a hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Generic, TypeVar

from fleetlease.persistence.errors import Unavailable

T = TypeVar("T")


class Bridge:
    """The caller's event loop, seen from actor threads."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._loop_thread_id: int | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._loop_thread_id = threading.get_ident()
        else:
            loop.call_soon_threadsafe(self._remember_thread)

    def _remember_thread(self) -> None:
        self._loop_thread_id = threading.get_ident()

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._loop_thread_id

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait (in this thread) for its result.

        Only for actor threads: called on the loop thread it would deadlock, so it
        raises ``RuntimeError`` instead. On timeout the coroutine is cancelled and
        ``Unavailable`` raised: the outcome of a commit in flight is then unknown,
        and every caller treats it as retryable (repository writes are fenced and
        replays return the recorded outcome)."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("Bridge.run() called on the event loop thread (would deadlock)")
        if self.loop.is_closed():
            coro.close()
            raise Unavailable("the event loop is closed")
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError as exc:  # loop closed between the check and the call
            coro.close()
            raise Unavailable("the event loop is closed") from exc
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            fut.cancel()
            raise Unavailable(f"no answer from the event loop within {timeout} s") from exc
        except concurrent.futures.CancelledError as exc:
            raise Unavailable("the operation was cancelled (shutting down)") from exc

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> bool:
        """Start ``coro`` as a task on the loop, from any thread, without waiting
        for it (a Lease actor hands a transition over this way and goes on).
        False when the loop is closed: ``coro`` is closed and never runs."""
        try:
            self.loop.call_soon_threadsafe(self._start_task, coro)
        except RuntimeError:
            coro.close()
            return False
        return True

    def _start_task(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = self.loop.create_task(coro)
        # The loop keeps only weak references to its tasks.
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def call_soon(self, fn: Callable[..., object], *args: Any) -> bool:
        """Schedule ``fn(*args)`` on the loop from any thread. False when the loop
        is closed (shutdown): the call is dropped."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True


class Reply(Generic[T]):
    """A one-shot answer from an actor thread to a coroutine on the loop.

    Created on the loop (it holds an asyncio future of that loop). Completed from
    any thread with :meth:`set_result` / :meth:`set_exception`; only the first
    completion counts, later ones (and completions after the waiter gave up) are
    ignored. Awaited with :meth:`wait`, which has a timeout."""

    __slots__ = ("_future", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._future: asyncio.Future[T] = self._loop.create_future()

    def set_result(self, value: T) -> None:
        self._complete(value, None)

    def set_exception(self, exc: BaseException) -> None:
        self._complete(None, exc)

    def _complete(self, value: T | None, exc: BaseException | None) -> None:
        # A closed loop means nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._settle, value, exc)

    def settle_on_loop(self, value: T | None, exc: BaseException | None = None) -> None:
        """Complete it from the loop's own thread: at once, without the hop that
        :meth:`set_result` takes from an actor thread."""
        self._settle(value, exc)

    def _settle(self, value: T | None, exc: BaseException | None) -> None:
        if self._future.done():
            return
        if exc is not None:
            self._future.set_exception(exc)
        else:
            self._future.set_result(value)  # type: ignore[arg-type]

    def done(self) -> bool:
        return self._future.done()

    async def wait(self, timeout: float) -> T:
        """The answer, or ``Unavailable`` (retryable) if none came in ``timeout`` s."""
        try:
            async with asyncio.timeout(timeout):
                return await self._future
        except TimeoutError as exc:
            raise Unavailable(f"no reply within {timeout} s", retryable=True) from exc

    def __await__(self) -> Generator[Any, None, T]:
        return self._future.__await__()


#: The name the design notes use for the same thing.
AsyncReply = Reply
