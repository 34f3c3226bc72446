"""A reference router in front of vLLM replicas, run from a checkout: ``python -m router``."""
