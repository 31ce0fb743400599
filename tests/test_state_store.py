"""Contract tests of the state store: SQLite and a real redis-server pass the same tests."""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from cluster.control.state import Registration, StoreLimits, TemplateRecord, open_state


@pytest.fixture(params=["sqlite", "redis", "redis-password"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/state.db"
    return request.getfixturevalue("redis_auth_url" if request.param == "redis-password" else "redis_url")


def reg(name="refund", tenant="acme", kind="skill", ids=(1, 2, 3), t=100.0):
    return Registration(tenant, kind, name, "text " + name, tuple(ids), "ab" * 32, "cd" * 16, t, t)


def test_registrations_round_trip_per_tenant_and_kind(store_url):
    s = open_state(store_url)
    s.put_registration(reg("b"))
    s.put_registration(reg("a"))
    s.put_registration(reg("a", kind="memory", ids=(9,)))
    s.put_registration(reg("a", tenant="globex"))
    assert [r.name for r in s.list_registrations("acme", "skill")] == ["a", "b"]
    assert s.get_registration("acme", "memory", "a").token_ids == (9,)
    assert s.get_registration("acme", "skill", "zz") is None
    assert s.get_registration("globex", "memory", "a") is None
    s.mark_used("acme", "skill", "a", 200.0, in_tier=False)
    r = s.get_registration("acme", "skill", "a")
    assert r.last_used == 200.0 and r.in_tier is False and r.created == 100.0
    s.mark_used("acme", "skill", "a", 300.0, in_tier=None)          # None keeps the last known status
    assert s.get_registration("acme", "skill", "a").in_tier is False
    assert s.delete_registration("acme", "skill", "a") and not s.delete_registration("acme", "skill", "a")
    assert [r.name for r in s.list_registrations("acme", "skill")] == ["b"]
    assert [r.name for r in s.list_registrations("globex", "skill")] == ["a"]
    s.close()


def test_names_with_separators_cannot_collide(store_url):
    s = open_state(store_url)
    s.put_registration(reg("x", tenant="a:b", kind="skill"))
    s.put_registration(reg("b:x", tenant="a", kind="skill"))
    s.put_registration(reg("a/b", tenant='t"]', kind="skill"))
    assert [r.name for r in s.list_registrations("a:b", "skill")] == ["x"]
    assert [r.name for r in s.list_registrations("a", "skill")] == ["b:x"]
    assert s.get_registration('t"]', "skill", "a/b") is not None
    s.close()


def test_templates_replace_and_delete(store_url):
    s = open_state(store_url)
    s.put_template(TemplateRecord("acme", "booking", "Status: {status}", ("status",), (("status", "flight status"),), "v1"))
    s.put_template(TemplateRecord("acme", "booking", "State: {status}", ("status",), (), "v2"))
    t = s.get_template("acme", "booking")
    assert t.text == "State: {status}" and t.version == "v2" and t.fields == ("status",)
    assert s.get_template("globex", "booking") is None
    assert [x.name for x in s.list_templates("acme")] == ["booking"]
    assert s.delete_template("acme", "booking") and s.get_template("acme", "booking") is None
    s.close()


def test_sessions_expire_after_ttl_and_are_bounded_lru(store_url):
    s = open_state(store_url, StoreLimits(session_ttl_s=0.5, session_max=3))
    now = time.time()
    s.put_session("acme", "s1", '{"a": 1}', now)
    assert s.get_session("acme", "s1", now) == '{"a": 1}'
    assert s.get_session("globex", "s1", now) is None
    time.sleep(0.8)
    now = time.time()
    assert s.get_session("acme", "s1", now) is None                    # expired
    s.close()
    s = open_state(store_url, StoreLimits(session_ttl_s=600, session_max=3))   # LRU bound, no expiry
    for i in range(3):
        s.put_session("acme", f"k{i}", str(i), now + i)
    assert s.get_session("acme", "k0", now + 2.5) == "0"                 # k0 is recent again
    s.put_session("acme", "k3", "3", now + 3)
    s.put_session("acme", "k4", "4", now + 4)
    s.expire(now + 4)
    left = {k for k in ("k0", "k1", "k2", "k3", "k4") if s.get_session("acme", k, now + 5) is not None}
    assert left == {"k0", "k3", "k4"}, left
    assert s.sizes(now + 5)["sessions"] == 3
    assert s.delete_session("acme", "k0") and s.get_session("acme", "k0", now + 0.1) is None
    s.close()


def test_prompt_index_bounded_and_per_tenant(store_url):
    s = open_state(store_url, StoreLimits(prompt_ttl_s=60, prompt_max=4))
    now = time.time()
    s.put_prompt_blocks("acme", {"h1": 256, "h2": 512}, now)
    assert s.get_prompt_blocks("acme", ["h1", "h2", "h3"], now) == {"h1": 256, "h2": 512}
    assert s.get_prompt_blocks("globex", ["h1"], now) == {}
    s.put_prompt_blocks("acme", {f"x{i}": i for i in range(4)}, now + 1)
    s.expire(now + 1)
    assert s.sizes(now + 1)["prompt_index"] == 4
    assert s.get_prompt_blocks("acme", ["h1", "h2"], now + 1) == {}    # the oldest went first
    s.close()


def test_decode_held_records_are_per_tenant_bounded_lru_and_expire(store_url):
    s = open_state(store_url, StoreLimits(decode_held_ttl_s=600, decode_held_max=4))
    now = time.time()
    s.put_decode_held("acme", {"decode-0@b1|h1": 64, "decode-0@b1|h2": 128}, now)
    assert s.get_decode_held("acme", ["decode-0@b1|h1", "decode-0@b1|h2", "decode-0@b2|h1"], now) == \
        {"decode-0@b1|h1": 64, "decode-0@b1|h2": 128}                   # another incarnation's key: absent
    assert s.get_decode_held("globex", ["decode-0@b1|h1"], now) == {}
    s.put_decode_held("acme", {f"decode-0@b1|x{i}": i for i in range(4)}, now + 1)
    s.expire(now + 1)
    assert s.sizes(now + 1)["decode_held"] == 4
    assert s.get_decode_held("acme", ["decode-0@b1|h1", "decode-0@b1|h2"], now + 1) == {}   # LRU: the oldest went
    s.close()
    s = open_state(store_url, StoreLimits(decode_held_ttl_s=0.5))
    s.put_decode_held("acme", {"k": 64}, time.time())
    assert s.get_decode_held("acme", ["k"], time.time()) == {"k": 64}
    time.sleep(0.8)
    assert s.get_decode_held("acme", ["k"], time.time()) == {}          # expired
    with pytest.raises(ValueError):
        StoreLimits(decode_held_max=0)
    s.close()


def test_secret_is_created_once_and_shared(store_url):
    a, b = open_state(store_url), open_state(store_url)
    sa = a.secret()
    assert len(sa) == 32 and b.secret() == sa and a.secret() == sa
    a.close(), b.close()


def test_registrations_are_counted_by_tier_state_across_tenants(store_url):
    s = open_state(store_url)
    s.put_registration(reg("a"))
    s.put_registration(reg("b", tenant="globex"))
    s.put_registration(reg("m", kind="memory"))
    assert s.registrations_by_tier() == {("skill", "unknown"): 2, ("memory", "unknown"): 1}
    s.mark_used("acme", "skill", "a", 200.0, True)
    s.mark_used("globex", "skill", "b", 200.0, False)
    assert s.registrations_by_tier() == {("skill", "true"): 1, ("skill", "false"): 1, ("memory", "unknown"): 1}
    s.close()


def test_metrics_targets_are_shared_refreshed_and_expire(store_url):
    a, b = open_state(store_url), open_state(store_url)
    a.put_target("router-r1", "10.0.0.5:41000", 100.0)
    b.put_target("router-r2", "10.0.0.6:41001", 105.0)
    assert a.targets(106.0, 30.0) == b.targets(106.0, 30.0) == {"router-r1": "10.0.0.5:41000",
                                                                "router-r2": "10.0.0.6:41001"}
    a.put_target("router-r1", "10.0.0.5:42000", 120.0)        # restarted on another port: replaced
    assert b.targets(140.0, 30.0) == {"router-r1": "10.0.0.5:42000"}   # r2 last seen 35 s ago: dropped
    assert a.targets(200.0, 30.0) == {}
    a.close(), b.close()


def _writer(url: str, tenant: str, n: int) -> None:
    s = open_state(url)
    for i in range(n):
        s.put_registration(reg(f"r{i}", tenant=tenant))
        s.put_session(tenant, f"s{i}", "{}", time.time())
    s.close()


def test_several_processes_write_at_once(store_url):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(store_url, f"t{j}", 40)) for j in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    s = open_state(store_url)
    assert all(len(s.list_registrations(f"t{j}", "skill")) == 40 for j in range(3))
    assert s.sizes(time.time())["sessions"] == 120
    s.close()


def test_bad_urls_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="sqlite:///, redis:// or rediss://"):
        open_state("postgres://x")
    with pytest.raises(ConnectionError, match="does not answer"):
        open_state("redis://127.0.0.1:1/0")


