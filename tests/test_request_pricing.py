"""Requests priced before they are tokenised (``cluster.control.pricing``): the character bound
is safe with the real tokenizers (a text that fits is never refused by it), tokenisation stops
at the first segment past the window, and against a real cluster 100 oversized valid requests
are each refused with 400 context_length_exceeded while the router replica's memory stays flat."""
from __future__ import annotations

import json
import math
import random
import time

import pytest

from cluster.control.errors import RequestError
from cluster.control.pricing import TokenBudget, max_token_chars
from cluster.control.render import Renderer
from kvruntime.messages.plan import Policy

MODELS = ("smollm2-135m", "gemma3-270m")
_TOKS: dict = {}


def _tok(model: str):
    if model not in _TOKS:
        import transformers

        from kvruntime.checkpoint import ensure_checkpoint
        from kvruntime.models import get_model_spec
        _TOKS[model] = transformers.AutoTokenizer.from_pretrained(ensure_checkpoint(get_model_spec(model)))
    return _TOKS[model]


def _renderer(model: str, registry=None) -> Renderer:
    from kvruntime.models import get_model_spec
    tok = _tok(model)
    return Renderer(tok, get_model_spec(model), registry, tok.bos_token_id)


def _random_text(rng: random.Random, tok, n: int, longest: list[str]) -> str:
    """Text built to stress the bound: the vocabulary's longest pieces (runs of '#', spaces,
    newlines, tabs), words, digits, CJK, emoji, combining marks, Hangul jamo, special-token
    strings, stray surrogate-free control characters."""
    pieces = [lambda: " " * rng.randint(1, 200), lambda: "\n" * rng.randint(1, 100), lambda: "\t" * rng.randint(1, 80),
              lambda: "#" * rng.randint(1, 300), lambda: "=" * rng.randint(1, 120), lambda: "-" * rng.randint(1, 120),
              lambda: rng.choice(["the", "refund", "policy", "Kestrel", "headphones", "electronics"]) + " ",
              lambda: str(rng.randint(0, 10 ** 12)), lambda: "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(5)),
              lambda: "\U0001F600\U0001F680", lambda: "e\u0301a\u0308", lambda: "\u1100\u1161\u11A8",
              lambda: rng.choice(["<|im_start|>", "<|im_end|>", "<start_of_turn>", "<bos>", "<eos>"]),
              lambda: chr(rng.randint(1, 31)), lambda: tok.convert_tokens_to_string([rng.choice(longest)])]
    out: list[str] = []
    while sum(map(len, out)) < n:
        out.append(rng.choice(pieces)())
    return "".join(out)[:n]


@pytest.mark.parametrize("model", MODELS)
def test_the_character_bound_never_exceeds_the_real_token_count(model):
    r = _renderer(model)
    assert r.max_chars is not None and r.max_chars >= 8       # both models' tokenizers keep every character
    rng = random.Random(27)
    longest = sorted(r.tok.get_vocab(), key=len)[-200:]
    for i in range(300):
        text = _random_text(rng, r.tok, rng.choice([1, 7, 60, 500, 3000]), longest)
        if not text:
            continue
        ids = r.encode(text)
        assert len(ids) >= math.ceil(len(text) / r.max_chars), (i, text[:80])
        # and a budget that fits exactly is never refused; one token less is
        TokenBudget(len(ids) + 5, 5, r.max_chars).encode(r.encode, text)
        with pytest.raises(RequestError) as exc:
            TokenBudget(len(ids) + 4, 5, r.max_chars).encode(r.encode, text)
        assert exc.value.code == "context_length_exceeded"


@pytest.mark.parametrize("model", MODELS)
def test_the_longest_piece_repeated_reaches_the_bound(model):
    """The bound is tight: the longest piece, repeated, is exactly max_chars characters per token."""
    r = _renderer(model)
    piece = max(r.tok.get_vocab(), key=len)
    text = r.tok.convert_tokens_to_string([piece]) * 50
    assert len(r.encode(text)) <= 2 * math.ceil(len(text) / r.max_chars)


def test_a_tokenizer_that_may_shrink_text_claims_no_bound():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def fast(normalizer=None, pre=None):
        t = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "[UNK]": 2}, merges=[], unk_token="[UNK]"))
        if normalizer is not None:
            t.normalizer = normalizer
        if pre is not None:
            t.pre_tokenizer = pre
        return PreTrainedTokenizerFast(tokenizer_object=t)

    assert max_token_chars(fast()) == 5                                   # "[UNK]"
    assert max_token_chars(fast(normalizers.NFC())) is None               # e + U+0301 -> é
    assert max_token_chars(fast(pre=pre_tokenizers.Whitespace())) is None  # spaces dropped
    assert max_token_chars(fast(normalizers.Replace("  ", " "))) is None
    assert max_token_chars(fast(normalizers.Sequence([normalizers.Replace(" ", "\u2581"), normalizers.Prepend("x")]),
                                pre_tokenizers.ByteLevel())) == 5
    b = TokenBudget(100, 10, None)                 # no bound: nothing refused before tokenisation
    b.price_chars(10 ** 9)
    assert b.used == 0


