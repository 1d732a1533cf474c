"""Which event loop the long-running commands run on."""

from __future__ import annotations

import asyncio

import pytest

from fleetlease.ops import eventloop


async def _which() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def test_auto_and_uvloop_run_on_uvloop_when_it_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("uvloop")
    for choice in ("auto", "uvloop", "", " UVLOOP "):
        monkeypatch.setenv(eventloop.ENV, choice)
        assert eventloop.loop_name() == "uvloop"
        assert eventloop.run(_which()) == "uvloop"


def test_asyncio_runs_on_the_standard_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.ENV, "asyncio")
    assert eventloop.loop_name() == "asyncio"
    assert eventloop.run(_which()) == "asyncio"


def test_an_unknown_choice_is_refused_and_nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.ENV, "tokio")
    ran = []

    async def main() -> None:
        ran.append(1)

    with pytest.raises(eventloop.EventLoopError, match="FLEETLEASE_EVENT_LOOP"):
        eventloop.run(main())
    assert ran == []
