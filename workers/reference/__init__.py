"""The reference engine and its tiered chunk store."""
