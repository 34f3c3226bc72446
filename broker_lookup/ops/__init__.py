"""The operator's surface: the ``broker-lookup`` command, ``inspect`` and Prometheus metrics."""
