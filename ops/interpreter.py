"""Interpreter settings of the long-running processes (``serve``, ``agent``,
``up``), applied once, after start-up and before their event loop runs.

* Garbage collection: what start-up made (modules, settings: never garbage) is
  moved out of the collector's view (``gc.freeze``), and the collector runs
  far less often (``GC_THRESHOLDS``). A process holding thousands of leases
  otherwise spends long pauses walking objects that never become garbage.
  Reference counting still frees everything that is not in a cycle at once.
* Thread switches: ``serve`` runs its event loop on one thread and each actor
  on its own, and a hand-off between them waits for the interpreter lock up to
  the switch interval; ``SWITCH_INTERVAL_S`` shortens that wait.

The measurements behind both are in ``docs/performance.md``.
"""

from __future__ import annotations

import gc
import sys

#: ``gc.set_threshold`` of the long-running processes (see the module doc).
GC_THRESHOLDS = (10_000, 20, 100)
#: ``sys.setswitchinterval`` of the long-running processes, seconds.
SWITCH_INTERVAL_S = 0.0005


def tune() -> None:
    """Collect once, freeze the survivors, set ``GC_THRESHOLDS`` and
    ``SWITCH_INTERVAL_S``."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
