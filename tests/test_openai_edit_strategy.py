"""``edit_strategy`` on the OpenAI endpoints (issue 44 item 3), without a cluster: the field is
checked like the native API's on chat completions, completions and Responses (a bad value is a
400 naming it, before anything is planned); a prompt found one span away from a held one is planned
as the erratum only when asked for, under ``fast`` and under ``balanced`` where the profile's row
approves it (else recomputed from the divergence, the row cited); ``explain`` says which strategy
was asked and what was planned. In process through the router and real executors: the erratum a
chat client asks for runs (the model reads the held prompt + the correction, nothing of it stored
under the request's tokens). tests/test_e2e_openai_edit_strategy.py does it with the `openai`
client on the real cluster."""
import asyncio
import dataclasses
import json

import pytest

from cluster.control.compose_choice import FidelityTarget, choose_edits_by_answers
from cluster.control.context import RequestContext
from cluster.control.errors import RequestError
from cluster.control.limits import RequestLimits
from cluster.control.planner import HeldPromptEdit, PlannerConfig, RenderedSegment, TierView, plan_request
from cluster.http.errors import error_response
from cluster.http.responses_body import responses_request
from cluster.http.validate import EDIT_STRATEGIES, openai_request
from kvruntime.messages.decode import SamplingParams, TokenEvent
from kvruntime.messages.plan import KVRef, PlanKind, Policy
from tests.test_planner import SALT, edit_profile, edit_row, encode, req

LIMITS = RequestLimits()
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
TEXT = {"prompt": "hi"}


def _openai(body, chat=True):
    return openai_request(body, LIMITS, model="m", vocab=1000, chat=chat)


def test_edit_strategy_is_an_extra_body_field_of_every_openai_endpoint():
    for chat, body in ((True, CHAT), (False, TEXT)):
        assert _openai(body, chat).edit == "auto"
        assert _openai({**body, "edit_strategy": None}, chat).edit == "auto"
        for v in EDIT_STRATEGIES:
            assert _openai({**body, "edit_strategy": v}, chat).edit == v
        for bad in ("guess", "ERRATUM", 3, ["erratum"], {"erratum": True}, True):
            with pytest.raises(RequestError) as e:
                _openai({**body, "edit_strategy": bad}, chat)
            assert e.value.status == 400 and e.value.param == "edit_strategy"
            assert "auto, erratum, edit_in_place" in e.value.message
    # Responses: passed on to the chat body it runs as, checked there
    r = responses_request({"input": "hi", "edit_strategy": "erratum"}, LIMITS, default_max_tokens=16)
    assert r.chat["edit_strategy"] == "erratum" and _openai({**r.chat, **CHAT}).edit == "erratum"
    r = responses_request({"input": "hi", "edit_strategy": "nope"}, LIMITS, default_max_tokens=16)
    with pytest.raises(RequestError, match="edit_strategy must be one of"):
        _openai({**r.chat, **CHAT})


def test_a_bad_edit_strategy_is_an_openai_shaped_400_with_the_request_id():
    with pytest.raises(RequestError) as e:
        _openai({**CHAT, "edit_strategy": "guess"})
    resp = error_response(e.value, "rid-44")
    body = json.loads(resp.body)
    assert resp.status_code == 400
    assert body == {"error": {"message": "edit_strategy must be one of auto, erratum, edit_in_place",
                              "type": "invalid_request_error", "param": "edit_strategy", "code": None,
                              "request_id": "rid-44"}}


# ---- planning a found edit by the asked strategy ---------------------------------------------------
HELD = tuple(range(1000, 1600))         # a held prompt of 600 tokens


def found(**kw) -> HeldPromptEdit:
    return HeldPromptEdit(KVRef(HELD, 0, SALT), 400, 402, (7, 7, 7), where="message 0 (system), token 400",
                          label="status", old_text="in transit", new_text="delivered", **kw)


def _plan(policy, strategy, cfg=PlannerConfig()):
    he = found()
    r = dataclasses.replace(req(RenderedSegment("prompt", None, he.new_token_ids), policy=policy),
                            edit_strategy=strategy)
    return plan_request(r, TierView(held_edit=he), None, encode, cfg)


def _verdicts(summary):
    return choose_edits_by_answers(summary, FidelityTarget.answers(), model="m")


