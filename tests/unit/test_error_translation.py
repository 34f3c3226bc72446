"""Which of our errors a Redis error becomes: the loops act on the kind, not on the text."""

from __future__ import annotations

import pytest
from redis import exceptions as rexc

from broker_lookup.errors import (
    BrokerResponseError,
    BrokerUnavailable,
    NoGroup,
    NoPermission,
    translated,
)


@pytest.mark.parametrize(
    "text",
    [
        "NOGROUP No such key 'bl:{e}:requests' or consumer group 'rank-0'",
        # Redis 7's answer to a blocked XREADGROUP whose stream was deleted or expired:
        # the group is gone with the stream, so the rank must create it again at 0.
        "UNBLOCKED the stream key no longer exists",
    ],
)
def test_a_missing_group_is_nogroup_whatever_the_server_says(text: str) -> None:
    assert isinstance(translated(rexc.ResponseError(text), "reading"), NoGroup)


def test_another_response_error_is_not_nogroup() -> None:
    ours = translated(rexc.ResponseError("WRONGTYPE Operation against a key"), "reading")
    assert isinstance(ours, BrokerResponseError) and not isinstance(ours, NoGroup)


def test_an_acl_denial_is_no_permission_still_a_response_error() -> None:
    ours = translated(rexc.NoPermissionError("No permissions to access a key"), "reading k")
    assert isinstance(ours, NoPermission) and isinstance(ours, BrokerResponseError)
    assert str(ours) == "Redis denied it while reading k: No permissions to access a key"


def test_a_server_that_is_not_redis_is_unavailable_naming_the_url_to_check() -> None:
    ours = translated(rexc.InvalidResponse('Protocol error, got "<" as reply type byte'), "ping")
    assert isinstance(ours, BrokerUnavailable)
    assert "does not speak the Redis protocol" in str(ours) and "redis_url" in str(ours)
