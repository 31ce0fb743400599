"""The HTTP edge's trust rules without a cluster (issue 45): forwarded headers only from trusted
proxies (and never an address uvicorn could have made from the request's own header), the
client behind them the right-most untrusted hop; ``trusted_proxies`` validated; unknown API keys
answered from a negative cache and rate-limited per address (a real SQLite store, counted); the
open /health view; key files that belong to their state store and are never overwritten;
private files and directories."""
from __future__ import annotations

import asyncio
import stat

import pytest
from prometheus_client import CollectorRegistry
from starlette.requests import Request

from cluster.control.errors import RequestError
from cluster.control.state import open_state
from cluster.http.auth import Authenticator, create_key, ensure_default_key
from cluster.http.forwarded import Forwarding
from cluster.http.health_view import health_body
from kvruntime.config import ClusterConfig
from kvruntime.private_files import looser_than_private, private_file, write_private


def test_forwarded_for_counts_only_from_a_trusted_proxy():
    f = Forwarding(["10.9.8.7", "10.1.0.0/16"])
    assert f.peer_trusted("10.9.8.7") and f.peer_trusted("10.1.2.3", ["203.0.113.5"])
    assert not f.peer_trusted("127.0.0.1", ["10.9.8.7"]) and not f.peer_trusted("10.2.0.1")
    # an address uvicorn could have taken from the request's own header is never trusted
    assert not f.peer_trusted("10.9.8.7", ["10.9.8.7"]) and not f.peer_trusted("10.9.8.7", ["10.9.8.7, 127.0.0.1"])
    # the client: the right-most hop that is not a trusted proxy
    assert f.client("10.9.8.7", ["198.51.100.1, 203.0.113.5, 10.1.4.4"]) == "203.0.113.5"
    assert f.client("127.0.0.1", ["203.0.113.5"]) == "127.0.0.1"            # an untrusted peer is the client
    assert f.client("10.9.8.7", ["not-an-ip"]) == "unknown"
    assert not Forwarding([]).peer_trusted("127.0.0.1")


def test_trusted_proxies_must_be_addresses_or_networks():
    assert ClusterConfig.from_dict({"trusted_proxies": ["10.0.0.0/8", "::1"]}).server.trusted_proxies == ("10.0.0.0/8", "::1")
    for bad in (["nginx"], ["10.0.0.300"], [""]):
        with pytest.raises(ValueError, match="trusted_proxies"):
            ClusterConfig.from_dict({"trusted_proxies": bad})


def _request(headers: dict, peer: str = "127.0.0.1") -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "GET", "path": "/", "headers": raw, "client": (peer, 5555),
                    "query_string": b"", "server": ("127.0.0.1", 8000), "scheme": "http"})


@pytest.fixture
def store(tmp_path):
    s = open_state(f"sqlite:///{tmp_path}/s/state.db")
    yield s
    s.close()


def test_unknown_keys_are_cached_and_rate_limited_per_address(store):
    reg = CollectorRegistry()
    good, _ = create_key(store, "acme")
    auth = Authenticator(store, enabled=True, default_tenant="default", trusted_proxies=("10.9.8.7",),
                         unknown_cache_s=60, unknown_rate_per_s=0.001, unknown_burst=3, registry=reg)
    bogus = "kvn-" + "b" * 43

    def code(key, peer="127.0.0.1", xff=None):
        headers = {"authorization": f"Bearer {key}", **({"x-forwarded-for": xff} if xff else {})}
        try:
            asyncio.run(auth.of_request(_request(headers, peer)))
            return 200
        except RequestError as exc:
            return exc.status

    assert code(bogus) == 401 and code(bogus) == 401                     # the second from the negative cache
    assert reg.get_sample_value("kvnotes_auth_unknown_keys_total", {"outcome": "store"}) == 1
    assert reg.get_sample_value("kvnotes_auth_unknown_keys_total", {"outcome": "cached"}) == 1
    assert [code("kvn-" + c * 43, xff=f"203.0.113.{i}") for i, c in enumerate("cd")] == [401, 401]
    assert code("kvn-" + "e" * 43, xff="203.0.113.9") == 429           # one bucket: the peer's, whatever XFF says
    assert code(good, peer="127.0.0.2") == 200 and code("kvn-" + "f" * 43, peer="127.0.0.2") == 401
    # behind a trusted proxy the client is the forwarded hop: its own bucket
    assert code("kvn-" + "g" * 43, peer="10.9.8.7", xff="198.51.100.7") == 401
    assert reg.get_sample_value("kvnotes_auth_unknown_keys_total", {"outcome": "rate_limited"}) == 1


def test_the_tenant_header_needs_a_trusted_peer(store):
    key, _ = create_key(store, "acme")
    auth = Authenticator(store, enabled=True, default_tenant="default", trusted_proxies=("10.9.8.7",))
    h = {"authorization": f"Bearer {key}", "x-kvnotes-tenant": "victim"}
    assert asyncio.run(auth.of_request(_request(h, "10.9.8.7"))) == "victim"
    assert asyncio.run(auth.of_request(_request({**h, "x-forwarded-for": "10.9.8.7"}, "127.0.0.1"))) == "acme"
    assert asyncio.run(auth.of_request(_request({**h, "x-forwarded-for": "10.9.8.7"}, "10.9.8.7"))) == "acme"


