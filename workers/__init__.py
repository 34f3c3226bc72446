"""Worker side of broker-lookup: the lookup server, the reference engine, the rank runner."""
