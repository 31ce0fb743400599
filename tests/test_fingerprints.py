"""Prompt matching's pure half and its state-store tables: content-defined spans realign after an
insertion, a reorder or an edited field; registrations are found at any offset by their anchors;
an edit of a held prompt is found from the divergence; the fingerprint and held-prompt tables
are tenant-scoped, bounded LRU and survive a reopen, on SQLite and a real redis-server."""
from __future__ import annotations

import random
import time

import pytest

from cluster.control.fingerprints import SpanConfig, anchors, as_ids, cut, cuts, divergence, fingerprint, spans
from cluster.control.matching import (MatchConfig, anchor_entries, anchored_chunks, choose, find_edit, lookup_keys,
                                      may_edit, nearest_held, segments, seen_in, where)
from cluster.control.state import StoreLimits, open_state
from kvruntime.messages.plan import KVRef


def rand_ids(n, seed):
    r = random.Random(seed)
    return tuple(r.randrange(1, 49000) for _ in range(n))


def span_keys(tenant, ids):
    return {s.key: s for s in spans(tenant, ids)}


def covered(tenant, a, b):
    """Tokens of b inside spans that a also has."""
    ka = span_keys(tenant, a)
    return sum(s.tokens for s in spans(tenant, b) if s.key in ka)


def test_cuts_obey_min_and_max_and_end_at_the_prompt():
    cfg = SpanConfig()
    ids = rand_ids(5000, 1)
    ends = cuts(ids, cfg)
    lens = [e - s for s, e in zip([0] + ends, ends)]
    assert ends[-1] == len(ids) and all(lens[i] >= cfg.min_span for i in range(len(lens) - 1))
    assert max(lens) <= cfg.max_span and 5000 / len(ends) < cfg.max_span     # content cuts, not only max cuts
    assert cuts(ids[:10], cfg) == [10] and cuts((), cfg) == []


@pytest.mark.parametrize("change", ["insert", "reorder", "edit"])
def test_spans_realign_after_insertion_reorder_and_edited_field(change):
    docs = [rand_ids(600, s) for s in range(3)]
    a = docs[0] + docs[1] + docs[2]
    if change == "insert":
        b = docs[0] + rand_ids(77, 9) + docs[1] + docs[2]
    elif change == "reorder":
        b = docs[2] + docs[0] + docs[1]
    else:
        b = a[:900] + (7, 7, 7) + a[903:]
    # most of the shared text lies in shared spans (only spans touching a change differ)
    assert covered("t", a, b) >= 0.5 * len(a)


def _templated(rows, insert_at=None):
    """Lines differing only in two small numbers (``sensor {i % 4} reading {i % 3} ok``, as ids):
    a period of 12 lines, whose windows hold no content-defined candidate at all."""
    out = []
    for i in range(rows):
        if i == insert_at:
            out += [104, 105, 9999, 198]                       # one inserted line
        out += [100, 101, 2000 + i % 4, 102, 3000 + i % 3, 103, 198]
    return tuple(out)


def test_templated_text_without_candidates_realigns_after_an_inserted_line():
    from cluster.control.fingerprints import _top_zero, window_hashes
    cfg = SpanConfig()
    a, b = _templated(300), _templated(300, insert_at=40)
    assert len(_top_zero(window_hashes(a, cfg.window), cfg.boundary_bits)) == 0   # only the length rule cuts
    ends = cuts(a, cfg)
    lens = [e - s for s, e in zip([0] + ends, ends)]
    assert all(cfg.min_span <= n <= cfg.max_span for n in lens[:-1]) and ends[-1] == len(a)
    # after the inserted line (token 280 of b) the cuts realign: most of b's rest lies in spans a has
    ka = span_keys("t", a)
    after = [s for s in spans("t", b) if s.start >= 280 + 4]
    shared = sum(s.tokens for s in after if s.key in ka)
    assert shared >= 0.8 * (len(b) - 284), (shared, len(b) - 284)
    # and the cuts are those of a, shifted by the inserted line's 4 tokens, from the first shared span on
    first = next(s for s in after if s.key in ka)
    assert [e - 4 for e in cuts(b, cfg) if e >= first.end] == [e for e in ends if e >= first.end - 4]