def test_the_open_health_view_names_no_tenant_pid_or_path():
    snap = {"prefill": {"live": 1, "total": 1, "workers": [{"name": "prefill-0", "alive": True, "pid": 4242}]}}
    adm = {"queued": 2, "by_tenant": {"acme": 1, "globex": 1}, "predicted_wait_s": 0.5}
    model = {"name": "m", "id": "m", "checkpoint": "/home/x/ckpt", "profile": "/home/x/p.json", "calibrated": True}
    store = {"up": False, "error": "unable to open /home/x/state.db"}
    open_view = str(health_body("degraded", snap=snap, store=store, admission=adm, model=model, fidelity={}, tenant=None))
    for word in ("acme", "globex", "4242", "/home/x", "prefill-0"):
        assert word not in open_view, word
    mine = health_body("degraded", snap=snap, store=store, admission=adm, model=model, fidelity={}, tenant="acme")
    assert mine["admission"]["by_tenant"] == {"acme": 1} and mine["workers"]["prefill"]["workers"][0]["pid"] == 4242


def test_a_key_file_belongs_to_its_store_and_is_never_overwritten(tmp_path, capsys):
    a = ClusterConfig.of(data_dir=str(tmp_path / "d"))
    b = ClusterConfig.of(data_dir=str(tmp_path / "d"), state_url=f"sqlite:///{tmp_path}/other/state.db")
    assert a.state.api_key_file == tmp_path / "d" / "api_key"
    assert b.state.api_key_file == tmp_path / "other" / "state.db.api_key"               # beside its store
    r1 = ClusterConfig.of(data_dir=str(tmp_path / "d"), state_url="redis://:pw@h1:6379/0").state.api_key_file
    r2 = ClusterConfig.of(data_dir=str(tmp_path / "d"), state_url="redis://:other@h1:6379/1").state.api_key_file
    assert r1 != r2 and "pw" not in str(r1)
    sa, sb = open_state(a.state.resolved_url), open_state(b.state.resolved_url)
    try:
        ka = ensure_default_key(sa, "default", a.state.api_key_file)
        kb = ensure_default_key(sb, "default", b.state.api_key_file)
        assert ka != kb and a.state.api_key_file.read_text().strip() == ka
        # another store pointed at a's key file: the file is not overwritten, no key is invented
        sc = open_state(f"sqlite:///{tmp_path}/third/state.db")
        assert ensure_default_key(sc, "default", a.state.api_key_file) is None and not sc.list_api_keys()
        sc.close()
        assert a.state.api_key_file.read_text().strip() == ka
        from cluster.http.auth import no_key_hint
        hint = no_key_hint(a.state.api_key_file)             # what `kvnotes run` prints then: one line, how to make one
        assert "\n" not in hint and "kvnotes keys create" in hint and "umask 077" in hint
        out = capsys.readouterr().out
        assert "created API key" in out and ka not in out and kb not in out        # the path is printed, never a key
    finally:
        sa.close()
        sb.close()


def test_private_files_and_directories(tmp_path, caplog):
    p = private_file(tmp_path / "new" / "deeper" / "f.db")
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and stat.S_IMODE(p.parent.stat().st_mode) == 0o700
    w = write_private(tmp_path / "new" / "k", "secret\n")
    assert stat.S_IMODE(w.stat().st_mode) == 0o600 and w.read_text() == "secret\n"
    loose = tmp_path / "loose.db"
    loose.write_text("")
    loose.chmod(0o644)
    assert "chmod 600" in looser_than_private(loose)
    with caplog.at_level("WARNING"):
        private_file(loose)                               # kept as it is, warned about
    assert stat.S_IMODE(loose.stat().st_mode) == 0o644 and any("0644" in r.getMessage() for r in caplog.records)
    shared = tmp_path / "shared"                          # a sticky shared directory (/tmp's 1777): no warning
    shared.mkdir()
    shared.chmod(0o1777)
    caplog.clear()
    with caplog.at_level("WARNING"):
        f = private_file(shared / "kv.db")
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and looser_than_private(shared) is None and not caplog.records
    shared.chmod(0o777)                                   # not sticky: others may replace the file
    assert "chmod 700" in looser_than_private(shared)
    s = open_state(f"sqlite:///{tmp_path}/st/state.db")
    s.put_target("x", "y", 0.0)                           # a write: the WAL files exist
    try:
        for name in ("state.db", "state.db-wal", "state.db-shm"):
            assert stat.S_IMODE((tmp_path / "st" / name).stat().st_mode) == 0o600, name
        assert stat.S_IMODE((tmp_path / "st").stat().st_mode) == 0o700
    finally:
        s.close()


def test_a_start_names_every_looser_secret_file(tmp_path):
    from cluster.operator.launcher import check_private_files
    cfg = ClusterConfig.of(data_dir=str(tmp_path / "d"), tier_persist_dir=str(tmp_path / "tier"))
    s = open_state(cfg.state.resolved_url)
    ensure_default_key(s, "default", cfg.state.api_key_file)
    s.close()
    assert check_private_files(cfg) == []                      # as kvnotes made them
    (tmp_path / "d").chmod(0o755)
    cfg.state.api_key_file.chmod(0o644)
    (tmp_path / "tier").mkdir(mode=0o777)
    (tmp_path / "tier").chmod(0o777)
    lines = check_private_files(cfg)
    assert len(lines) == 3 and all("chmod" in line for line in lines), lines
    assert any(str(cfg.state.api_key_file) in line and "0644" in line for line in lines)
