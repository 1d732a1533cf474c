"""The operator surface: the ``fleetlease`` command line (``cli``, ``commands``),
the user API (``userapi``) and its NATS client (``client``), the web console
(``web``), metrics and health (``observe``), and process management (``system``,
``service``, ``embedded``). Benchmark and fault tooling live apart, in ``bench``
and ``testing``. Nothing here is a library surface: the entry point is
``fleetlease.ops.cli:main``."""
