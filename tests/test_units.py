"""Document-like units of a prompt (cluster/control/units.py): blank-line-separated blocks of each
message's content, their edge whitespace and a numbered label they open with left out, the same
ids for the same document wherever a prompt places it."""
from cluster.control.units import blocks, content_ranges, label_end, units

VOCAB = ["\n", " ", "[", "]", ":", "Document", "Context", "Question", "Read", "1", "2", "3", "alpha", "beta",
         "gamma", "delta", "x"]
ID = {t: i for i, t in enumerate(VOCAB)}


def text(i):
    return VOCAB[i]


def enc(*toks):
    return [ID[t] for t in toks]


def body(word, n=40):
    return enc(*([word, " "] * (n // 2))[:-1])          # n - 1 tokens, a word at each end


def test_blocks_split_at_blank_lines_only_and_drop_edge_whitespace():
    ids = enc("Read", "\n", "\n") + body("alpha") + enc("\n") + body("beta") + enc("\n", " ", "\n") + body("gamma")
    got = blocks(ids, [(0, len(ids))], text)
    assert got == [(0, 1), (3, 3 + 79), (3 + 79 + 3, len(ids))]         # one line break: no cut
    assert blocks(ids, [(3, 20)], text) == [(3, 20)] and blocks(ids, [(3, 21)], text) == [(3, 20)]   # in range


def test_a_numbered_label_is_left_out_and_a_plain_heading_kept():
    doc = enc("Document", " ", "2", ":", "\n") + body("alpha")
    assert label_end(doc, 0, len(doc), text, 8) == 5                   # "Document 2:\n" left out
    rank = enc("[", "3", "]", " ") + body("beta")
    assert label_end(rank, 0, len(rank), text, 8) == 4
    plain = enc("Context", ":", "\n") + body("gamma")
    assert label_end(plain, 0, len(plain), text, 8) == 0               # no digit: no label
    late = enc("x", "x", "x", "x", "x", "x", "x", "x", "1", ":") + body("delta")
    assert label_end(late, 0, len(late), text, 8) == 0                 # longer than the bound


def test_the_same_passage_under_another_rank_and_order_is_the_same_unit():
    a, b, c = body("alpha"), body("beta"), body("gamma")

    def prompt(order):
        out = enc("Context", ":", "\n")
        for k, d in enumerate(order):
            out += (enc("\n", "\n") if k else []) + enc("[", str(k + 1), "]", " ") + d
        return out + enc("\n", "\n", "Question", ":", " ", "x")
    one, two = prompt([a, b]), prompt([c, b, a])
    ua = {tuple(one[s:e]) for s, e in units(one, [(0, len(one))], text, 32, 8)}
    ub = {tuple(two[s:e]) for s, e in units(two, [(0, len(two))], text, 32, 8)}
    assert ua == {tuple(a), tuple(b)} and ub == {tuple(a), tuple(b), tuple(c)}
    assert units(one, [(0, len(one))], text, 41, 8) == []               # shorter than min_tokens: none
    kept = {tuple(one[s:e]) for s, e in units(one, [(0, len(one))], text, 32, 0)}
    assert tuple(enc("[", "2", "]", " ") + b) in kept                   # unit_label_tokens 0 keeps labels


def test_content_ranges_are_the_messages_or_the_whole_prompt():
    assert content_ranges(((0, "system", 3, 10), (1, "user", 14, 40)), 30) == [(3, 10), (14, 30)]
    assert content_ranges((), 12) == [(0, 12)]
