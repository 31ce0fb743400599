"""The default policy composes on both shipped models, through the real cluster (Ray actors, Serve,
HTTP): a registered skill right after the chat frame is exact reuse of its variant compiled after
the frame, so its KV comes from the tier, and the answer is a recompute's, token for token."""
from __future__ import annotations

import pytest

from tests.conftest import cluster_port, direct_text, get_engine, http_client

SKILL = ("Returns policy of the Harbor Lane shop: unworn items may be returned within 30 days with a "
         "receipt; sale items are final; refunds go back to the original card within 5 business days.")


KEEPS = ("default_cluster",)            # SmolLM2's cluster is the default one (tests/conftest.py), kept


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def model_cluster(request, tmp_path_factory, local_ray):
    from kvruntime.config import ClusterConfig
    from tests.conftest import _default_cluster, kept, release_kept
    from tests.conftest import start_cluster as start, stop_cluster as stop   # the shared local Ray

    if request.param == "smollm2-135m":     # the default config: the cluster test_e2e_cluster used
        _, client = kept("default_cluster", lambda: _default_cluster(tmp_path_factory))
        r = client.post("/v1/skills", json={"name": "returns", "text": SKILL})
        assert r.status_code == 201, r.text
        yield request.param, client
        return
    release_kept("default_cluster")         # one cluster per Ray: the kept one goes first
    cfg = ClusterConfig.of(model=request.param, port=cluster_port(), tier_cpu_bytes=256 << 20,
                        data_dir=str(tmp_path_factory.mktemp("state")))
    start(cfg, local_cpus=4)
    client = http_client(cfg)
    try:
        assert client.get("/health").json()["status"] == "ok"
        r = client.post("/v1/skills", json={"name": "returns", "text": SKILL})
        assert r.status_code == 201, r.text
        yield request.param, client
    finally:
        client.close()
        stop(cfg)


def _ask(client, question: str) -> dict:
    r = client.post("/v1/notes/completions", json={"segments": [{"skill": "returns"}, {"text": question}],
                                                    "max_tokens": 12, "temperature": 0, "explain": True})
    assert r.status_code == 200, r.text
    return r.json()


def _oracle_ids(e, question: str) -> list[int]:
    """The prompt ids the cluster renders (the model's real Renderer: frame, chunk, question + turn close)."""
    from cluster.control.render import Renderer
    r = Renderer(e.tokenizer, e.spec, None, e.bos_id)
    return list(r.frame()) + list(r.chunk_ids(SKILL)) + r.user_then_markup(question, e.spec.chat_user_suffix)


def test_the_default_policy_composes_the_first_skill_exactly_on_both_models(model_cluster):
    model, client = model_cluster
    e = get_engine(model)
    skill_ids = e.encode(SKILL.strip() + "\n\n")
    questions = ("Can I return a sale item?", "How long do refunds take?")
    outs = [_ask(client, q) for q in questions]
    for q, out in zip(questions, outs):
        assert out["explain"]["policy"] == "balanced", out["explain"]
        skill = [s for s in out["explain"]["steps"] if s["source"].endswith("skill:returns")]
        # composed: frame + skill are one exact reuse of their variant compiled together (at
        # registration), never recomputed in context
        assert skill and all(s["kind"] == "reuse" for s in skill), out["explain"]["steps"]
        assert any("compiled together: exact" in s["reason"] for s in skill)
        # and exact: the answer is a full recompute's
        ids = _oracle_ids(e, q)
        assert out["usage"]["prompt_tokens"] == len(ids), (len(ids), out["usage"])
        assert out["text"] == direct_text(ids, 12, model), (q, out["text"])
    # the second request found the variant in the tier: none of the skill's tokens computed
    skill = [s for s in outs[1]["explain"]["steps"] if s["source"].endswith("skill:returns")]
    assert sum(s["reused"] for s in skill) >= len(skill_ids)
    assert outs[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(skill_ids)
