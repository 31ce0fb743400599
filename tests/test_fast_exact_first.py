"""``fast`` keeps the longest exact prefix first and the exact path where composing buys nothing
(issue 44, the agent-traffic regression): pure planner and matching functions, and the
recurring-span recorder on a real SQLite state store (no model, no Ray)."""
import random
import time

import pytest

from cluster.control.fingerprints import cut
from cluster.control.matching import ChunkMatch, MatchConfig, segments
from cluster.control.metrics import Metrics
from cluster.control.planner import PlannerConfig, RenderedRequest, TierView, plan_request
from cluster.control.recurring import RecurringSpans, extended
from cluster.control.state import open_state
from kvruntime.messages.plan import KVRef, PlanKind, Policy
from tests.conftest import metric

SALT = "cd" * 16
COLD = PlannerConfig(decode_computes_cold=True)


def encode(text):
    return [len(w) for w in text.split()]


def ids(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(20, 30_000) for _ in range(n))


def chunk(prompt, start, end, name="c0ffee", kind="span"):
    return ChunkMatch(start, end, kind, name, KVRef(tuple(prompt[start:end]), 1, SALT))


def plan(prompt, chunks, hit=0, held=(), policy=Policy.FAST, config=PlannerConfig()):
    """A plain prompt planned as ``PromptMatcher.plan`` does: matched chunks past the exact prefix."""
    req = RenderedRequest("r", "m", policy, segments(prompt, hit, chunks), (7,), None)
    tier = TierView(chunk_keys=frozenset(c.kv.digest for c in chunks if c.name in held), prompt_prefix_hit=hit,
                    prompt_prefix_kv=KVRef(tuple(prompt[:hit]), 0, SALT) if hit else None)
    return plan_request(req, tier, None, encode, config)


@pytest.mark.parametrize("policy", [Policy.FAST, Policy.BALANCED, Policy.EXACT])
def test_the_held_exact_prefix_is_reused_before_any_chunk_under_every_policy(policy):
    """A prompt whose first 512 tokens the tier holds exactly: one REUSE of those 512 comes first,
    whatever the policy; a chunk after it is planned by the policy's rule, never one inside it."""
    prompt = ids(1, 1200)
    p = plan(prompt, [chunk(prompt, 700, 1000, "a")], hit=512, held={"a"}, policy=policy)
    first = p.steps[0]
    assert first.kind is PlanKind.REUSE and first.tokens == 512 and first.position == 0 and first.kv.exact
    assert first.token_ids == prompt[:512]
    kinds = [s.kind for s in p.steps]
    assert PlanKind.REPOSITION not in kinds[:2]        # the text after the prefix, then the chunk
    assert kinds[2] is (PlanKind.RECOMPUTE if policy is Policy.EXACT else PlanKind.REPOSITION)
    assert all(s.position >= 512 for s in p.steps[1:])


def test_segments_past_the_exact_prefix_never_cover_it():
    """Matching's segments: the exact prefix whole, then text and chunks (a chunk starting inside
    the prefix is not offered: ``anchored_chunks`` starts at the hit)."""
    prompt = ids(2, 900)
    segs = segments(prompt, 512, [chunk(prompt, 600, 800)])
    assert [(s.kind, len(s.token_ids)) for s in segs] == [("prompt", 512), ("text", 88), ("span", 200), ("text", 100)]


