"""The asyncio <-> pykka bridge and the base actor's error policy (no database)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pykka
import pytest

from fleetlease.actors.base import Context, FleetActor
from fleetlease.actors.bridge import Bridge, Reply
from fleetlease.actors.messages import Crash, Message, Renew
from fleetlease.persistence.clock import ManualClock
from fleetlease.persistence.errors import Invalid, NotFound, Unavailable
from fleetlease.persistence.model import Session
from fleetlease.persistence.repository import Repository
from tests.chaos.harness import wait_until


@pytest.fixture(autouse=True)
def _stop_all_actors() -> Iterator[None]:
    yield
    pykka.ActorRegistry.stop_all(timeout=30)


@dataclass(frozen=True, kw_only=True)
class Echo(Message):
    value: Any = None


@dataclass(frozen=True, kw_only=True)
class Block(Message):
    gate: threading.Event


@dataclass(frozen=True, kw_only=True)
class Refuse(Message):
    pass


class EchoActor(FleetActor):
    kind = "echo"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.handle(Echo, self._echo)
        self.handle(Block, self._block)
        self.handle(Refuse, self._refuse)
        self.handle(Crash, lambda m: None)
        self.handle(Renew, lambda m: m.reply.set_result("renewed"))

    def _echo(self, m: Echo) -> None:
        assert m.reply is not None
        m.reply.set_result(m.value)

    def _block(self, m: Block) -> None:
        m.gate.wait(30)
        assert m.reply is not None
        m.reply.set_result("released")

    def _refuse(self, m: Refuse) -> None:
        raise NotFound("no such thing")


def _ctx() -> Context:
    loop = asyncio.get_running_loop()
    repo = Repository(None)  # type: ignore[arg-type]  # never used by these actors
    return Context(repo=repo, bridge=Bridge(loop), clock=ManualClock())


async def ask(ref: pykka.ActorRef[Any], make: Any, timeout: float = 5.0) -> Any:
    reply: Reply[Any] = Reply()
    ref.tell(make(reply))
    return await reply.wait(timeout)


async def test_bridge_run_returns_a_coroutine_result_to_an_actor_thread() -> None:
    bridge = Bridge(asyncio.get_running_loop())

    async def add(a: int, b: int) -> int:
        await asyncio.sleep(0)
        return a + b

    result = await asyncio.get_running_loop().run_in_executor(
        None, lambda: bridge.run(add(2, 3), 5)
    )
    assert result == 5


async def test_bridge_run_on_the_loop_thread_refuses_instead_of_deadlocking() -> None:
    bridge = Bridge(asyncio.get_running_loop())

    async def nothing() -> None:
        return None

    with pytest.raises(RuntimeError, match="deadlock"):
        bridge.run(nothing(), 1)


async def test_bridge_run_past_its_timeout_is_unavailable_and_cancels_the_coroutine() -> None:
    bridge = Bridge(asyncio.get_running_loop())
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(Unavailable) as info:
        await asyncio.get_running_loop().run_in_executor(None, lambda: bridge.run(forever(), 0.05))
    assert info.value.retryable
    await asyncio.wait_for(cancelled.wait(), 5)


async def test_a_reply_completed_from_another_thread_wakes_its_waiter() -> None:
    reply: Reply[str] = Reply()
    threading.Thread(target=reply.set_result, args=("hello",)).start()
    assert await reply.wait(5) == "hello"


async def test_only_the_first_completion_of_a_reply_counts() -> None:
    reply: Reply[str] = Reply()
    reply.set_result("first")
    reply.set_exception(RuntimeError("second"))
    assert await reply.wait(5) == "first"


async def test_a_reply_that_never_comes_is_unavailable_not_a_hang() -> None:
    reply: Reply[str] = Reply()
    with pytest.raises(Unavailable):
        await reply.wait(0.05)
    reply.set_result("late")  # a late answer is ignored, not an error


async def test_an_actor_answers_through_a_reply() -> None:
    ref = EchoActor.start(_ctx())
    assert await ask(ref, lambda r: Echo(reply=r, value=42)) == 42


async def test_a_typed_repository_error_is_the_reply_and_the_actor_keeps_serving() -> None:
    ref = EchoActor.start(_ctx())
    with pytest.raises(NotFound):
        await ask(ref, lambda r: Refuse(reply=r))
    assert ref.is_alive()
    assert await ask(ref, lambda r: Echo(reply=r, value=1)) == 1


async def test_messages_of_the_wrong_shape_never_crash_an_actor() -> None:
    ref = EchoActor.start(_ctx())
    ref.tell("not a message at all")
    ref.tell({"verb": "renew"})
    ref.tell(None)
    with pytest.raises(Invalid) as info:
        await ask(
            ref,
            lambda r: Renew(
                reply=r,
                session=Session(host_id="h", generation=1),
                task_id="nope",
                attempt=1,
                lease_token="t",
            ),
        )
    assert info.value.field == "task_id"
    with pytest.raises(Invalid) as info:
        await ask(
            ref,
            lambda r: Renew(
                reply=r,
                session="h1",  # type: ignore[arg-type]
                task_id="0b0e5c52-9a2e-4f58-a7a3-0e0f1b8e2d6a",
                attempt=1,
                lease_token="t",
            ),
        )
    assert info.value.field == "session"
    with pytest.raises(Invalid) as info:
        await ask(
            ref,
            lambda r: Renew(
                reply=r,
                session=Session(host_id="h", generation=1),
                task_id="0b0e5c52-9a2e-4f58-a7a3-0e0f1b8e2d6a",
                attempt=True,
                lease_token="t",
            ),
        )
    assert info.value.field == "attempt"
    # A message type this actor does not handle.
    from fleetlease.actors.messages import Tick

    with pytest.raises(Invalid):
        await ask(ref, lambda r: Tick(reply=r))
    assert ref.is_alive()
    assert await ask(ref, lambda r: Echo(reply=r, value="still here")) == "still here"


async def test_a_crash_answers_the_crashing_and_the_queued_messages_with_unavailable() -> None:
    ref = EchoActor.start(_ctx())
    gate = threading.Event()
    blocked: Reply[Any] = Reply()
    crash: Reply[Any] = Reply()
    queued: Reply[Any] = Reply()
    ref.tell(Block(reply=blocked, gate=gate))
    ref.tell(Crash(reply=crash))
    ref.tell(Echo(reply=queued, value="never"))
    gate.set()
    assert await blocked.wait(5) == "released"
    with pytest.raises(Unavailable):
        await crash.wait(5)
    with pytest.raises(Unavailable):
        await queued.wait(5)
    await wait_until(lambda: not ref.is_alive(), what="the actor to die")


async def test_a_message_to_a_dead_actor_is_a_retryable_error_not_a_hang() -> None:
    ref = EchoActor.start(_ctx())
    await asyncio.get_running_loop().run_in_executor(None, ref.stop)
    with pytest.raises(pykka.ActorDeadError):
        ref.tell(Echo(value=1))
    # What the facade does with it:
    from fleetlease.actors.runtime import ControlPlane

    cp = ControlPlane.__new__(ControlPlane)
    cp._loop = asyncio.get_running_loop()
    cp.ask_timeout_s = 5.0
    with pytest.raises(Unavailable) as info:
        await cp._ask(ref, lambda r: Echo(reply=r, value=1))
    assert info.value.retryable


async def test_the_loop_stays_responsive_while_a_thousand_asks_are_in_flight() -> None:
    ctx = _ctx()
    actors = [EchoActor.start(ctx) for _ in range(100)]
    gate = threading.Event()
    replies: list[Reply[Any]] = []
    for i in range(1000):
        r: Reply[Any] = Reply()
        actors[i % 100].tell(Block(reply=r, gate=gate))
        replies.append(r)
    # While every ask is parked in an actor, small coroutines keep completing.
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        for _ in range(100):
            await asyncio.sleep(0)
            ticks += 1

    await asyncio.wait_for(asyncio.gather(*(heartbeat() for _ in range(20))), 10)
    assert ticks == 2000
    assert not any(r.done() for r in replies)
    gate.set()
    results = await asyncio.wait_for(asyncio.gather(*(r.wait(30) for r in replies)), 60)
    assert results == ["released"] * 1000
