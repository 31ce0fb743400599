"""The background-yield settings (store-behind and recurring compiles let requests go first) are
config keys of the ``policy`` section, checked where they are read; so is what a full store-behind queue does."""
import pytest

from cluster.control.backends import YieldConfig
from kvruntime.config.cluster import ClusterConfig


def test_background_yield_keys_are_read_from_the_policy_section():
    cfg = ClusterConfig.from_dict({"policy": {"background_quiet_s": 0, "background_max_wait_s": 5}})
    assert (cfg.policy.background_quiet_s, cfg.policy.background_max_wait_s) == (0, 5)
    assert YieldConfig(cfg.policy.background_quiet_s, cfg.policy.background_max_wait_s).quiet_s == 0   # 0: off
    assert ClusterConfig.from_dict({}).policy.background_quiet_s == YieldConfig().quiet_s     # one default


@pytest.mark.parametrize("key", ["background_quiet_s", "background_max_wait_s"])
def test_a_negative_background_wait_is_refused_with_its_name(key):
    with pytest.raises(ValueError, match="background_quiet_s and background_max_wait_s must be >= 0"):
        ClusterConfig.from_dict({"policy": {key: -1}})


def test_store_behind_when_full_is_read_and_checked():
    assert ClusterConfig.from_dict({"policy": {"store_behind_when_full": "skip"}}).policy.store_behind_when_full == "skip"
    assert ClusterConfig.from_dict({}).policy.store_behind_when_full == "displace"
    with pytest.raises(ValueError, match="store_behind_when_full must be displace or skip"):
        ClusterConfig.from_dict({"policy": {"store_behind_when_full": "drop"}})