def test_fingerprints_are_tenant_scoped():
    ids = rand_ids(400, 2)
    assert fingerprint("acme", ids) != fingerprint("globex", ids)
    assert not set(span_keys("acme", ids)) & set(span_keys("globex", ids))
    assert not {x.key for x in anchors("acme", ids)} & {x.key for x in anchors("globex", ids)}
    assert fingerprint("acme", ids) == fingerprint("acme", list(ids))


def test_divergence_prefix_and_tail_never_overlap():
    assert divergence((1, 2, 3, 4, 5), (1, 2, 9, 9, 4, 5)) == (2, 2)
    assert divergence((1, 2), (1, 2, 3)) == (2, 0)
    assert divergence((1, 1, 1), (1, 1)) == (2, 0)
    assert divergence((5, 1, 1), (6, 1, 1)) == (0, 2)


def test_find_edit_one_field_and_refusals():
    held = rand_ids(1200, 3)
    new = held[:500] + (11, 12, 13, 14) + held[503:]
    e = find_edit(new, held, MatchConfig())
    assert (e.start, e.held_end, e.new_end) == (500, 503, 504) and e.equal == len(new) - 4
    assert new[:e.start] + new[e.start:e.new_end] + held[e.held_end:] == new
    assert find_edit(held, held, MatchConfig()) is None                       # equal: the prompt index
    assert find_edit(held + (1, 2), held, MatchConfig()) is None              # an extension: the prompt index
    other = rand_ids(1200, 4)
    assert find_edit(other, held, MatchConfig()) is None                      # nothing in common
    big = held[:1000] + rand_ids(80, 5) + held[1080:]
    assert find_edit(big, held, MatchConfig()) is None                        # the divergent span is too long
    assert find_edit(big, held, MatchConfig(edit_max_tokens=80)) is not None
    deletion = held[:500] + held[520:]
    d = find_edit(deletion, held, MatchConfig())
    assert (d.start, d.held_end, d.new_end) == (500, 520, 500)
    # the quick check never refuses a real one-span edit, wherever the span falls against its samples
    r = random.Random(11)
    for _ in range(300):
        at, old_n, new_n = r.randrange(0, 1200), r.randrange(0, 65), r.randrange(0, 65)
        new = held[:at] + rand_ids(new_n, r.randrange(10 ** 6)) + held[at + old_n:]
        assert may_edit(new, held, 64) and may_edit(held, new, 64)
        if at + old_n < len(held) and divergence(new, held) != (len(new), 0):    # not equal, no truncation
            assert find_edit(new, held, MatchConfig(edit_min_share=0.5)) is not None
    assert not may_edit(held[:600] + rand_ids(200, 12) + held[800:], held, 64)   # two samples differ
    assert not may_edit(held + rand_ids(65, 13), held, 64)


def test_chunk_found_at_any_offset_and_verified():
    skill = rand_ids(300, 6)
    entries = {k: (0, d) for k, d in anchor_entries("skill", "refund", "acme", skill, SpanConfig()).items()}
    assert entries, "a 300-token chunk has anchors"
    ref = lambda ids: KVRef(tuple(ids), 1, "salt")  # noqa: E731
    for before in (0, 37, 401):
        prompt = rand_ids(before, 7) + skill + rand_ids(120, 8)
        pc = cut("acme", prompt)
        got = anchored_chunks("acme", prompt, pc, entries, ref, 0)
        assert [(m.start, m.end, m.kind, m.name) for m in got] == [(before, before + 300, "skill", "refund")]
        assert got[0].kv.token_ids == skill
        assert anchored_chunks("acme", prompt, pc, entries, ref, before + 1) == []
        # one token changed: the anchors still hit, the fingerprint no longer matches
        bent = prompt[:before + 150] + (1,) + prompt[before + 151:]
        assert anchored_chunks("acme", bent, cut("acme", bent), entries, ref, 0) == []
        # another tenant's prompt never reads this tenant's anchors
        assert not set(entries) & {a.key for a in cut("globex", prompt).anchors}


