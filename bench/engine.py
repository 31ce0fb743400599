"""The reference engine's operations per context length, against the model's own forward and the
device's floor. Run:

``python -m bench.engine [--lengths 1024 2048 4096 8192] [--model smollm2-135m] [--threads 1]``
``python -m bench.engine --device cuda --shape llama3-8b --dtype bfloat16 --lengths 4096 8192 16384 32768``

Per length N (random token ids; chunks of ``--chunk`` tokens precompiled untimed; 1 seam token;
a ``--question``-token question; median of ``--reps``):

- ``recompute``: ``ops.recompute`` (chunked prefill into one buffer);
- ``hf``: the model's own causal forward (transformers' forward, its own attention, ``use_cache``);
- ``compose``: ``ops.compose`` of the chunks + the question;
- ``erratum+q``: an erratum and the question after the cached context (``ops.erratum`` + ``Builder.compute``);
- ``edit K=16``: ``ops.edit_in_place`` of a field near the start;
- pieces: tier read (a copy of the context's KV: the in-process tier's floor), re-rotation of
  the context's keys vs a plain copy of the same bytes (GB/s), the seam forward, the question.

Each timed operation also gets its FLOPs and bytes and the floor they imply on this device
(max of bytes / measured copy bandwidth and FLOPs / measured matmul rate). Then the in-process
target: a 1, 4 and 16-token forward over ``--cached`` tokens, the engine's way (``engine.write``
into the request's buffer) vs :func:`plain_forward` (the model's own modules, one preallocated
buffer, SDPA with lower-right causality and GQA: ~25 lines; llama-family models).

``--shape llama3-8b`` builds a checkpoint of Llama-3.1-8B's real shape with random weights on the
device (transformers' ``LlamaConfig``): a benchmark input only, never served or shipped.

Last, the reference decode leg's suffix forward over ``--cached`` received tokens
(:mod:`bench.decode_leg`): through ``prefill`` with a plain past (copied) and with the buffer it
was received into (in place), a session that copies the block, a session adopting that buffer;
byte floors at the copy rate and at ``--nominal-gbs``; the load average printed with the rows.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.decode_leg import decode_leg_rows
from bench.engine_tables import print_tables

SHAPES = {   # transformers LlamaConfig keyword arguments of real model shapes
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                      rope_theta=500000.0, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=65536, rope_theta=10000.0),
}


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int, dev, setup=None) -> float:
    """Median seconds of ``fn(setup())`` over ``reps`` runs (setup untimed)."""
    ts = []
    for _ in range(reps):
        arg = setup() if setup is not None else None
        _sync(dev)
        t = time.perf_counter()
        fn(arg)
        _sync(dev)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def random_shape_engine(shape: str, device: str, dtype: str):
    """A ReferenceEngine over a random-weight model of ``shape`` built on ``device`` (config and a
    small tokenizer in a temporary directory; the weights never touch the disk)."""
    import transformers as T
    from safetensors.torch import save_file

    from kvruntime.engine import ReferenceEngine
    from kvruntime.models import get_model_spec
    from tests.tiny_checkpoints import tokenizer
    d = Path(tempfile.mkdtemp(prefix=f"bench-{shape}-"))
    tok = tokenizer("llama")
    cfg = T.LlamaConfig(**SHAPES[shape], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg.save_pretrained(d)
    tok.save_pretrained(d)
    save_file({"random_weights_placeholder": torch.zeros(1)}, str(d / "model.safetensors"))
    real = T.AutoModelForCausalLM.from_pretrained

    def build(path, dtype=None, attn_implementation=None, **kw):
        torch.manual_seed(0)
        with torch.device(device):
            m = T.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
        for p in m.parameters():                      # small weights keep activations finite
            p.data.normal_(0, 0.02) if p.dim() > 1 else p.data.fill_(1.0)
        return m
    T.AutoModelForCausalLM.from_pretrained = build
    try:
        return ReferenceEngine(get_model_spec(str(d)), dtype=dtype, device=device, threads=None)
    finally:
        T.AutoModelForCausalLM.from_pretrained = real


class own_attention:
    """Within this block the engine's model runs transformers' own attention (sdpa / eager)."""

    def __init__(self, engine):
        self.cfg, self.impl = engine.model.config, engine.arch.attn_implementation

    def __enter__(self):
        self.prev, self.cfg._attn_implementation = self.cfg._attn_implementation, self.impl

    def __exit__(self, *exc):
        self.cfg._attn_implementation = self.prev


@torch.inference_mode()
def plain_forward(model, ids, k_buf, v_buf, n):
    """The reference: ``ids`` ([q]) after ``n`` cached slots of ``k_buf``/``v_buf`` ([layers, kv_heads,
    capacity, d], one preallocated buffer), with the model's own modules (llama family)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    m, q = model.model, ids.numel()
    pos = torch.arange(n, n + q, device=ids.device)[None]
    h = m.embed_tokens(ids[None])
    cos, sin = m.rotary_emb(h, pos)
    mask = None if q == 1 else (torch.arange(n + q, device=ids.device)[None] <= pos[0, :, None])
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        qs = a.q_proj(x).view(1, q, -1, a.head_dim).transpose(1, 2)
        ks = a.k_proj(x).view(1, q, -1, a.head_dim).transpose(1, 2)
        vs = a.v_proj(x).view(1, q, -1, a.head_dim).transpose(1, 2)
        qs, ks = apply_rotary_pos_emb(qs, ks, cos, sin)
        k_buf[i, :, n:n + q] = ks[0]
        v_buf[i, :, n:n + q] = vs[0]
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, k_buf[i, :, :n + q][None], v_buf[i, :, :n + q][None], attn_mask=mask, scale=a.scaling,
            enable_gqa=True)
        h = h + a.o_proj(o.transpose(1, 2).reshape(1, q, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(m.norm(h[:, -1]))[0].float()


class Floor:
    """This device's copy bandwidth (bytes/s, read + write counted) and matmul rate (FLOP/s)."""

    def __init__(self, dev, dtype):
        x = torch.empty(64 * 2 ** 20 // 4, dtype=torch.float32, device=dev)
        y = torch.empty_like(x)
        s = timed(lambda _: y.copy_(x), 5, dev)
        self.bw = 2 * x.numel() * 4 / s
        n = 1024 if dev.type == "cpu" else 8192
        a = torch.randn(n, n, dtype=dtype, device=dev)
        s = timed(lambda _: a @ a, 3, dev)
        self.flops = 2 * n ** 3 / s

    def seconds(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops, nbytes / self.bw)


def costs(e, q: int, keys: int, full: bool = False):
    """FLOPs and bytes of a forward of ``q`` new tokens over ``keys`` slots (``full``: a causal
    prefill of ``q`` tokens from nothing): weights read once, KV read and written once."""
    cfg, elt = e.model.config, torch.empty(0, dtype=e.dtype).element_size()
    lin = sum(p.numel() for n, p in e.model.named_parameters() if p.dim() == 2 and "embed" not in n)
    heads, d, L = cfg.num_attention_heads, e.head_dim, e.num_layers
    att_keys = (q + 1) / 2 if full else keys
    flops = 2 * lin * q + 4 * L * heads * d * q * att_keys
    kv = 2 * L * e.kv_heads * d * elt
    return flops, lin * elt + kv * (q if full else keys) + kv * q


def _args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.engine")
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=None, help="tokens per precompiled chunk")
    ap.add_argument("--question", type=int, default=45)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cached", type=int, default=4096, help="cached tokens of the few-token target")
    ap.add_argument("--skip", nargs="*", default=[], help="columns to skip (hf, recompute, ...)")
    ap.add_argument("--target-only", action="store_true", help="only the few-token forwards over --cached tokens")
    ap.add_argument("--decode-leg-only", action="store_true", help="only the decode leg's suffix forward rows")
    ap.add_argument("--nominal-gbs", type=float, default=None,
                    help="the device's nominal memory bandwidth (GB/s): a second floor beside the measured copy rate")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler of the question forward at the largest length: top kernels by device time")
    return ap.parse_args(argv)


def length_row(e, n: int, a, chunk: int, lengths: list[int], fl, g, vocab: int) -> dict:
    """One context length's row: recompute, the model's own forward, compose, erratum + question,
    edit in place, and the pieces (tier read, rotate, seam, question) with their floors."""
    from kvruntime.ops import ChunkSegment, TextSegment, compose, edit_in_place, erratum, precompile_chunk, recompute
    from kvruntime.ops.build import Builder
    from kvruntime.ops.compose import reposition

    dev = e.device
    ids = torch.randint(100, vocab, (n,), generator=g).tolist()
    qids = torch.randint(100, vocab, (a.question,), generator=g).tolist()
    r = {"tokens": n}
    if "recompute" not in a.skip:
        r["recompute"] = timed(lambda _: recompute(e, ids, logits=True), a.reps, dev)
    if "hf" not in a.skip:
        x = torch.tensor([ids], device=dev)

        def hf(_):
            with own_attention(e), torch.inference_mode():
                e.model(input_ids=x, use_cache=True, logits_to_keep=1)
        r["hf"] = timed(hf, a.reps, dev)
    chunks = [precompile_chunk(e, ids[s:s + chunk]) for s in range(0, n, chunk)]
    segs = [ChunkSegment(c) for c in chunks] + [TextSegment(qids)]
    r["compose"] = timed(lambda _: compose(e, segs, seam_tokens=1), a.reps, dev)
    ctx = recompute(e, ids, logits=False).kv

    def with_room(extra):
        def setup():
            b = Builder(e, n + extra)
            b.append(ctx)
            return b
        return setup
    r["erratum+q"] = timed(lambda b: (erratum(e, b, "price", "10 euros", "12 euros"), b.compute(qids, logits=True)),
                           a.reps, dev, with_room(64 + a.question))
    field = (32, 36)
    r["edit K=16"] = timed(lambda _: edit_in_place(e, ctx, field, ids[40:45], 16), a.reps, dev)
    # pieces
    out = torch.empty_like(ctx.data)
    r["tier read"] = timed(lambda _: out.copy_(ctx.data), a.reps, dev)
    r["rotate"] = timed(lambda _: reposition(e.rope, ctx, 7, out=out), a.reps, dev)

    def seams(b):
        for s in range(chunk, n, chunk):
            b.seams.append(s)
        b.flush(1)
    r["seam"] = timed(seams, a.reps, dev, with_room(0))
    r["question"] = timed(lambda b: b.compute(qids, logits=True), a.reps, dev, with_room(a.question))
    if a.profile and n == max(lengths):
        profile_question(e, with_room(a.question)(), qids, dev)
    r["kv_bytes"] = ctx.nbytes
    r["floor"] = {
        "recompute": fl.seconds(*costs(e, n, n, full=True)),
        "question": fl.seconds(*costs(e, a.question, n + a.question)),
        "seam": fl.seconds(*costs(e, max(1, n // chunk - 1), n)),
    }
    return r


def main(argv=None) -> int:
    from kvruntime.engine import ReferenceEngine

    a = _args(argv)
    gpu = a.device.startswith("cuda")
    lengths = a.lengths or ([4096, 8192, 16384, 32768] if gpu else [1024, 2048, 4096, 8192])
    dtype = a.dtype or ("bfloat16" if gpu else "float32")
    chunk = a.chunk or (2048 if gpu else 512)
    if a.threads and not gpu:
        torch.set_num_threads(a.threads)
    if a.shape:
        e = random_shape_engine(a.shape, a.device, dtype)
        print(f"model: {a.shape} shape, random weights: a benchmark input only (never served or shipped)")
    else:
        e = ReferenceEngine(a.model, dtype=dtype, device=a.device, threads=a.threads if not gpu else None)
        print(f"model: {a.model}")
    dev = e.device
    name = torch.cuda.get_device_name(dev) if gpu else f"CPU, {torch.get_num_threads()} torch thread(s)"
    fl = Floor(dev, e.dtype)
    print(f"device: {name}; dtype {dtype}; copy {fl.bw / 1e9:.1f} GB/s, matmul {fl.flops / 1e12:.2f} TFLOP/s; "
          f"chunks {chunk} tokens, 1 seam token, {a.question}-token question, median of {a.reps}")
    g = torch.Generator().manual_seed(0)
    vocab = min(e.model.config.vocab_size, 30000)
    rows = []
    if a.decode_leg_only:
        decode_leg_rows(e, a.cached, a.reps, dev, fl, vocab, a.nominal_gbs, costs, timed)
        return 0
    for n in ([] if a.target_only else lengths):
        r = length_row(e, n, a, chunk, lengths, fl, g, vocab)
        rows.append(r)
        print(f"  {n}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r.items() if isinstance(v, float)),
              flush=True)
    if not rows:
        few_token_target(e, a.cached, a.reps, dev, fl, vocab)
        bucketed_rows(e, a.cached, a.reps, dev, fl, vocab, a.nominal_gbs)
        decode_leg_rows(e, a.cached, a.reps, dev, fl, vocab, a.nominal_gbs, costs, timed)
        return 0
    print_tables(rows)
    few_token_target(e, a.cached, a.reps, dev, fl, vocab)
    bucketed_rows(e, a.cached, a.reps, dev, fl, vocab, a.nominal_gbs)
    decode_leg_rows(e, a.cached, a.reps, dev, fl, vocab, a.nominal_gbs, costs, timed)
    return 0


def profile_question(e, builder, qids, dev, top: int = 14) -> None:
    """Where a question forward's time goes: torch.profiler, kernels by self device time."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as p:
        builder.compute(qids, logits=True)
        _sync(dev)
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    print(f"\nprofile: {len(qids)}-token question over {builder.length - len(qids)} cached tokens")
    print(p.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60))


def few_token_target(e, cached: int, reps: int, dev, fl, vocab: int) -> None:
    """1, 4 and 16 tokens over ``cached`` slots: the engine's way vs :func:`plain_forward`."""
    from kvruntime.ops.build import Builder
    if e.arch.model_type != "llama":
        print(f"\n(few-token target: plain_forward covers the llama family only, not {e.arch.model_type})")
        return
    from kvruntime.kv import KVCache
    g = torch.Generator().manual_seed(1)
    # the cached KV's values do not change the cost: random KV instead of a 4k-token prefill
    torch.manual_seed(1)
    data = torch.randn(e.num_layers, 2, e.kv_heads, cached, e.head_dim, device=dev, dtype=e.dtype)
    ctx = KVCache(data, torch.arange(cached, device=dev),
                  torch.randint(100, vocab, (cached,), generator=g).to(dev))
    print(f"\n| new tokens over {cached} cached (random KV) | engine.write | plain in-place reference | ratio | floor |")
    print("|---|---|---|---|---|")
    for q in (1, 4, 16):
        ids = torch.randint(100, vocab, (q,), generator=g)
        b = Builder(e, cached + q)
        b.append(ctx)
        kb = ctx.data[:, 0].new_empty(e.num_layers, e.kv_heads, cached + q, e.head_dim)
        vb = torch.empty_like(kb)
        kb[:, :, :cached], vb[:, :, :cached] = ctx.data[:, 0], ctx.data[:, 1]
        x = ids.to(dev)

        def ours(_):
            b.buf.length = cached
            b.compute(ids.tolist(), logits=True)
        t1, t2 = [], []
        for _ in range(reps):                       # interleaved: the load drifts on a shared machine
            t1.append(timed(ours, 1, dev))
            t2.append(timed(lambda _: plain_forward(e.model, x, kb, vb, cached), 1, dev))
        t_ours, t_ref = statistics.median(t1), statistics.median(t2)
        b.buf.length = cached
        got = b.compute(ids.tolist(), logits=True)
        want = plain_forward(e.model, x, kb, vb, cached)
        diff = float((got - want).abs().max())
        print(f"| {q} | {t_ours * 1e3:.1f} ms | {t_ref * 1e3:.1f} ms | {t_ours / t_ref:.2f}x | "
              f"{fl.seconds(*costs(e, q, cached + q)) * 1e3:.1f} ms | (logits max diff {diff:.1e})")


def bucketed_rows(e, cached: int, reps: int, dev, fl, vocab: int, nominal_gbs: float | None) -> None:
    """1, 3, 4, 16 and 45 new tokens over ``cached`` slots (``engine.write`` through a Builder):
    eager (each at its own shape) vs bucketed (padded to 1, 4, 4, 16, 64; keys through a length),
    interleaved; the byte floor at the measured copy rate and at ``nominal_gbs`` when given."""
    from kvruntime.buckets import bucket_for
    from kvruntime.config.choices import ForwardShapes
    from kvruntime.kv import KVCache
    from kvruntime.ops.build import Builder
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    data = torch.randn(e.num_layers, 2, e.kv_heads, cached, e.head_dim, device=dev, dtype=e.dtype)
    ctx = KVCache(data, torch.arange(cached, device=dev), torch.randint(100, vocab, (cached,), generator=g).to(dev))
    nominal = f"{nominal_gbs:.0f} GB/s nominal" if nominal_gbs else "nominal bandwidth not given (--nominal-gbs)"
    print(f"\n| new tokens over {cached} cached (random KV) | bucket | eager | bucketed | bucketed/eager "
          f"| byte floor at {fl.bw / 1e9:.1f} GB/s copy | at {nominal} |")
    print("|---|---|---|---|---|---|---|")
    prev = e.shapes
    try:
        for q in (1, 3, 4, 16, 45):
            ids = torch.randint(100, vocab, (q,), generator=g).tolist()
            b = Builder(e, cached + q)
            b.append(ctx)

            def run(kind):
                e.shapes = ForwardShapes.of(kind)
                b.buf.length = cached
                return b.compute(ids, logits=True)
            te, tb = [], []
            for _ in range(reps):                   # interleaved: the load drifts on a shared machine
                te.append(timed(lambda _: run("eager"), 1, dev))
                tb.append(timed(lambda _: run("bucketed"), 1, dev))
            diff = float((run("bucketed") - run("eager")).abs().max())
            nbytes = costs(e, q, cached + q)[1]
            at_nominal = f"{nbytes / (nominal_gbs * 1e9) * 1e3:.2f} ms" if nominal_gbs else "-"
            t_e, t_b = statistics.median(te), statistics.median(tb)
            print(f"| {q} | {bucket_for(q)} | {t_e * 1e3:.1f} ms | {t_b * 1e3:.1f} ms | {t_b / t_e:.2f}x | "
                  f"{nbytes / fl.bw * 1e3:.2f} ms | {at_nominal} | (logits max diff {diff:.1e})", flush=True)
    finally:
        e.shapes = prev


if __name__ == "__main__":
    raise SystemExit(main())