def test_the_erratum_asked_for_under_fast_is_planned_and_explain_says_so_with_the_row():
    cfg = PlannerConfig(balanced_edits=_verdicts(edit_profile(edit_row(), edit_row(top1=0.7))))
    p = _plan(Policy.FAST, "erratum", cfg)
    assert [s.kind for s in p.steps] == [PlanKind.REUSE, PlanKind.ERRATUM] and p.steps[0].token_ids == HELD
    assert p.steps[1].token_ids == tuple(encode("\nCorrection: the status is now delivered.\n"))
    assert "requested by the caller (policy fast (the profile does not gate it; balanced: m edit_answers row " \
           "'erratum: correction' misses the answer target" in p.steps[1].reason
    assert p.notes[-1] == ("edit_strategy erratum (asked by the caller: the held prompt + an appended correction): "
                           "planned the erratum under policy fast")
    auto = _plan(Policy.FAST, "auto", cfg)                       # not asked: edit-in-place
    assert [s.kind for s in auto.steps] == [PlanKind.EDIT_IN_PLACE]
    assert auto.notes[-1].startswith("edit_strategy auto (the default: edit-in-place where the policy allows it, "
                                     "the erratum only when asked): planned edit-in-place under policy fast")


def test_the_erratum_asked_for_under_balanced_follows_the_row():
    no = PlannerConfig(balanced_edits=_verdicts(edit_profile(edit_row(), edit_row(top1=0.7))))
    p = _plan(Policy.BALANCED, "erratum", no)
    assert [(s.kind, s.tokens) for s in p.steps] == [(PlanKind.REUSE, 256), (PlanKind.RECOMPUTE, 601 - 256)]
    assert p.steps[0].kv.exact and not p.approx
    assert any(n.startswith("erratum requested but not planned (balanced: m edit_answers row 'erratum: correction' "
                            "misses the answer target: top-1 agreement 70%") for n in p.notes), p.notes
    assert p.notes[-1] == ("edit_strategy erratum (asked by the caller: the held prompt + an appended correction): "
                           "planned the exact prefix (256 tokens) + a recompute from the divergence under policy "
                           "balanced")
    yes = PlannerConfig(balanced_edits=_verdicts(edit_profile(edit_row(), edit_row())))
    p = _plan(Policy.BALANCED, "erratum", yes)
    assert [s.kind for s in p.steps] == [PlanKind.REUSE, PlanKind.ERRATUM]
    assert "row 'erratum: correction' meets the answer target" in p.steps[1].reason
    p = _plan(Policy.EXACT, "erratum", yes)                      # exact: never, whatever the row
    assert PlanKind.ERRATUM not in {s.kind for s in p.steps} and any("policy exact" in n for n in p.notes)


def test_the_shipped_smollm2_profile_declines_the_erratum_under_balanced():
    from kvruntime.fidelity.profiles import find_profile
    from kvruntime.models import get_model_spec
    summary = find_profile(get_model_spec("smollm2-135m")).summary
    cfg = PlannerConfig(balanced_edits=choose_edits_by_answers(summary, FidelityTarget.answers(),
                                                               model="smollm2-135m"))
    p = _plan(Policy.BALANCED, "erratum", cfg)
    assert PlanKind.ERRATUM not in {s.kind for s in p.steps}
    assert any("smollm2-135m edit_answers row 'erratum: correction' misses the answer target" in n for n in p.notes)
    fast = _plan(Policy.FAST, "erratum", cfg)
    assert fast.steps[-1].kind is PlanKind.ERRATUM and "row 'erratum: correction' misses" in fast.steps[-1].reason


# ---- in process: router + real executors -----------------------------------------------------------
from tests.test_prompt_match import record, rig  # noqa: E402,F401  (the in-process router fixture)


async def _ask(router, ids, policy, edit="auto"):
    toks, fin = [], None
    async for ev in router.stream_prompt(RequestContext.local("default", policy=policy), list(ids),
                                         sampling=SamplingParams(max_tokens=4, temperature=0), edit=edit):
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
        else:
            fin = ev
    await router.matcher.recurring.drain()
    return toks, fin


@pytest.mark.slow
def test_an_erratum_a_plain_prompt_asks_for_runs_and_reads_the_held_prompt_plus_the_correction(smol, rig):
    router, _, _ = rig
    q = smol.encode("Question: what is the order's status? Answer:")
    held = smol.encode(record("shipped")) + q
    _, first = asyncio.run(_ask(router, held, "exact"))
    assert first.stored
    toks, fin = asyncio.run(_ask(router, smol.encode(record("delayed")) + q, "fast", edit="erratum"))
    plan = fin.plan
    assert [s.kind for s in plan.steps] == [PlanKind.REUSE, PlanKind.ERRATUM], plan.notes
    assert plan.steps[0].token_ids == tuple(held[:-1])            # the held prompt, reused whole
    correction = smol.tokenizer.decode(list(plan.steps[1].token_ids))
    assert "status" in correction and "delayed" in correction, correction
    assert not fin.stored and fin.summary.completion_tokens == len(toks) > 0   # nothing stored under its tokens
    assert any(n.startswith("edit_strategy erratum (asked by the caller") and "planned the erratum" in n
               for n in plan.notes), plan.notes
    # the model read held prompt + correction + the prompt's last token: a recompute of those gives the same answer
    exact, _ = asyncio.run(_ask(router, list(plan.prefix_ids + plan.suffix_ids), "exact"))
    assert toks == exact