def test_api_keys_are_stored_by_hash_listed_and_revoked(store_url):
    from cluster.http.auth import Authenticator, create_key, hash_key
    from cluster.control.errors import RequestError

    s = open_state(store_url)
    key_a, rec_a = create_key(s, "acme")
    key_b, rec_b = create_key(s, "globex")
    assert key_a != key_b and key_a.startswith("kvn-")
    assert s.api_key(hash_key(key_a)).tenant == "acme" and s.api_key(hash_key(key_b)).tenant == "globex"
    assert [(r.key_id, r.tenant) for r in s.list_api_keys()] == [(rec_a.key_id, "acme"), (rec_b.key_id, "globex")]
    dump = repr([vars(r) for r in s.list_api_keys()])
    assert key_a not in dump and key_a[4:] not in dump                     # only the hash is kept
    auth = Authenticator(s, enabled=True, default_tenant="default", trusted_proxies=("10.0.0.7",))
    assert auth.tenant({"authorization": f"Bearer {key_a}"}, "127.0.0.1") == "acme"
    # the tenant header is ignored from an untrusted address, honoured from the trusted proxy
    assert auth.tenant({"authorization": f"Bearer {key_a}", "x-kvnotes-tenant": "globex"}, "127.0.0.1") == "acme"
    assert auth.tenant({"authorization": f"Bearer {key_a}", "x-kvnotes-tenant": "team-3"}, "10.0.0.7") == "team-3"
    for headers, host in (({}, "127.0.0.1"), ({"authorization": "Bearer nope"}, "127.0.0.1"),
                          ({"authorization": key_a}, "127.0.0.1"), ({"x-kvnotes-tenant": "acme"}, "10.0.0.7")):
        with pytest.raises(RequestError) as e:
            auth.tenant(headers, host)
        assert e.value.status == 401
    with pytest.raises(RequestError) as e:
        auth.tenant({"authorization": f"Bearer {key_a}", "x-kvnotes-tenant": "a" * 65}, "10.0.0.7")
    assert e.value.status == 400
    assert s.revoke_api_key(rec_a.key_id) and not s.revoke_api_key(rec_a.key_id)
    with pytest.raises(RequestError):
        auth.tenant({"authorization": f"Bearer {key_a}"}, "127.0.0.1")
    assert [r.tenant for r in s.list_api_keys()] == ["globex"]
    s.close()


