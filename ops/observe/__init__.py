"""Observability of ``serve`` and ``agent``: Prometheus metrics, ``/healthz`` and
``/readyz`` on one HTTP listener (``--metrics HOST:PORT``).

* ``metrics``: the process-wide metrics the control plane updates as events
  happen (counters and histograms, one cheap call where the event already is).
* ``collectors``: what is read at scrape time (tasks, hosts and devices from the
  database in one bounded query; the actor system's gauges; an agent's state).
* ``health``: the readiness checks.
* ``looplag``: the event loop's lag, probed on the loop.
* ``http``: the listener serving ``/metrics``, ``/healthz`` and ``/readyz``.

``docs/operations.md`` lists every metric with its labels.
"""
