"""Interpreter settings of the long-running processes (``serve``, ``agent``,
``up``), applied once, after start-up and before their event loop runs.

Garbage collection. CPython's cyclic collector, on its default thresholds
(700, 10, 10), walked every live object of ``serve`` each time its old
generation grew by a quarter. With 10,000 leases held (``fleetlease bench``'s
renewal cell) each full collection stopped the process for 55-440 ms: 23 of
them in one cell, 4.9 s of CPU, and the paced renewals' round-trip p99 was
135-165 ms. So:

* what start-up made (modules, settings: never garbage) is moved out of the
  collector's view (``gc.freeze``): no collection walks it again;
* the young generation is collected every 10,000 net allocations instead of
  700, the older ones as rarely relative to it: cyclic garbage of a host
  message lives a little longer, and a young collection costs about 2 ms
  instead of 0.2-0.4, a thirty-fifth as often.

Same cell with these settings: 118 young, 5 middle and 2 full collections
besides the one here (1.3 s of CPU in all), round-trip p99 104 ms. The one
long pause left was the full collection when the 10,000 leases ended together
(0.47 s): each finished Lease actor was left in a reference cycle, which
``FleetActor`` now breaks when it stops. Reference counting frees everything
that is not in a cycle at once, whatever these settings.

Thread switches. ``serve`` runs its event loop on one thread and each actor on
its own; a message from the loop to a Lease actor and its answer back are
thread hand-offs, and a thread that wakes while another runs Python waits for
the interpreter lock up to the switch interval (5 ms by default) on each. At
0.5 ms, with 60 tasks/s paced one by one, the hand-off of a claim to its Lease
actor took p90 3.2-3.7 / p99 6.5-8.1 ms, against 4.7-6.5 / 11.4-17.3 ms at
5 ms, with no measurable change in CPU per task.
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
