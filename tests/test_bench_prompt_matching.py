"""``bench.prompt_matching`` measures what it says: the prompt it times holds a registered chunk
and a compiled run that matching finds, against a store filled with the fingerprints asked for."""
from bench.prompt_matching import markdown, measure


def test_the_measured_prompt_finds_its_two_chunks_among_the_fingerprints():
    r = measure(2048, 600, 3, None)
    assert r["tokens"] == 2048 and r["fingerprints"] >= 600 and r["chunks"] == 2
    assert 0 < r["min_ms"] <= r["median_ms"] <= r["p90_ms"]
    assert "| PromptMatcher.match | 2048 |" in markdown(r)
