"""Benchmarks of fleetlease: figures, never assertions.

``fleetlease bench`` (:func:`run`, options :class:`BenchOptions`, failure
:class:`BenchError`) measures the whole system beside its calibration; what
each figure means is in ``runner.py``. Its modules, one role each:

- ``runner``: the run, cell by cell, and the report it returns;
- ``options``: the options, the error, what the cells share;
- ``servers``, ``calibration``: the PostgreSQL and NATS servers used, scratch
  databases; pgbench and the NATS round trip;
- ``fleet``: ``fleetlease serve`` as a child process, task events, the timed agent;
- ``throughput``, ``leases``, ``peers``, ``floor``: the cells;
- ``fleetcell`` (``--fleet``, alone) and ``simhosts``, its simulated hosts: a
  whole fleet on one control plane;
- ``measure``: percentiles, waits with deadlines, CPU and commit counters.

Stand-alone benchmarks of one layer, each ``python -m``:
``fleetlease.ops.bench.actors`` (the actor runtime), ``.repository`` (the
repository's transactions) and ``.transport`` (the host protocol over NATS).
"""

from fleetlease.ops.bench.options import BenchError, BenchOptions
from fleetlease.ops.bench.runner import run

__all__ = ["BenchError", "BenchOptions", "run"]