def test_segments_split_the_prompt_around_chunks():
    ids = rand_ids(2000, 9)
    ref = lambda t: KVRef(tuple(t), 1, "salt")  # noqa: E731
    from cluster.control.matching import ChunkMatch
    a = ChunkMatch(300, 500, "span", "abc", ref(ids[300:500]))
    b = ChunkMatch(500, 800, "skill", "s", ref(ids[500:800]))
    inside = ChunkMatch(600, 700, "span", "d", ref(ids[600:700]))
    tiny = ChunkMatch(1000, 1010, "span", "e", ref(ids[1000:1010]))
    got = choose([a, inside, b, tiny], 32)
    assert got == [a, b]
    segs = segments(ids, 100, got)
    assert segs[0].kind == "prompt" and segs[0].token_ids == ids[:100]
    assert sum((s.token_ids for s in segs), ()) == ids
    assert [s.kind for s in segs] == ["prompt", "text", "span", "skill", "text"]
    assert segs[2].kv.token_ids == ids[300:500]
    assert [s.kind for s in segments(ids, 0, [])] == ["text"]


def test_nearest_held_by_votes_and_where():
    ids = rand_ids(1500, 10)
    c = cut("acme", ids)
    # a span's entry: (how many kept prompts held it, where it was last seen)
    entries = {s.key: (1, ("A" if i < 2 else "B") + f"@{s.start}") for i, s in enumerate(c.spans)}
    assert nearest_held(c, entries) == "B" and nearest_held(c, {}) is None
    assert nearest_held(c, entries, exclude="B") == "A"
    # an edit candidate holds this prompt's equal parts at the same offsets (or shifted by the edit's
    # change in length): a prompt holding them elsewhere gets no vote
    moved = {s.key: (1, ("A" if i < 2 else "B") + f"@{s.start + (0 if i < 2 else 500)}") for i, s in enumerate(c.spans)}
    assert nearest_held(c, moved) == "B" and nearest_held(c, moved, max_shift=64) == "A"
    assert nearest_held(c, {s.key: (1, f"B@{s.start + 65}") for s in c.spans}, max_shift=64) is None
    assert seen_in("ab@12") == ("ab", 12) and seen_in("") is None
    assert lookup_keys(c) == [s.key for s in c.spans] + [a.key for a in c.anchors]
    assert [(a.end, a.key) for a in c.anchors] == [(a.end, a.key) for a in anchors("acme", ids)]
    assert as_ids(list(ids)).tolist() == list(ids) == as_ids(as_ids(ids)).tolist()
    msgs = ((0, "system", 3, 50), (1, "user", 55, 90))
    assert where(60, msgs) == "message 1 (user), token 60"
    assert where(52, msgs) == "after message 0 (system), token 52 (chat markup)"
    assert where(1, ()) == "token 1"


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/state.db"
    return request.getfixturevalue("redis_url")


def test_fingerprint_table_counts_sets_and_is_tenant_scoped(store_url):
    s = open_state(store_url)
    now = time.time()
    assert s.count_fingerprints("acme", ["s:a", "s:b", "s:a"], now) == {"s:a": 1, "s:b": 1}   # once per prompt
    assert s.count_fingerprints("acme", ["s:a"], now) == {"s:a": 2}
    s.put_fingerprints("acme", {"s:a": "compiled", "a:x": '{"k":1}'}, now)
    assert s.get_fingerprints("acme", ["s:a", "s:b", "a:x", "s:zz"], now) == {
        "s:a": (2, "compiled"), "s:b": (1, ""), "a:x": (0, '{"k":1}')}
    assert s.get_fingerprints("globex", ["s:a", "a:x"], now) == {}
    assert s.count_fingerprints("globex", ["s:a"], now) == {"s:a": 1}
    assert s.delete_fingerprints("acme", ["s:b", "s:nope"]) == 1
    s.put_held_prompt("acme", "h1", (5, 6, 2 ** 40), now)
    assert s.get_held_prompt("acme", "h1", now) == (5, 6, 2 ** 40)
    assert s.get_held_prompt("globex", "h1", now) is None
    s.close()
    s = open_state(store_url)                          # a restarted router reads the same entries
    assert s.get_fingerprints("acme", ["s:a"], now) == {"s:a": (2, "compiled")}
    assert s.get_held_prompt("acme", "h1", now) == (5, 6, 2 ** 40)
    assert s.sizes(now)["fingerprints"] == 3 and s.sizes(now)["held_prompts"] == 1
    s.close()


