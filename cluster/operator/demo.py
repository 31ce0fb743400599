"""``kvnotes demo``: compose and edit on a real model, printing each step and its fidelity.

This is the README's run command until the cluster serves requests: it shows the two ideas
(compose precompiled notes by repositioning; fix an edited field with an erratum) on the
embedded default model, each next to a full recompute of the same context.
"""
from __future__ import annotations

import time

# The skill `kvnotes run` registers and the question its start-up message and the README ask
# (tests/test_demo_answer.py checks the default model's greedy answer contains DEMO_FACT).
DEMO_SKILL_NAME = "refund-policy"
DEMO_SKILL = ("Refund policy: customers may return unused items within 30 days of delivery for a full refund. "
              "Opened electronics can be returned within 14 days with a 15 percent restocking fee. Gift cards and "
              "perishable food are never refundable.")
DEMO_QUESTION = "What is the restocking fee for opened electronics?"
DEMO_FACT = ("15%", "15 percent")     # accepted answers (any one, whole word, case-insensitive)

SKILLS = {
    "refund-policy": ("Refund policy: customers may return unused items within 30 days of delivery for a "
                      "full refund. Opened electronics can be returned within 14 days with a 15 percent "
                      "restocking fee. Gift cards and perishable food are never refundable. Refunds go back "
                      "to the original payment method within 5 business days."),
    "user-42": ("Customer memory: Dana Whitfield, customer since 2019, lives in Leeds. She bought a "
                "Kestrel 3 espresso machine on March 2, opened it, and reports that the steam wand leaks."),
}
QUESTION = "Can Dana return the espresso machine, and is there a fee? Answer briefly."
BOOKING = ("Booking record 88231. Passenger: Omar Haddad. Flight LX318 from Zurich to Lisbon, "
           "departing 09:40. Flight status: {status}. Seat 14C, one checked bag. If a flight is "
           "cancelled, passengers must be rebooked on the next available flight at no charge; "
           "delayed or on-time flights keep their original booking.\n")
EDIT_QUESTION = "What is the status of flight LX318? Answer in one word."


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def run_demo(model: str = "smollm2-135m", threads: int | None = None) -> int:
    """Load the model, precompile the chunks, compose them against full recompute, then edit a
    field against full recompute: each step printed with its timing and fidelity."""
    from kvruntime.engine import ReferenceEngine
    from kvruntime.ops.frame import chat_frame

    print(f"== kvnotes demo on {model} (reference engine, CPU, fp32)")
    engine, secs = _timed(lambda: ReferenceEngine(model, threads=threads))
    rope = engine.rope
    print(f"loaded in {secs:.1f} s; RoPE re-rotation self-test: "
          f"{'passed' if rope.enabled else 'FAILED (reposition disabled)'} (rel. error {rope.self_test_error:.1e})")
    pre, suffix = chat_frame(engine), engine.spec.chat_user_suffix
    chunks = _precompile(engine)
    _compose_step(engine, chunks, pre, suffix)
    _edit_step(engine, pre, suffix)
    print("\nNext: `kvnotes eval fidelity --model smollm2-135m` measures every operation on the shipped cases.")
    return 0


def _precompile(engine) -> dict:
    from kvruntime.ops import precompile_chunk

    print("\n-- 1. precompile skills and memories (each at its canonical position, after BOS)")
    chunks = {}
    for name, text in SKILLS.items():
        ids = engine.encode(text + "\n\n")
        kv, secs = _timed(lambda: precompile_chunk(engine, ids))
        chunks[name] = kv
        print(f"   {name}: {len(ids)} tokens, {kv.nbytes / 2**20:.1f} MiB of KV, {secs * 1000:.0f} ms")
    return chunks


def _compose_step(engine, chunks: dict, pre: list[int], suffix: str) -> None:
    from kvruntime.fidelity.metrics import kl_divergence
    from kvruntime.ops import ChunkSegment, TextSegment, compose, recompute

    print("\n-- 2. compose: [system] + refund-policy + user-42 + question")
    q = engine.encode(QUESTION + suffix)
    segs = [TextSegment(pre), ChunkSegment(chunks["refund-policy"]), ChunkSegment(chunks["user-42"]), TextSegment(q)]
    if engine.rope.enabled:
        plan = [("system prefix", "compute", len(pre)), ("refund-policy", "reposition + seam 1", chunks["refund-policy"].num_tokens),
                ("user-42", "reposition + seam 1", chunks["user-42"].num_tokens), ("question", "compute", len(q))]
        for seg, action, n in plan:
            print(f"   plan: {seg:<14} -> {action:<20} ({n} tokens)")
        res, t_comp = _timed(lambda: compose(engine, segs, seam_tokens=1))
    else:
        print("   reposition disabled by the self-test: falling back to recompute")
        res, t_comp = None, None
    ids = pre + [int(t) for c in ("refund-policy", "user-42") for t in engine.encode(SKILLS[c] + "\n\n")] + q
    full, t_full = _timed(lambda: recompute(engine, ids))
    full_ans = engine.decode(engine.greedy(full.kv, full.logits, 32, stop_at_eos=True))
    print(f"   full recompute: {len(ids)} tokens in {t_full * 1000:.0f} ms -> {full_ans!r}")
    if res is not None:
        ans = engine.decode(engine.greedy(res.kv, res.logits, 32, stop_at_eos=True))
        print(f"   composed: {res.computed_tokens} computed + {res.reused_tokens} reused in {t_comp * 1000:.0f} ms "
              f"-> {ans!r}")
        print(f"   fidelity: KL(recompute || composed) = {kl_divergence(full.logits, res.logits):.4f} nats, "
              f"top-1 {'agrees' if full.logits.argmax() == res.logits.argmax() else 'differs'}")


def _edit_step(engine, pre: list[int], suffix: str) -> None:
    from kvruntime.ops import erratum, recompute

    print("\n-- 3. edit: the cached booking says ON TIME; the field changes to CANCELLED")
    old_ids = pre + engine.encode(BOOKING.format(status="ON TIME"))
    cached, secs = _timed(lambda: recompute(engine, old_ids, logits=False).kv)
    print(f"   cached old context: {cached.num_tokens} tokens ({secs * 1000:.0f} ms, done earlier in a real session)")
    q2 = engine.encode(EDIT_QUESTION + suffix)
    fix, t_fix = _timed(lambda: erratum(engine, cached, "flight status", "ON TIME", "CANCELLED"))
    print(f"   plan: erratum, old context reused whole, appended {fix.text.strip()!r} ({len(fix.token_ids)} tokens, "
          f"{t_fix * 1000:.0f} ms)")
    _, got = engine.continue_greedy(fix.kv, q2, 16)        # the context copied once, with room (not 3 times)
    ans = engine.decode(got)
    new_ids = pre + engine.encode(BOOKING.format(status="CANCELLED")) + q2
    oracle, t_or = _timed(lambda: recompute(engine, new_ids))
    oracle_ans = engine.decode(engine.greedy(oracle.kv, oracle.logits, 16, stop_at_eos=True))
    print(f"   erratum answer: {ans!r}; full recompute of the edited context ({t_or * 1000:.0f} ms): {oracle_ans!r}")
