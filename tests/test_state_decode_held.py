"""The router's record of what the decode engines' own prefix caches hold lives in the state store
(``cluster.control.decode_held``): on SQLite and a real redis-server, a prompt noted through one
router replica is found through another and after every replica restarted, per tenant; a record
names the decode actor incarnation that ran the prompt, so a restarted actor (a new boot id in
its health answer: its cache is empty) or a dead one gives nothing; a store that does not answer
is a counted miss. The bounds are config keys every process that opens the store applies
(``configured_limits``: the router, the CLI, the launcher, the Ray backends)."""
from __future__ import annotations

import time

import pytest

from cluster.control.decode_held import DecodeHeld
from cluster.control.metrics import Metrics
from cluster.control.routing import WorkerView
from cluster.control.state import StateStoreUnavailable, configured_limits, open_state
from kvruntime.config import ClusterConfig
from tests.conftest import metric


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request, tmp_path):
    return f"sqlite:///{tmp_path}/state.db" if request.param == "sqlite" else request.getfixturevalue("redis_url")


def _view(*boots) -> WorkerView:
    view = WorkerView(1, len(boots))
    for w, boot in zip(view.workers["decode"], boots):
        w.boot = boot
    return view


def test_one_replicas_record_is_anothers_and_survives_a_router_restart(store_url):
    turn0 = list(range(3, 703))
    a, b = open_state(store_url), open_state(store_url)                    # two router replicas
    view = _view("b1", "c1")
    DecodeHeld(a, view).note("acme", turn0, "decode-1@c1")
    seen = DecodeHeld(b, view).lookup("acme", turn0 + [9, 9])
    assert (seen.tokens, seen.engine) == (700, "decode-1@c1") and 700 in seen.ends
    assert DecodeHeld(b, view).longest("globex", turn0) == 0              # another tenant's
    a.close()
    b.close()
    again = open_state(store_url)                                          # every replica restarted
    assert DecodeHeld(again, _view("b1", "c1")).longest("acme", turn0 + [5]) == 700
    again.close()


def test_a_restarted_or_dead_decode_actors_record_is_ignored(store_url):
    turn0 = list(range(3, 703))
    s = open_state(store_url)
    view = _view("b1")
    held = DecodeHeld(s, view)
    held.note("acme", turn0, "decode-0@b1")
    assert held.longest("acme", turn0) == 700
    view.workers["decode"][0].boot = "b2"            # the health monitor saw decode-0 answer with a new boot id
    assert held.longest("acme", turn0) == 0 and held.engines() == ["decode-0@b2"]
    held.note("acme", turn0[:300], "decode-0@b2")    # what the new process ran since
    assert held.longest("acme", turn0) == 300
    view.mark("decode", 0, False, "gone")
    assert held.longest("acme", turn0) == 0 and held.engines() == []
    s.close()


def test_in_process_backends_have_one_local_incarnation_and_an_outage_is_a_counted_miss(tmp_path):
    s, m = open_state(f"sqlite:///{tmp_path}/state.db"), Metrics()
    held = DecodeHeld(s, WorkerView(1, 1), m)                 # no worker reports a boot id
    assert held.engines() == ["local"]
    held.note("acme", list(range(200)))
    assert held.longest("acme", list(range(250))) == 200

    def down(*_):
        raise StateStoreUnavailable("get_decode_held", TimeoutError("no answer"))
    s.get_decode_held = s.put_decode_held = down
    assert held.longest("acme", list(range(250))) == 0
    held.note("acme", list(range(300)))
    assert metric(m.render().decode(), "kvnotes_fallbacks_total", reason="decode_held_unavailable") == 2
    s.close()


def test_the_bounds_are_config_keys_every_opener_applies(tmp_path):
    cfg = ClusterConfig.of(decode_held_ttl_s=60, decode_held_max=3, matching_fingerprint_max=11, prompt_index_max=7)
    limits = configured_limits(cfg)
    assert (limits.decode_held_ttl_s, limits.decode_held_max, limits.fingerprint_max, limits.prompt_max) == (60, 3, 11, 7)
    nested = ClusterConfig.from_dict({"state": {"decode_held_max": 3}}).state
    assert nested.decode_held_max == 3 and ClusterConfig.of().state.decode_held_max == 100_000
    for key, value in (("decode_held_ttl_s", 0), ("decode_held_ttl_s", "1h"), ("decode_held_max", 0),
                       ("decode_held_max", True)):
        with pytest.raises(ValueError, match=key):
            ClusterConfig.of(**{key: value})
    s = open_state(f"sqlite:///{tmp_path}/state.db", limits)
    DecodeHeld(s).note("acme", list(range(640)))              # 10 blocks + an end entry
    s.expire(time.time())
    assert s.sizes(time.time())["decode_held"] == 3
    s.close()


def test_the_cli_launcher_and_ray_backends_open_the_store_with_the_configured_bounds(tmp_path, monkeypatch):
    import argparse

    import cluster.control.state as state_mod
    from cluster.control.ray_backends import tier_key_of
    from cluster.operator import cli, launcher

    opened = []
    real = state_mod.open_state

    def spy(url, limits=None):
        opened.append(limits)
        return real(url, limits)
    monkeypatch.setattr(state_mod, "open_state", spy)
    cfg = ClusterConfig.of(state_url=f"sqlite:///{tmp_path}/state.db", session_max=5, decode_held_max=9,
                           matching_fingerprint_max=13, auth=True, tier_remote_url="lm://127.0.0.1:1")
    launcher.check_state(cfg)
    launcher.ensure_api_key(cfg)
    assert tier_key_of(cfg)
    cfg_file = tmp_path / "kvnotes.yaml"
    cfg_file.write_text(f"state_url: sqlite:///{tmp_path}/state.db\nsession_max: 5\ndecode_held_max: 9\n"
                        "matching_fingerprint_max: 13\n")
    assert cli._keys(argparse.Namespace(config=str(cfg_file), action="list", tenant=None, key_id=None)) == 0
    assert len(opened) == 4 and all(lim == configured_limits(cfg) for lim in opened), opened
    assert (opened[0].session_max, opened[0].decode_held_max, opened[0].fingerprint_max) == (5, 9, 13)
