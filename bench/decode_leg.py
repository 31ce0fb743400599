"""The reference decode leg's suffix forward over a received prefix, three ways (issue 47 item 3),
printed by ``python -m bench.engine`` after the few-token rows:

- ``prefill``: ``ReferenceEngine.prefill(suffix, positions, past)``, which copies ``past`` into a
  new buffer with room for the suffix (the convenience path);
- ``copied``: a :class:`~kvruntime.decode_cache.DecodeSession` built from the block (the context
  copied once into its buffer, then the suffix in place): the decode actor before issue 47;
- ``adopted``: the session adopting the buffer the block was received into (the grant's room:
  ``kvtransport.transfer.blocks.SlotLayout``), so nothing is copied: the decode actor now.

Beside them the byte floor of the suffix forward (weights + the context's K/V read once, as
``bench.engine.costs``) and of the copy the other two add (the context's K/V read and written), at
the measured copy rate and at ``--nominal-gbs`` when given. Interleaved repetitions, medians.
"""
from __future__ import annotations

import statistics
import time

import torch


def copy_gbs(nbytes: int, dev="cpu") -> float:
    """GB/s of a warm ``Tensor.copy_`` of ``nbytes`` on ``dev`` (bytes moved once per second,
    median of 5): the rate the byte floors of a KV move are computed at."""
    x = torch.ones(max(1, nbytes // 4), device=dev)
    y = torch.empty_like(x)
    ts = []
    for _ in range(5):
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        y.copy_(x)
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(ts) / 1e9


def decode_leg_rows(e, cached: int, reps: int, dev, fl, vocab: int, nominal_gbs: float | None, costs, timed) -> None:
    from kvruntime.decode_cache import DecodeSession
    from kvruntime.kv import KVCache
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    ids = torch.randint(100, vocab, (cached,), generator=g).to(dev)
    pos = torch.arange(cached, device=dev)
    nominal = f"{nominal_gbs:.0f} GB/s nominal" if nominal_gbs else "nominal bandwidth not given (--nominal-gbs)"
    print(f"\n| suffix tokens over {cached} received (random KV) | prefill (copies past) | session, copied "
          f"| session, adopted (no copy) | adopted/copied | forward floor at {fl.bw / 1e9:.1f} GB/s copy "
          f"| + copy floor | forward floor at {nominal} |")
    print("|---|---|---|---|---|---|---|---|")
    for q in (1, 4, 8):
        sfx = torch.randint(100, vocab, (q,), generator=g).tolist()
        room = q + 16
        buf = torch.randn(e.num_layers, 2, e.kv_heads, cached + room, e.head_dim, device=dev, dtype=e.dtype)
        recv = KVCache(buf[:, :, :, :cached], pos, ids)          # the block as received with room
        plain = KVCache(buf[:, :, :, :cached].contiguous(), pos, ids)   # the same block received plain
        span = range(cached, cached + q)

        def prefill(_):
            e.prefill(sfx, torch.tensor(list(span)), plain, logits=True)

        def copied(_):
            DecodeSession(e, plain, room).step(sfx, span)

        def adopted(_):
            s = DecodeSession(e, recv, room, buffer=buf)
            assert s.copied_bytes == 0 and s.data is buf
            s.step(sfx, span)
        tp, tc, ta = [], [], []
        for _ in range(reps):                       # interleaved: the load drifts on a shared machine
            tp.append(timed(prefill, 1, dev))
            tc.append(timed(copied, 1, dev))
            ta.append(timed(adopted, 1, dev))
        a = DecodeSession(e, recv, room, buffer=buf).step(sfx, span)
        c = DecodeSession(e, plain, room).step(sfx, span)
        fwd = costs(e, q, cached + q)[1]
        copy = 2 * plain.nbytes
        at_nominal = f"{fwd / (nominal_gbs * 1e9) * 1e3:.2f} ms" if nominal_gbs else "-"
        t_p, t_c, t_a = (statistics.median(t) for t in (tp, tc, ta))
        print(f"| {q} | {t_p * 1e3:.1f} ms | {t_c * 1e3:.1f} ms | {t_a * 1e3:.1f} ms | {t_a / t_c:.2f}x | "
              f"{fwd / fl.bw * 1e3:.2f} ms | {copy / fl.bw * 1e3:.2f} ms | {at_nominal} | "
              f"(adopted vs copied logits {'bit-equal' if torch.equal(a, c) else 'differ'})", flush=True)
