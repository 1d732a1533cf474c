"""The interpreter settings of the long-running processes (``ops.interpreter``),
checked in a fresh interpreter so this test process keeps its own."""

from __future__ import annotations

import json
import subprocess
import sys

from fleetlease.ops.interpreter import GC_THRESHOLDS, SWITCH_INTERVAL_S

_PROBE = """
import gc, json, sys
def seen():
    return {
        "threshold": gc.get_threshold(),
        "frozen": gc.get_freeze_count(),
        "switch": sys.getswitchinterval(),
    }
before = seen()
from fleetlease.ops import interpreter
interpreter.tune()
after = seen()
print(json.dumps({"before": before, "after": after}))
"""


def test_tune_freezes_start_up_raises_collection_thresholds_and_shortens_thread_switches() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=60
    )
    seen = json.loads(out.stdout)

    assert seen["before"]["frozen"] == 0
    assert tuple(seen["before"]["threshold"]) != GC_THRESHOLDS
    assert seen["after"]["frozen"] > 1000  # the modules' objects, at least
    assert tuple(seen["after"]["threshold"]) == GC_THRESHOLDS
    assert seen["before"]["switch"] != SWITCH_INTERVAL_S
    assert seen["after"]["switch"] == SWITCH_INTERVAL_S
