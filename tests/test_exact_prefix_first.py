"""The longest exact prefix first, under every policy, through the router with real executors (no
Ray; the in-process rig of tests/test_prompt_reuse.py): a context an ``exact`` request computed is
reused whole by a ``fast`` session's first turn (it used to compose it again) and becomes that
session's context; a longer context starting with it reuses it first, exactly."""
import asyncio

import pytest

from cluster.control.context import RequestContext
from cluster.control.prompt_index import PROMPT_BLOCK
from decode_workers.held_kv import HeldPrefixes
from kvruntime.messages.decode import SamplingParams, TokenEvent
from kvruntime.messages.plan import PlanKind
from tests.test_prompt_reuse import WORDS, _check_sources, rig  # noqa: F401  (the rig fixture)

pytestmark = pytest.mark.slow


async def _ask(router, segments, policy, session=None):
    fin = None
    async for ev in router.stream_native(RequestContext.local("default", policy=policy), segments, session=session,
                                         sampling=SamplingParams(max_tokens=2, temperature=0)):
        if not isinstance(ev, TokenEvent):
            fin = ev
    return fin


def test_fast_reuses_an_exact_context_in_a_session_and_the_leading_blocks_of_another(smol, rig):
    router, b = rig
    words = WORDS.split(". ")
    for k, name in enumerate(("north", "south")):
        asyncio.run(router.register_chunk("skill", "default", name, ". ".join(words[k::2]) + "."))
    segs = [{"skill": "north"}, {"skill": "south"}, {"text": "Who keeps unit 13 tidy?"}]

    def ask(policy, segments, session=None):
        b.dec.held = HeldPrefixes(256 << 20)          # the tier, not the decode engine, serves repeats
        return asyncio.run(_ask(router, segments, policy, session))
    exact = ask("exact", segs)                          # computed exactly, stored, indexed
    n = len(exact.plan.prefix_ids)
    assert not exact.plan.approx and n >= PROMPT_BLOCK
    first = ask("fast", segs, session="s1")             # a session's first turn: the held exact context
    assert [(s.kind, s.source) for s in first.plan.steps] == [(PlanKind.REUSE, "context")], first.plan.explain()
    assert not first.plan.approx and dict(first.sources)["reused"] == n
    _check_sources(first)
    again = ask("fast", segs, session="s1")             # the session kept it as its context
    assert [(s.kind, s.source) for s in again.plan.steps] == [(PlanKind.REUSE, "session:s1")]
    assert again.plan.steps[0].kv == first.plan.steps[0].kv
    # a longer context starting with the held one: that exact prefix first (not the frame variant and
    # a reposition of south), then the chunk after it by the segment rules
    asyncio.run(router.register_chunk("skill", "default", "east", "Unit 26 was repainted in May."))
    other = ask("fast", segs[:2] + [{"skill": "east"}, segs[2]])
    head, rest = other.plan.steps[0], other.plan.steps[1:]
    assert head.kind is PlanKind.REUSE and head.kv.exact and head.source == "prefix", other.plan.explain()
    assert n - PROMPT_BLOCK < head.tokens <= n and "exact prefix" in head.reason   # whole indexed blocks
    assert [(s.kind, s.source) for s in rest][-1] == (PlanKind.REPOSITION, "skill:east")
    assert all(s.kind is PlanKind.RECOMPUTE and s.source == "skill:south" for s in rest[:-1])
    assert dict(_check_sources(other))["reused"] >= head.tokens
