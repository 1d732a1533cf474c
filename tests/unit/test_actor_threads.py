"""``ActorThreads``: the threads Lease actors run on, reused from one actor to
the next. Every wait is on a condition, with a timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from fleetlease.actors.base import ActorThreads


def _until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class _Loop:
    """An actor loop that notes its thread and runs until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.ran_on: int | None = None
        self.thread: threading.Thread | None = None
        self.done = threading.Event()

    def __call__(self) -> None:
        self.ran_on = threading.get_ident()
        self.thread = threading.current_thread()
        self.release.wait(10)
        self.done.set()


def test_an_actor_runs_on_the_thread_its_predecessor_left() -> None:
    threads = ActorThreads(idle_s=10.0)
    first, second = _Loop(), _Loop()
    assert not threads.run(first)  # nothing idle yet: the caller starts one
    threads.start(first)
    _until(lambda: first.ran_on is not None, "the first loop to start")
    assert not threads.run(second)  # the only thread is busy
    first.release.set()
    _until(lambda: threads.idle == 1, "the thread to wait for the next actor")
    assert threads.run(second)
    second.release.set()
    assert second.done.wait(10)
    assert second.ran_on == first.ran_on
    assert (threads.started, threads.reused) == (1, 1)


def test_a_failing_loop_keeps_its_thread() -> None:
    threads = ActorThreads(idle_s=10.0)
    ran_on: list[int] = []

    def failing() -> None:
        ran_on.append(threading.get_ident())
        raise RuntimeError("a bug in an actor loop")

    threads.start(failing)
    _until(lambda: threads.idle == 1, "the thread to wait for the next actor")
    after = _Loop()
    assert threads.run(after)
    after.release.set()
    assert after.done.wait(10)
    assert after.ran_on == ran_on[0]


def test_an_idle_thread_ends_after_idle_s() -> None:
    threads = ActorThreads(idle_s=0.05)
    first = _Loop()
    first.release.set()
    threads.start(first)
    assert first.done.wait(10)
    thread = first.thread
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive() and threads.idle == 0
    assert not threads.run(_Loop())  # nothing idle: the caller starts a thread
