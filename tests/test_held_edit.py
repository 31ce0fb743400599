"""A prompt equal to a held one except one span, planned (``cluster.control.edit_plan``) and built
by the real prefill executor on SmolLM2: edit-in-place of the held KV with a span of another
length is what ``kvruntime.ops.edit_in_place`` gives; the prefix-then-recompute plan of ``exact``
is a recompute's KV (to float rounding: the rest is computed after the loaded prefix)."""
import pytest
import torch

from cluster.control.planner import (EditChoice, HeldPromptEdit, PlannerConfig, RenderedRequest, RenderedSegment,
                                     TierView, plan_request)
from kvruntime.messages.plan import KVRef, PlanKind, Policy
from kvruntime.ops import edit_in_place, recompute
from prefill_workers.executor import PrefillExecutor
from tests.conftest import DictSource

SALT = "e4" * 16
RECORD = ("Helpdesk ticket #88214\nCustomer: Dana Whitfield\nStatus: {status}\nOpened: 3 March, by e-mail.\n"
          + "The customer reports that the invoice export stops at page 12 and the totals row is missing. "
            "Support reproduced it with the sample file and escalated it to the billing team. " * 12
          + "\nWhat is the status of the ticket?")


def _ids(e, status):
    return tuple(e.encode(RECORD.format(status=status)))


def _held(smol, src):
    """The held prompt's KV stored at position 0 (an earlier request computed it)."""
    old = _ids(smol, "OPEN")
    ref = KVRef(old, 0, SALT)
    src.put(ref, recompute(smol, list(old), logits=False).kv)
    return ref


def _edit(smol, held: KVRef, status: str) -> HeldPromptEdit:
    new, old = _ids(smol, status), held.token_ids
    start = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
    tail = next(k for k in range(1, len(old)) if old[-k] != new[-k]) - 1     # equal tokens at the end
    return HeldPromptEdit(held, start, len(old) - tail, new[start:len(new) - tail], where=f"token {start}")


def _plan(he, policy, cfg=PlannerConfig()):
    req = RenderedRequest("r1", "smollm2-135m", policy, (RenderedSegment("prompt", None, he.new_token_ids),), (13,))
    return plan_request(req, TierView(held_edit=he), None, lambda t: [], cfg)


@pytest.mark.slow
def test_a_held_prompt_is_edited_in_place_with_a_span_of_another_length(smol):
    src = DictSource(smol)
    held = _held(smol, src)
    he = _edit(smol, held, "RESOLVED AND CLOSED BY BILLING")
    assert len(he.new_ids) != he.held_end - he.start and len(held.token_ids) > 256
    cfg = PlannerConfig(edit=EditChoice(PlanKind.EDIT_IN_PLACE, top_k=16, reason="t"))
    plan = _plan(he, Policy.FAST, cfg)
    assert [s.kind for s in plan.steps] == [PlanKind.EDIT_IN_PLACE]
    kv, st = PrefillExecutor(smol, src, None).build(plan)
    want = edit_in_place(smol, src.get(held), (he.start, he.held_end), list(he.new_ids), 16)
    assert st.fallbacks == [] and kv.token_ids.tolist() == list(he.new_token_ids)
    assert kv.positions.tolist() == list(range(len(he.new_token_ids)))
    assert torch.equal(kv.data, want.kv.data)
    assert st.computed == plan.steps[0].computed == len(he.new_ids) + 16


@pytest.mark.slow
def test_exact_reuses_the_held_prefix_and_recomputes_from_the_divergence(smol):
    src = DictSource(smol)
    held = _held(smol, src)
    he = _edit(smol, held, "CLOSED")
    piece = 8                                     # DictSource holds whole entries: let the prefix be one
    src.put(KVRef(held.token_ids[:he.start // piece * piece], 0, SALT),
            recompute(smol, list(held.token_ids[:he.start // piece * piece]), logits=False).kv)
    plan = _plan(he, Policy.EXACT, PlannerConfig(kv_piece_tokens=piece))
    assert [s.kind for s in plan.steps] == [PlanKind.REUSE, PlanKind.RECOMPUTE] and not plan.approx
    kv, st = PrefillExecutor(smol, src, None).build(plan)
    full = recompute(smol, list(he.new_token_ids), logits=False).kv
    assert st.fallbacks == [] and st.reused == plan.steps[0].tokens
    assert torch.allclose(kv.data, full.data, atol=1e-5, rtol=0)