def test_a_prompt_whose_only_reuse_is_a_span_not_held_yet_stays_exact_for_the_decode_engine():
    """Decode engine vLLM: a recurring span the tier does not hold yet would be compiled in the
    build (as many tokens computed, on the prefill worker, approximate KV); when nothing else is
    held the prompt goes whole to the decode engine, exact, and the span is left to the background
    compile (the conversation's first turn under ``fast``, where it displaced the exact prefix)."""
    prompt = ids(3, 1100)
    fresh = [chunk(prompt, 14, 1071, "b2311b")]
    p = plan(prompt, fresh, config=COLD)
    assert p.steps == () and p.suffix_ids == prompt + (7,) and not p.approx
    assert p.kind is PlanKind.RECOMPUTE and p.reused_tokens == 0
    assert any("compiled on its own in the background" in n for n in p.notes), p.notes
    assert not any("before use" in n for n in p.notes), p.notes
    # another chunk the tier holds: composed, the span compiled in the build as before
    two = [chunk(prompt, 14, 500, "held"), chunk(prompt, 520, 1071, "b2311b")]
    c = plan(prompt, two, held={"held"}, config=COLD)
    reps = [s for s in c.steps if s.kind is PlanKind.REPOSITION]
    assert len(reps) == 2 and reps[0].reused > 0 and reps[1].reused == 0 and c.approx
    # the reference decode engine (computes no cold prompt itself): the build compiles it
    ref = plan(prompt, fresh)
    assert [s.kind for s in ref.steps] == [PlanKind.RECOMPUTE, PlanKind.REPOSITION, PlanKind.RECOMPUTE]
    # an exact prefix the tier holds is reused, and the span past it compiled in the build
    hit = plan(prompt, [chunk(prompt, 600, 1071, "late")], hit=512, config=COLD)
    assert hit.steps[0].kind is PlanKind.REUSE and hit.steps[0].tokens == 512


def test_a_registered_skill_the_tier_lost_is_still_rewarmed_in_the_build():
    """Only recurring spans are held back: an evicted registration is re-warmed (stored back)."""
    prompt = ids(4, 600)
    p = plan(prompt, [chunk(prompt, 100, 400, "refund", kind="skill")], config=COLD)
    assert [s.kind for s in p.steps] == [PlanKind.RECOMPUTE, PlanKind.REPOSITION, PlanKind.RECOMPUTE]


def _seen_after(tenant, prompt, key):
    """The span entries a match would read after ``prompt`` (kept under ``key``) was recorded."""
    c = cut(tenant, prompt)
    return {s.key: (1, f"{key}@{s.start}") for s in c.spans}


def test_extended_finds_the_earlier_turn_a_growing_conversation_starts_with():
    turn0 = ids(5, 800)
    turn1 = turn0 + ids(6, 500)
    seen = _seen_after("t", turn0, "k0")
    held = {"k0": turn0}.get
    assert extended("t", turn1, cut("t", turn1), seen, "k1", held) == len(turn0)
    # the same text after another head (a reordered or edited prompt): no extension
    other = ids(7, 3) + turn0[3:] + ids(6, 500)
    assert extended("t", other, cut("t", other), seen, "k2", held) == 0
    # the earlier prompt no longer kept: none either
    assert extended("t", turn1, cut("t", turn1), seen, "k1", {}.get) == 0


class _NoBackends:
    def __init__(self):
        self.compiled = []

    async def precompile(self, ref, index, base=None):
        self.compiled.append(ref)
        return type("Info", (), {"cached": False, "seconds": 0.0})()


BREAK = 10                                   # the token whose text is a blank line


def _text(t):
    return "\n\n" if t == BREAK else "w"


def _record(rs, tenant, key, prompt, seen):
    c = cut(tenant, prompt)
    return rs._record(tenant, key, prompt, c, seen, [], True, [], units_at=[(0, len(prompt))])