def test_embedded_default_key_is_created_once_and_private(tmp_path):
    import stat

    from cluster.http.auth import ensure_default_key

    s = open_state(f"sqlite:///{tmp_path}/state.db")
    path = tmp_path / "api_key"
    key = ensure_default_key(s, "default", path)
    assert path.read_text().strip() == key and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_default_key(s, "default", path) == key and len(s.list_api_keys()) == 1   # not re-created
    path.unlink()
    assert ensure_default_key(s, "default", path) is None                 # keys exist: none is invented
    s.close()


def test_auth_off_only_on_loopback():
    from kvruntime.config import ClusterConfig

    assert not ClusterConfig.of(auth=False, host="127.0.0.1").server.auth
    assert ClusterConfig.from_dict({"trusted_proxies": ["10.0.0.7"]}).server.trusted_proxies == ("10.0.0.7",)
    with pytest.raises(ValueError, match="loopback"):
        ClusterConfig.of(auth=False, host="0.0.0.0")
    with pytest.raises(ValueError, match="max_"):
        ClusterConfig.of(max_body_bytes=0)


def test_keys_cli_create_list_revoke(tmp_path, capsys):
    import json as _json

    from cluster.operator.cli import main

    cfg = tmp_path / "c.json"
    cfg.write_text(_json.dumps({"data_dir": str(tmp_path)}))
    assert main(["keys", "create", "--tenant", "acme", "--config", str(cfg)]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]           # the key is the last line
    assert key.startswith("kvn-")
    assert main(["keys", "list", "--config", str(cfg)]) == 0
    listed = capsys.readouterr().out
    key_id, tenant = listed.split()[:2]
    assert tenant == "acme" and key not in listed
    assert main(["keys", "create", "--tenant", "no/slash", "--config", str(cfg)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("kvnotes: error: tenant must be")
    assert main(["keys", "revoke", key_id, "--config", str(cfg)]) == 0
    assert main(["keys", "revoke", key_id, "--config", str(cfg)]) == 2
    assert "no key with id" in capsys.readouterr().err
    assert main(["keys", "list", "--config", str(cfg)]) == 0 and capsys.readouterr().out == ""


def test_a_redis_with_a_password_refuses_anonymous_and_wrong_passwords_in_one_redacted_line(redis_auth_url):
    from tests.conftest import REDIS_PASSWORD
    anonymous = "redis://" + redis_auth_url.rpartition("@")[2]
    wrong = redis_auth_url.replace(redis_auth_url.split(":")[2].split("@")[0], "not-it")
    for url in (anonymous, wrong):
        with pytest.raises(ConnectionError) as exc:
            open_state(url)
        msg = str(exc.value)
        assert "refused" in msg and "\n" not in msg and "not-it" not in msg and REDIS_PASSWORD[:6] not in msg, msg
    s = open_state(redis_auth_url)                   # the password, URL-quoted, reaches the server intact
    assert s.secret() == open_state(redis_auth_url).secret()
    s.close()


def test_redact_url_hides_only_the_password():
    from cluster.control.state import redact_url
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("rediss://kvnotes:p%40ss@h:6380/1?ssl_ca_certs=/ca.pem") == \
        "rediss://kvnotes:***@h:6380/1?ssl_ca_certs=/ca.pem"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redact_url("sqlite:////var/x.db") == "sqlite:////var/x.db"
    # every URL form: a query or fragment parameter named like a secret, an '@' in the password, a bad port
    assert redact_url("redis://h:6379/0?password=sekrit&db=1") == "redis://h:6379/0?password=***&db=1"
    assert redact_url("rediss://h/0?ssl_ca_certs=/c.pem&Token=t0k#auth=x") == "rediss://h/0?ssl_ca_certs=/c.pem&Token=***#auth=***"
    assert redact_url("redis://u:a@b@h:1/0") == "redis://u:***@h:1/0"
    assert "pw" not in redact_url("redis://:pw@h:notaport/0")


def test_state_url_takes_a_password_from_the_environment_and_never_shows_it(monkeypatch):
    from kvruntime.config import ClusterConfig
    monkeypatch.setenv("KVN_TEST_REDIS_PASSWORD", "p@ss:w/rd")
    cfg = ClusterConfig.from_dict({"state_url": "rediss://:${KVN_TEST_REDIS_PASSWORD}@redis:6380/0"})
    assert cfg.state.url == "rediss://:p%40ss%3Aw%2Frd@redis:6380/0"
    assert "p%40ss" not in repr(cfg) and "p@ss" not in repr(cfg)
    monkeypatch.delenv("KVN_TEST_REDIS_PASSWORD")
    with pytest.raises(ValueError, match="KVN_TEST_REDIS_PASSWORD is not set"):
        ClusterConfig.from_dict({"state_url": "redis://:${KVN_TEST_REDIS_PASSWORD}@redis:6379/0"})
    assert ClusterConfig.from_dict({"state_url": "redis://:a$b@h:1/0"}).state.url == "redis://:a$b@h:1/0"
    with pytest.raises(ValueError, match="rediss://"):
        ClusterConfig.of(state_url="mysql://x")


def test_cli_against_a_redis_with_a_password(redis_auth_url, tmp_path):
    """`kvnotes keys` works with the password from the environment and exits 2 with one line
    (no traceback, no password) without it; `kvnotes serve` stops at the state store before Ray."""
    import json as _json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import REDIS_PASSWORD
    host = redis_auth_url.rpartition("@")[2]
    good, anon = tmp_path / "good.json", tmp_path / "anon.json"
    good.write_text(_json.dumps({"data_dir": str(tmp_path), "state_url": "redis://:${KVN_PW}@" + host}))
    anon.write_text(_json.dumps({"data_dir": str(tmp_path), "state_url": "redis://" + host}))
    env = {**os.environ, "KVN_PW": REDIS_PASSWORD, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}

    def kvnotes(*args):
        return subprocess.run([sys.executable, "-m", "cluster.operator.cli", *args], capture_output=True, text=True,
                              env=env, timeout=120)
    ok = kvnotes("keys", "create", "--tenant", "acme", "--config", str(good))
    assert ok.returncode == 0 and ok.stdout.strip().splitlines()[-1].startswith("kvn-"), ok.stderr
    for args in (("keys", "list", "--config", str(anon)), ("serve", "--config", str(anon))):
        r = kvnotes(*args)
        err = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(err) == 1 and err[0].startswith("kvnotes: error: state store redis://"), \
            (args, r.stdout, r.stderr)
        assert "refused the credentials" in err[0] and REDIS_PASSWORD not in r.stderr + r.stdout