def test_fingerprints_and_held_prompts_are_bounded_lru_and_expire(store_url):
    s = open_state(store_url, StoreLimits(fingerprint_max=3, held_prompt_max=2, fingerprint_ttl_s=600,
                                          held_prompt_ttl_s=600))
    now = time.time()
    for i in range(3):
        s.put_fingerprints("acme", {f"s:{i}": ""}, now + i)
    s.get_fingerprints("acme", ["s:0"], now + 3)        # s:0 is recent again
    s.put_fingerprints("acme", {"s:3": ""}, now + 4)
    s.expire(now + 4)
    assert set(s.get_fingerprints("acme", ["s:0", "s:1", "s:2", "s:3"], now + 5)) == {"s:0", "s:2", "s:3"}
    for i in range(3):
        s.put_held_prompt("acme", f"h{i}", (i,), now + i)
    s.expire(now + 3)
    assert s.get_held_prompt("acme", "h0", now + 3) is None and s.get_held_prompt("acme", "h2", now + 3) == (2,)
    s.close()


def test_a_read_without_touch_refreshes_no_lru(store_url):
    """The request path's reads (``touch=False``): the recording's touch refreshes them later."""
    s = open_state(store_url, StoreLimits(fingerprint_max=2, held_prompt_max=2, fingerprint_ttl_s=600,
                                          held_prompt_ttl_s=600))
    now = time.time()
    for i in range(2):
        s.put_fingerprints("globex", {f"s:{i}": ""}, now + i)
        s.put_held_prompt("globex", f"h{i}", (i,), now + i)
    assert set(s.get_fingerprints("globex", ["s:0", "s:1"], now + 3, touch=False)) == {"s:0", "s:1"}
    assert s.get_held_prompt("globex", "h0", now + 3, touch=False) == (0,)
    s.put_fingerprints("globex", {"s:2": ""}, now + 4)
    s.put_held_prompt("globex", "h2", (2,), now + 4)
    s.expire(now + 4)
    assert set(s.get_fingerprints("globex", ["s:0", "s:1", "s:2"], now + 5)) == {"s:1", "s:2"}
    assert s.get_held_prompt("globex", "h0", now + 5) is None and s.get_held_prompt("globex", "h1", now + 5) == (1,)
    s.close()
    s = open_state(store_url, StoreLimits(fingerprint_ttl_s=0.5, held_prompt_ttl_s=0.5))
    t = time.time()
    s.put_fingerprints("acme", {"s:t": ""}, t)
    s.put_held_prompt("acme", "ht", (1,), t)
    time.sleep(0.8)
    assert s.get_fingerprints("acme", ["s:t"], time.time()) == {}
    assert s.get_held_prompt("acme", "ht", time.time()) is None
    s.close()


def test_grown_runs_are_trimmed_to_line_breaks_near_their_edges():
    from cluster.control.recurring import grow, trim
    nl = 10
    brk = lambda t: t == nl  # noqa: E731
    doc = (21, 22, nl, 23, 24, 25, nl)
    a = (1, 2, 7, 8, nl) + doc + (31, 32)
    b = (3, 7, 8, nl) + doc + (31, 33)
    at = a.index(23)
    start, _, n = grow(a, at, b, b.index(23), 3)
    assert (start, start + n) == (2, 13)                 # grown over "7 8 \n" before and "31" after
    assert trim(a, start, start + n, brk, 32) == (5, 12)  # cut back to the document's lines
    assert trim(a, 5, 12, brk, 32) == (5, 12)            # already on line edges: kept
    assert trim(a, start, start + n, None, 32) == (start, start + n)