def test_a_growing_conversation_compiles_no_units_a_new_prompt_does(tmp_path):
    """``compile_after: 1``: the document-like units of a first sighting are compiled, but not
    those of a turn that starts with a whole earlier kept prompt: the next turn reaches them
    through its prefix, where a unit spliced in would change the composition every turn."""
    state, metrics = open_state(f"sqlite:///{tmp_path}/s.db"), Metrics()
    rs = RecurringSpans(state, _NoBackends(), metrics, MatchConfig(), 1, text=_text)
    tenant = "t"
    turn0 = ids(8, 300) + (BREAK,) + ids(9, 300)
    assert len(_record(rs, tenant, "k0", turn0, {})) == 2          # two units, first sighting
    turn1 = turn0 + (BREAK,) + ids(10, 400)
    seen = state.get_fingerprints(tenant, [s.key for s in cut(tenant, turn1).spans], time.time(), touch=False)
    assert seen, "turn 0's spans are recorded"
    assert _record(rs, tenant, "k1", turn1, seen) == []              # a growing conversation's turn
    assert metric(metrics.render().decode(), "kvnotes_recurring_spans_total", outcome="units_skipped_extends") == 1
    fresh = ids(11, 250) + (BREAK,) + ids(12, 250)
    assert len(_record(rs, tenant, "k2", fresh, {})) == 2            # an unrelated prompt's units


def test_a_background_compile_goes_through_the_one_gate_and_each_scheduled_compile_ends_once(tmp_path):
    """A prompt's background compiles (here its two units) wait in the router's background gate
    (``YieldingBackends``, the one store-behind uses) while a request of the replica is in flight;
    each is counted ``scheduled`` when queued and ends exactly once, so ``pending()`` returns to 0:
    compiled (one slot, ``compiles_in_flight`` 1: the others wait in the queue, none skipped), or
    failed when its task is cancelled with the loop, even before it started or while queued."""
    import asyncio
    from dataclasses import replace

    from cluster.control.backends import RequestActivity, YieldConfig, YieldingBackends
    from cluster.control.recurring import OUTCOMES, pending

    backends, metrics, act = _NoBackends(), Metrics(), RequestActivity()
    gate = YieldingBackends(backends, act, YieldConfig(quiet_s=0.01, max_wait_s=600), metrics)
    state = open_state(f"sqlite:///{tmp_path}/s.db")
    rs = RecurringSpans(state, backends, metrics, replace(MatchConfig(), compiles_in_flight=1), 1, text=_text,
                        background=gate)

    def outcomes():
        text = metrics.render().decode()
        return {o: metric(text, "kvnotes_recurring_spans_total", outcome=o) for o in OUTCOMES}
    assert outcomes() == dict.fromkeys(OUTCOMES, 0.0)                 # exported as zeros from the start
    p0, p1 = ids(15, 300) + (BREAK,) + ids(16, 300), ids(17, 300) + (BREAK,) + ids(18, 300)

    async def observe(key, prompt):
        await rs.observe("t", SALT, key, prompt, cut("t", prompt), {}, [], 0, units_at=[(0, len(prompt))])

    async def go():
        with act.request():                          # the request whose answer queued them
            await observe("k0", p0)
            await observe("k1", p1)
            assert pending(outcomes()) == 4 and outcomes()["scheduled"] == 4
            for _ in range(20):
                await asyncio.sleep(0.005)
            assert backends.compiled == [], "a background compile started while a request was in flight"
        await rs.drain()
    asyncio.run(go())
    got = outcomes()
    # p0's first unit waited in the gate holding the one slot, the other three queued: all compiled in turn
    assert len(backends.compiled) == got["compiled"] == 4 and got["skipped_busy"] == 0, got
    assert pending(got) == 0 and got["unit_first_sighting"] == 4

    async def cancelled():
        busy = act.request()
        busy.__enter__()                             # a request that never ends: the compiles wait
        await observe("k2", ids(19, 300) + (BREAK,) + ids(20, 300))
        await asyncio.sleep(0.02)                    # k2's first unit waiting in the gate, its second behind it
        waiting = set(rs._tasks)
        await observe("k3", ids(21, 300) + (BREAK,) + ids(22, 300))
        for task in rs._tasks - waiting:
            task.cancel()                            # k3's, before it started
        await asyncio.sleep(0)
        return busy
    asyncio.run(cancelled())                         # asyncio.run cancels the tasks it leaves
    got = outcomes()
    assert got["scheduled"] == 8 and got["failed"] == 4 and pending(got) == 0, got
    assert len(backends.compiled) == 4 and not rs._queue and rs.in_flight == 0
