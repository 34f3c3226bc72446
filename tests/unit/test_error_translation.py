"""Which of our errors a Redis error becomes: the loops act on the kind, not on the text."""

from __future__ import annotations

import pytest
from redis import exceptions as rexc

from broker_lookup.errors import BrokerResponseError, NoGroup, translated


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
