"""Configuration: typed, validated structs (``model``) and where they come from (``sources``)."""

from broker_lookup.config.model import (
    LookupConfig,
    LookupMetadata,
    expected_ranks,
    redact_url,
)
from broker_lookup.config.sources import ENV_PREFIX, env_name

__all__ = [
    "ENV_PREFIX",
    "LookupConfig",
    "LookupMetadata",
    "env_name",
    "expected_ranks",
    "redact_url",
]
