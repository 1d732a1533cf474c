"""What a sender chooses reaches the control plane's log only clipped: a refused
request with a huge argument name, message type or subject adds a few hundred
bytes to the log, not the size of what was sent; and ``up``'s log file is
rotated by size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import nats
import structlog
from structlog.testing import capture_logs

from fleetlease.ops.logging import configure_file_logging, configure_logging
from fleetlease.transport import wire
from fleetlease.transport.clip import MAX_NAME_CHARS, clip
from fleetlease.transport.subjects import Subjects
from tests.inbox import request as principal_request
from tests.integration import test_ops_cli
from tests.integration.test_ops_cli import System

system = test_ops_cli.system

#: What one refused request may add to the log, rendered (generous: a few
#: clipped fields and the event's own).
PER_REQUEST_LOG_BYTES = 4096
HUGE = 400 * 1024


def _rendered(events: list[dict[str, Any]]) -> int:
    return sum(len(json.dumps(e, default=str)) for e in events)


async def _ask(nc: Any, s: System, subject: str, data: bytes) -> wire.Message:
    reply = await principal_request(nc, Subjects(s.prefix), subject, data)
    return wire.decode(reply.data).msg


async def test_a_huge_unknown_argument_name_is_logged_and_answered_clipped(system: System) -> None:
    nc = await nats.connect(system.nats_url)
    subject = Subjects(system.prefix).ops("admin", "tasks")
    try:
        with capture_logs() as logs:
            for i in range(5):
                req = wire.OpsRequest(
                    token=system.admin_token, verb="tasks", args={f"{i}" + "x" * HUGE: 1}
                )
                answer = await _ask(nc, system, subject, wire.encode(req))
                assert isinstance(answer, wire.Error) and answer.code == "bad_request"
                assert len(answer.message) < 2 * MAX_NAME_CHARS
                assert answer.message.startswith(f"unknown argument '{i}xxx")
                assert answer.message.endswith("…'")
    finally:
        await nc.close()

    refused = [e for e in logs if e["event"] == "request_refused"]
    assert len(refused) == 5
    print(f"\n5 requests with a {HUGE}-character argument name: {_rendered(logs)} bytes logged")
    assert _rendered(logs) < 5 * PER_REQUEST_LOG_BYTES


async def test_a_huge_message_type_or_verb_on_a_host_subject_is_logged_clipped(
    system: System,
) -> None:
    subjects = Subjects(system.prefix)
    heartbeat = subjects.heartbeat("h1")
    huge_type = msgpack.packb({"v": 1, "t": "t" * HUGE, "b": msgpack.packb({})})
    long_verb = f"{subjects.prefix}.host.h1.jobs.{'v' * 3000}"
    nc = await nats.connect(system.nats_url)
    try:
        with capture_logs() as logs:
            answer = await _ask(nc, system, heartbeat, huge_type)
            assert isinstance(answer, wire.Error) and answer.code == "bad_request"
            answer = await _ask(nc, system, long_verb, wire.encode(wire.Heartbeat()))
            assert isinstance(answer, wire.Error) and answer.code == "bad_request"
    finally:
        await nc.close()

    refused = [e for e in logs if e["event"] == "request_refused"]
    assert len(refused) == 2
    assert all(len(e["error"]) <= 1024 and len(e["subject"]) <= 256 for e in refused)
    print(f"\na {HUGE}-character type and a 3,000-character verb: {_rendered(logs)} bytes logged")
    assert _rendered(logs) < 2 * PER_REQUEST_LOG_BYTES


def test_clip_keeps_short_text_and_cuts_long_text_with_an_ellipsis() -> None:
    assert clip("name") == "name"
    assert clip("x" * 128) == "x" * 128
    assert clip("x" * 129) == "x" * 127 + "…"
    assert clip(b"\x00" * 1000, 10) == "b'\\x00\\x0…"
    assert len(clip(12345678901234567890, 8)) == 8


def test_a_log_file_is_rotated_by_size_and_old_files_are_bounded(tmp_path: Path) -> None:
    path = tmp_path / "up.log"
    handler = configure_file_logging(path, max_bytes=4096, backups=2)
    try:
        log = structlog.get_logger("fleetlease.test")
        for i in range(500):
            log.info("request_refused", n=i, error="e" * 100)
    finally:
        configure_logging()
        handler.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["up.log", "up.log.1", "up.log.2"]
    assert all((tmp_path / f).stat().st_size <= 4096 for f in files)
    # Each line is one whole JSON event; the newest is in up.log.
    last = path.read_text().splitlines()[-1]
    assert json.loads(last)["n"] == 499
