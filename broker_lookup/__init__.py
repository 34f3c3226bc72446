"""broker-lookup: Redis-brokered KV-cache lookup coordination for vLLM + LMCache."""
