"""Calibration of a benchmark run: what PostgreSQL (pgbench) and NATS (a
request/reply round trip) do alone on this machine."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from fleetlease.ops.bench.measure import latency_ms
from fleetlease.ops.bench.options import BenchError

_TPS_RE = re.compile(r"tps = ([0-9.]+) \(without initial connection time\)")


async def _run(cmd: list[str], timeout_s: float) -> str:
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise BenchError(f"{Path(cmd[0]).name} did not finish within {timeout_s:.0f} s") from None
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise BenchError(f"{Path(cmd[0]).name} failed ({proc.returncode}): {text[-500:]}")
    return text


async def pgbench_tps(pgbench: str, url: str, seconds: float) -> dict[str, Any]:
    scale = 10
    await _run([pgbench, "-i", "-q", "-s", str(scale), url], 300)
    out: dict[str, Any] = {"scale": scale, "seconds": seconds}
    for clients in (1, 8):
        text = await _run(
            [
                pgbench,
                "-b",
                "simple-update",
                "-c",
                str(clients),
                "-j",
                str(min(clients, 2)),
                "-T",
                str(max(1, round(seconds))),
                url,
            ],
            seconds + 120,
        )
        m = _TPS_RE.search(text) or re.search(r"tps = ([0-9.]+)", text)
        out[f"tps_{clients}"] = round(float(m.group(1)), 1) if m else None
    return out


async def nats_round_trip(nats_url: str, samples: int = 2000) -> dict[str, Any]:
    """Sequential request/reply round trips between two nats-py connections."""
    import nats
    import nats.errors

    server = await nats.connect(nats_url)
    client = await nats.connect(nats_url)
    try:
        subject = f"fl-bench-rtt.{uuid.uuid4().hex}"

        async def reply(msg: Any) -> None:
            await msg.respond(b"")

        await server.subscribe(subject, cb=reply)
        await server.flush()
        # Warm-up. Once in about forty runs the first request found no
        # responder although the subscription was flushed: wait for it.
        warm, deadline = 0, time.monotonic() + 10
        while warm < 50:
            try:
                await client.request(subject, b"x", timeout=5)
                warm += 1
            except nats.errors.NoRespondersError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.01)
        rtt: list[float] = []
        for _ in range(samples):
            t0 = time.perf_counter()
            await client.request(subject, b"x", timeout=5)
            rtt.append(time.perf_counter() - t0)
        return latency_ms(rtt)
    finally:
        await client.close()
        await server.close()
