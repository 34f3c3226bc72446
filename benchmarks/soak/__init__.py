"""``broker-lookup soak``: mixed traffic against real rank processes while things break."""