class _Counting:
    def __init__(self, encode):
        self.encode, self.calls = encode, []

    def __call__(self, text):
        self.calls.append(len(text))
        return self.encode(text)


def test_native_rendering_stops_at_the_first_segment_past_the_window():
    r = _renderer("smollm2-135m")
    words = " ".join(random.Random(1).choice(["refund", "policy", "days", "gift"]) for _ in range(12000))  # ~12k tokens
    # 21 segments of context, each alone past the window but under the character bound
    assert math.ceil(len(words) / r.max_chars) < 8192
    segs = [{"text": words}, {"template": "t", "fields": {"x": "y"}}] * 5 + [{"text": "question?"}]
    assert math.ceil(5 * len(words) / r.max_chars) < 8192
    r.encode = counting = _Counting(r.encode)
    with pytest.raises(RequestError) as exc:
        r.render("rid", "ten", segs, Policy.EXACT, None, "salt", TokenBudget(8192, 16, r.max_chars))
    assert exc.value.status == 400 and exc.value.code == "context_length_exceeded"
    assert "context window of 8192 tokens" in exc.value.message
    assert counting.calls == [len(words)]            # one segment tokenised, then refused


def test_oversized_text_is_refused_from_its_characters_alone():
    r = _renderer("smollm2-135m")
    r.encode = counting = _Counting(r.encode)
    big = "x" * 390_000
    with pytest.raises(RequestError) as exc:
        r.render("rid", "ten", [{"text": big}] * 21, Policy.EXACT, None, "salt", TokenBudget(8192, 16, r.max_chars))
    assert exc.value.code == "context_length_exceeded" and "characters" in exc.value.message
    msgs = [{"role": "user", "content": big}] * 21
    with pytest.raises(RequestError) as exc:
        r.chat_ids(msgs, TokenBudget(8192, 16, r.max_chars))
    assert exc.value.code == "context_length_exceeded"
    assert counting.calls == []                      # nothing was tokenised


def test_chat_that_fits_exactly_is_served_and_one_token_more_is_not():
    r = _renderer("smollm2-135m")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "word " * 3000}]
    n = len(r.chat_ids(msgs))
    assert r.chat_ids(msgs, TokenBudget(n + 16, 16, r.max_chars)) == r.chat_ids(msgs)
    with pytest.raises(RequestError):
        r.chat_ids(msgs, TokenBudget(n + 15, 16, r.max_chars))


# ---- against a real cluster -------------------------------------------------------------------------

def _replica_pid() -> int:
    """PID of the (one) Serve router replica among this test's own processes (Ray names its
    worker processes ``ray::ServeReplica:<app>:<deployment>``)."""
    import psutil
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "ServeReplica:kvnotes:kvnotes-router" in " ".join(p.cmdline()):
                found.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    assert len(found) == 1, found
    return found[0]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def cluster(default_cluster):
    """The default cluster (tests/conftest.py, shared with test_e2e_cluster)."""
    return default_cluster


@pytest.mark.slow
def test_oversized_valid_requests_are_refused_without_tokenising_them_and_leave_no_memory(cluster):
    cfg, client = cluster
    rng = random.Random(5)
    seg = "".join(rng.choice("abcdefghij klmnop.") for _ in range(390_000))   # 21 of them: 8.19 MB
    bodies = {
        "native": {"segments": [{"text": seg}] * 21, "max_tokens": 8},
        "chat": {"messages": [{"role": "user", "content": seg}] * 21, "max_tokens": 8},
        "completions": {"prompt": seg, "max_tokens": 8},     # under the character bound: tokenised, then refused
    }
    paths = {"native": "/v1/notes/completions", "chat": "/v1/chat/completions", "completions": "/v1/completions"}
    raw = {k: json.dumps(b).encode() for k, b in bodies.items()}
    assert max(len(b) for b in raw.values()) <= cfg.server.max_body_bytes, "every body must pass the size limits"
    # a small request first, so the replica's start-up allocations are behind us
    ok = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    pid = _replica_pid()
    for kind in ("native", "chat", "completions"):                     # warm each path once
        assert client.post(paths[kind], content=raw[kind], headers={"content-type": "application/json"}).status_code == 400
    before = _rss_mb(pid)
    took: dict[str, list[float]] = {k: [] for k in bodies}
    for i in range(100):
        kind = ("native", "chat", "completions")[i % 3]
        t = time.perf_counter()
        r = client.post(paths[kind], content=raw[kind], headers={"content-type": "application/json"})
        took[kind].append(time.perf_counter() - t)
        assert r.status_code == 400, (kind, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "context window of 8192 tokens" in err["message"], err
        assert err["request_id"]
    after = _rss_mb(pid)
    summary = {k: f"median {sorted(v)[len(v) // 2]:.3f} s, max {max(v):.3f} s" for k, v in took.items()}
    print(f"\nrouter replica RSS {before:.0f} MB -> {after:.0f} MB; per request: {summary}")
    assert after - before < 100, (before, after)
    assert client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
