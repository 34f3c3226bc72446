"""``python -m benchmarks.soak``: mixed traffic against real rank processes while things break."""
