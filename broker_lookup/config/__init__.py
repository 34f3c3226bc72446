"""Configuration: typed, validated structs (``model``), where they come from (``sources``, ``env``),
and the Redis URL's schemes (``urls``)."""

from broker_lookup.config.env import ENV_PREFIX, env_name
from broker_lookup.config.model import LookupConfig, LookupMetadata, expected_ranks
from broker_lookup.config.urls import Scheme, redact_url, url_scheme

__all__ = [
    "ENV_PREFIX",
    "LookupConfig",
    "LookupMetadata",
    "Scheme",
    "env_name",
    "expected_ranks",
    "redact_url",
    "url_scheme",
]
