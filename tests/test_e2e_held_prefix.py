"""Ship nothing twice through the real cluster with the reference decode engine: the decode actor
keeps a request's prefix KV (``decode_prefix_cache_bytes``) and tells the router at ``expect`` how
much of the next prefix it holds under the request's salt; holding the whole of what a prefill
worker would load (``RequestPlan.forward_from``), it computes the rest itself and nothing is built
or sent. Another tenant's identical text is a different salt: everything travels again."""
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import api_key, direct_text, get_engine, metric

pytestmark = pytest.mark.slow

PRICES = " ".join(f"Item {i} costs {i * 7 % 100} dollars." for i in range(120))    # ~1k tokens
QUESTION = "What does item 3 cost?"


@pytest.fixture(scope="module")
def held_cluster(default_cluster):
    """Two tenants' clients with the same skill registered, on the kept default cluster
    (tests/conftest.py). The second tenant's key is
    created through the CLI once per cluster (its state directory)."""
    cfg, _ = default_cluster
    root = Path(cfg.state.data_dir)
    if root not in _SECOND_KEY:
        (root / "c.json").write_text(json.dumps({"data_dir": str(root)}))
        out = subprocess.run([sys.executable, "-m", "cluster.operator.cli", "keys", "create", "--tenant", "globex",
                              "--config", str(root / "c.json")], capture_output=True, text=True, timeout=120, check=True)
        _SECOND_KEY[root] = out.stdout.strip().splitlines()[-1]
    base = f"http://127.0.0.1:{cfg.server.port}"
    clients = [httpx.Client(base_url=base, timeout=300, headers={"authorization": f"Bearer {key}"})
               for key in (api_key(cfg), _SECOND_KEY[root])]
    try:
        for c in clients:                              # the same text, registered by each tenant
            r = c.post("/v1/skills", json={"name": "prices", "text": PRICES})
            assert r.status_code == 201, r.text
        yield clients
    finally:
        for c in clients:
            c.close()


_SECOND_KEY: dict = {}          # state directory -> the second tenant's key


def _sent(http) -> float:
    return metric(http.get("/metrics").text, "kvnotes_kv_transfer_bytes_total")


def test_a_repeated_composed_prefix_is_not_sent_twice_by_the_reference_engine(held_cluster):
    acme, globex = held_cluster
    e = get_engine("smollm2-135m")
    ids = (e.encode(e.spec.chat_user_prefix) + e.encode(PRICES.strip() + "\n\n")
           + e.encode(QUESTION + e.spec.chat_user_suffix))
    oracle = direct_text(ids, 8)
    exact = {"segments": [{"skill": "prices"}, {"text": QUESTION}], "max_tokens": 8, "temperature": 0,
             "kv_policy": "exact", "explain": True}
    b0 = _sent(acme)
    first = acme.post("/v1/notes/completions", json=exact).json()
    b1 = _sent(acme)
    second = acme.post("/v1/notes/completions", json=exact).json()
    b2 = _sent(acme)
    assert first["text"] == second["text"] == oracle, (first, second)
    assert b1 - b0 > 0 and b2 == b1, (b0, b1, b2)                            # nothing built or sent again
    assert second["explain"]["transport"] == "" and "transfer" not in second["explain"]["stages"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - len(e.encode(QUESTION + e.spec.chat_user_suffix))

    # a composed (repositioned) prefix: its own salt (another recipe), then held on the repeat
    # (text before the skill: first after the frame it would be exact reuse, the exact plan again)
    fast = {**exact, "kv_policy": "fast", "segments": [{"text": "Price list follows.\n"}, *exact["segments"]]}
    f1 = acme.post("/v1/notes/completions", json=fast).json()
    b3 = _sent(acme)
    f2 = acme.post("/v1/notes/completions", json=fast).json()
    b4 = _sent(acme)
    assert f1["plan"] == "reposition" and f2["plan"] == "reuse" and f2["text"] == f1["text"], (f1, f2)   # held whole
    assert b3 - b2 > (b1 - b0) / 2 and b4 == b3, (b2, b3, b4)

    # globex sends the same text: another tenant's salt, nothing of acme's held KV is used
    g = globex.post("/v1/notes/completions", json=exact).json()
    b5 = _sent(acme)
    assert g["text"] == oracle and b5 - b4 > (b1 - b0) / 2, (b4, b5)
    assert metric(acme.get("/metrics").text, "kvnotes_fallbacks_total") == 0