def test_a_grown_run_stops_at_a_chunk_the_prompt_already_matched():
    """Two documents adjacent in an earlier prompt: where this prompt matched the second one held
    (a unit compiled on its own), the run grown from the first stops at it, so the held one is
    reused and only the first compiled; with nothing matched it grows over both."""
    from cluster.control.recurring import clip, recurring_runs
    d1, d2, sep = rand_ids(300, 21), rand_ids(300, 22), (10, 10)
    old = rand_ids(20, 23) + d1 + sep + d2 + rand_ids(20, 24)
    new = rand_ids(40, 25) + d1 + sep + d2 + rand_ids(20, 26)
    tenant, cfg = "t", MatchConfig()
    c = cut(tenant, new)
    s = next(s for s in c.spans if s.start >= 60 and s.end <= 340)              # a span inside d1
    seen = {s.key: (1, f"old@{s.start - 20}")}
    d2_at = 40 + len(d1) + len(sep)
    both = recurring_runs(new, c, {s.key: 2}, seen, lambda k: old, cfg, [])
    assert both and both[0][0] <= 40 and both[0][1] >= d2_at + len(d2)        # d1 + d2 as one run
    held = [(d2_at, d2_at + len(d2))]
    one = recurring_runs(new, c, {s.key: 2}, seen, lambda k: old, cfg, held)
    assert one == [(both[0][0], d2_at)]                                        # d1 (and the separator) only
    assert clip(0, 100, 40, 50, [(60, 70), (0, 10)]) == (10, 60) and clip(5, 9, 6, 8, [(20, 30)]) == (5, 9)


def test_a_passage_inside_a_document_and_the_document_both_stay_findable(store_url):
    """Two chunks holding the same windows (a passage, then a document quoting it) share anchor
    keys: each key names both, so a prompt with the passage alone finds the passage and one with
    the document finds the document; taking one off its keys (evicted, unregistered) keeps the other."""
    from cluster.control.recurring import remove_anchors, store_anchors
    s, cfg, now = open_state(store_url), SpanConfig(), time.time()
    passage = rand_ids(300, 31)
    document = rand_ids(200, 32) + passage + rand_ids(200, 33)
    ref = lambda ids: KVRef(tuple(ids), 1, "salt")  # noqa: E731
    store_anchors(s, "acme", anchor_entries("span", "passage", "acme", passage, cfg), now)
    store_anchors(s, "acme", anchor_entries("span", "document", "acme", document, cfg), now)
    store_anchors(s, "acme", anchor_entries("span", "document", "acme", document, cfg), now)   # again: once

    def found(prompt):
        c = cut("acme", prompt)
        got = s.get_fingerprints("acme", lookup_keys(c), now)
        return sorted((m.name, m.start) for m in anchored_chunks("acme", prompt, c, got, ref, 0))
    assert found(rand_ids(50, 34) + passage + rand_ids(40, 35)) == [("passage", 50)]
    assert found(rand_ids(10, 36) + document) == [("document", 10), ("passage", 210)]
    shared = [a.key for a in anchors("acme", passage, cfg)]
    assert all(s.get_fingerprints("acme", [k], now)[k][1].count("c1|") == 2 for k in shared)
    remove_anchors(s, "acme", [a.key for a in anchors("acme", document, cfg)], fingerprint("acme", document), now)
    assert found(rand_ids(10, 36) + document) == [("passage", 210)]
    remove_anchors(s, "acme", shared, fingerprint("acme", passage), now)
    assert s.get_fingerprints("acme", shared, now) == {}
    s.close()
