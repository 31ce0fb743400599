"""usage.prompt_tokens_details' split: the cached tokens by kind of reuse sum to cached_tokens;
tokens the decode engine held are exact; when a fallback loaded fewer tokens than planned, what
was loaded is attributed exact first."""
from cluster.control.reuse_kinds import planned_kinds, reuse_split, usage_details
from kvruntime.messages.plan import KVRef, PlanKind, Policy, RequestPlan, SegmentPlan


def step(kind, n, reused, kv=None, pos=0):
    return SegmentPlan(kind=kind, source="x", token_ids=tuple(range(n)), position=pos, computed=n - reused,
                       reused=reused, kv=kv)


EXACT = KVRef((1, 2), 0, "s")
APPROX = KVRef((1, 2), 0, "s", approx="abc")


def plan(*steps):
    return RequestPlan("r", "m", Policy.FAST, tuple(steps), (9,))


def test_kinds_by_step():
    p = plan(step(PlanKind.REUSE, 300, 300, EXACT), step(PlanKind.REPOSITION, 200, 190, EXACT, 300),
             step(PlanKind.RECOMPUTE, 50, 0, None, 500))
    assert planned_kinds(p) == {"exact": 300, "composed": 190, "edited": 0}
    assert planned_kinds(plan(step(PlanKind.EDIT_IN_PLACE, 400, 380, EXACT))) == {"exact": 0, "composed": 0,
                                                                                   "edited": 380}
    erratum = plan(step(PlanKind.REUSE, 400, 400, EXACT), step(PlanKind.ERRATUM, 12, 0, None, 400))
    assert planned_kinds(erratum)["edited"] == 400
    assert planned_kinds(plan(step(PlanKind.REUSE, 400, 400, APPROX)))["composed"] == 400


def test_split_sums_to_the_cached_tokens_and_decode_cache_is_exact():
    p = plan(step(PlanKind.REUSE, 300, 300, EXACT), step(PlanKind.REPOSITION, 200, 190, EXACT, 300))
    src = {"reused": 300, "repositioned": 190, "decode_cache": 7, "computed": 4, "erratum": 0}
    split = reuse_split(p, src)
    assert split == {"exact": 307, "composed": 190, "edited": 0}
    assert usage_details(497, split) == {"cached_tokens": 497, "exact_tokens": 307, "composed_tokens": 190,
                                         "edited_tokens": 0}
    # the block was lost: the prefill worker's loads did not count; the decode engine held 40 tokens
    assert reuse_split(p, {"reused": 0, "repositioned": 0, "decode_cache": 40}) == {"exact": 40, "composed": 0,
                                                                                     "edited": 0}
    # a conversation composed the same way: vLLM holds 1500 leading tokens under the recipe's salt;
    # those before the first approximate step (at 300) are exact, the rest attend to it: composed
    conv = plan(step(PlanKind.REUSE, 300, 300, EXACT), step(PlanKind.REPOSITION, 200, 190, EXACT, 300),
                step(PlanKind.RECOMPUTE, 1100, 0, None, 500))
    assert reuse_split(conv, {"decode_cache": 1500}) == {"exact": 300, "composed": 1200, "edited": 0}
    edit = plan(step(PlanKind.EDIT_IN_PLACE, 400, 380, EXACT, 0))
    assert reuse_split(edit, {"decode_cache": 256}) == {"exact": 0, "composed": 0, "edited": 256}
    # fewer loaded than planned: attributed exact first
    assert reuse_split(p, {"reused": 250, "repositioned": 0, "decode_cache": 0}) == {"exact": 250, "composed": 0,
                                                                                      "edited": 0}
