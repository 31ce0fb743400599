"""``/v1/completions`` with ``echo`` and ``logprobs`` through the official ``openai`` client on
the embedded default (reference decode engine; ``test_e2e_vllm_echo_logprobs`` runs it on vLLM
decode): the prompt's own log-probs first (its first token's null), equal to a direct forward of
the model; the request a full recompute although the tier holds the prompt, counted; the
completion's log-probs those of the same request without echo; streamed, the first chunk the
prompt with its log-probs; a batch of token-id prompts (lm-evaluation-harness's loglikelihood
request)."""
import pytest

from tests.conftest import metric
from tests.test_prompt_logprobs import direct_logprobs

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
# > 256 tokens: the prompt index stores and would reuse its prefix
PROMPT = "Markets sell fruit and vegetables in every season, and the cooks buy them early. " * 20 + "The best fruit"


@pytest.fixture(scope="module")
def client(default_cluster):
    import openai
    cfg, http = default_cluster
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.server.port}/v1",
                         api_key=http.headers["authorization"].split()[1], max_retries=0, timeout=600), http


def _ids(text):
    import transformers
    from kvruntime.checkpoint import ensure_checkpoint
    from kvruntime.models import get_model_spec
    tok = transformers.AutoTokenizer.from_pretrained(ensure_checkpoint(get_model_spec(MODEL)))
    return tok(text, add_special_tokens=False).input_ids


def check_echo_logprobs(client, http):
    oa = client
    plain = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    ids = _ids(PROMPT)
    n = plain.usage.prompt_tokens
    assert n == len(ids) > 256
    before = metric(http.get("/metrics").text, "kvnotes_reuse_miss_total", reason="prompt_logprobs")
    r = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
                              extra_body={"explain": True})
    c, lp = r.choices[0], r.choices[0].logprobs
    assert c.text == PROMPT + plain.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = direct_logprobs(ids)
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(float(want[i - 1, ids[i]]), abs=2e-3), i
        assert len(lp.top_logprobs[i]) <= 3 and lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]
        best = int(want[i - 1].argmax())
        assert max(lp.top_logprobs[i].values()) == pytest.approx(float(want[i - 1, best]), abs=2e-3)
    assert "".join(lp.tokens[:n]) == PROMPT
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    # the completion's part: the same request's without echo
    assert lp.tokens[n:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    # a full recompute although the tier holds the prompt (the plain request stored it), counted
    assert r.usage.prompt_tokens_details.cached_tokens == 0, r.usage
    assert r.kvnotes["plan"] == "recompute" and r.kvnotes["explain"]["prompt_logprobs"] == 2
    after = metric(http.get("/metrics").text, "kvnotes_reuse_miss_total", reason="prompt_logprobs")
    assert after - before == n - 1
    again = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 256          # the plain request still reuses
    # streamed: the echoed prompt with its log-probs first, then the completion's tokens
    chunks = [ch.choices[0] for ch in oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                                            temperature=0, logprobs=2, echo=True, stream=True)
              if ch.choices]
    assert chunks[0].text == PROMPT and chunks[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n])
    assert chunks[0].logprobs.token_logprobs[0] is None
    streamed = [t for ch in chunks[1:] if ch.logprobs for t in ch.logprobs.tokens]
    assert streamed == lp.tokens[n:] and "".join(ch.text for ch in chunks) == c.text
    offsets = [o for ch in chunks if ch.logprobs for o in ch.logprobs.text_offset]
    assert offsets[:n] == lp.text_offset[:n] and offsets[n] == len(PROMPT)
    # lm-evaluation-harness's loglikelihood request: a batch of token-id prompts, max_tokens 1
    batch = [ids[:40], ids[:25]]
    b = oa.completions.create(model=MODEL, prompt=batch, max_tokens=1, temperature=0, logprobs=1, echo=True)
    for ch, p in zip(b.choices, batch):
        got = ch.logprobs.token_logprobs
        assert got[0] is None and len(got) == len(p) + 1
        assert got[1:len(p)] == pytest.approx([float(want[i - 1, p[i]]) for i in range(1, len(p))], abs=2e-3)


def test_echo_with_logprobs_returns_the_prompts_own(client):
    check_echo_logprobs(*client)
