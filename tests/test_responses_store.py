"""Stored ``/v1/responses`` answers in the state store, SQLite and a real redis-server alike: per
tenant, gone after ``response_ttl_s``, the oldest dropped past ``response_max``, deletable."""
from __future__ import annotations

import pytest

from cluster.control.state import StoreLimits, open_state


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/state.db"
    return request.getfixturevalue("redis_url")


def test_responses_are_per_tenant_expire_and_are_bounded(store_url):
    s = open_state(store_url, StoreLimits(response_ttl_s=100.0, response_max=3))
    s.put_response("acme", "resp_a", '{"id": "resp_a"}', 1000.0)
    assert s.get_response("acme", "resp_a", 1001.0) == '{"id": "resp_a"}'
    assert s.get_response("globex", "resp_a", 1001.0) is None            # another tenant's is not found
    assert s.get_response("acme", "resp_a", 1101.0) is None              # expired after response_ttl_s
    for i in range(4):                                                   # the oldest goes past response_max
        s.put_response("acme", f"resp_{i}", f'"{i}"', 2000.0 + i)
    assert s.get_response("acme", "resp_0", 2010.0) is None
    assert [s.get_response("acme", f"resp_{i}", 2010.0) for i in (1, 2, 3)] == ['"1"', '"2"', '"3"']
    assert s.delete_response("acme", "resp_3") and not s.delete_response("acme", "resp_3")
    assert s.get_response("acme", "resp_3", 2010.0) is None
    assert not s.delete_response("globex", "resp_2") and s.get_response("acme", "resp_2", 2010.0) == '"2"'
    s.close()


def test_response_limits_are_checked():
    with pytest.raises(ValueError, match="response_ttl_s"):
        StoreLimits(response_ttl_s=0)
