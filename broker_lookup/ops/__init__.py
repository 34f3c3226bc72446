"""The operator's surface: ``inspect``, ``doctor``, Prometheus metrics, the exporter, the
HTTP endpoint a rank and the exporter serve, ACL users (the ``broker-lookup`` command that
runs them is :mod:`broker_lookup.cli`, above this package)."""
