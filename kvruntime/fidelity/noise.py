"""The fp noise floor of first-token logits, to judge near-tie flips in the compose sweep.

``python -m kvruntime.fidelity.noise --model smollm2-135m [--cases 4]``: on the first answered
compose cases, full recompute vs ``compose(..., recompute_ratio=1.0)``, which is mathematically
the same computation in a different order (the chunks' KV recomputed in one forward against
the spliced context). The max |logit difference| is the size of perturbation fp32 reordering
alone causes; a top-1 flip whose recompute top-1/top-2 margin is above it is not fp noise.
"""
from __future__ import annotations

import argparse


def main(argv=None) -> int:
    import torch

    from kvruntime.engine import ReferenceEngine
    from kvruntime.fidelity.cases import load_compose_cases, load_passages
    from kvruntime.ops.frame import chat_frame
    from kvruntime.ops import ChunkSegment, TextSegment, compose, precompile_chunk, recompute

    ap = argparse.ArgumentParser(prog="python -m kvruntime.fidelity.noise")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cases", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.cases < 1:
        ap.error("--cases must be >= 1")
    e = ReferenceEngine(args.model, threads=args.threads)
    pre, suffix = chat_frame(e), e.spec.chat_user_suffix
    passages = load_passages()
    print("| model | case | max abs logit diff | mean abs logit diff | recompute top-1/top-2 margin | same top-1 |")
    print("|---|---|---|---|---|---|")
    for c in [c for c in load_compose_cases() if c.answers][: args.cases]:
        q = e.encode(c.question + suffix)
        cids = {p: e.encode(passages[p].strip() + "\n\n") for p in c.chunks}
        ids = pre + [t for p in c.chunks for t in cids[p]] + q
        full = recompute(e, ids).logits.float()
        segs = ([TextSegment(pre)] + [ChunkSegment(precompile_chunk(e, cids[p])) for p in c.chunks]
                + [TextSegment(q)])
        r1 = compose(e, segs, seam_tokens=1, recompute_ratio=1.0).logits.float()
        d = (full - r1).abs()
        top2 = torch.topk(full, 2).values
        print(f"| {args.model} | {c.id} | {float(d.max()):.1e} | {float(d.mean()):.1e} | "
              f"{float(top2[0] - top2[1]):.3f} | {'yes' if int(full.argmax()) == int(r1.argmax()) else 'no'} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
