"""The reference decode leg's suffix forward over a received prefix, four ways (issue 47 item 3),
printed by ``python -m bench.engine`` after the few-token rows:

- ``prefill, past copied``: ``ReferenceEngine.prefill(suffix, positions, past)`` with ``past`` a
  plain KVCache, copied once into a new buffer with room for the suffix (the convenience path);
- ``prefill into the receive buffer``: the same call with ``past`` the
  :class:`~kvruntime.kv.KVBuffer` the block was received into (``KVBuffer.holding``): the suffix's
  K/V go into its room, nothing is copied;
- ``copied``: a :class:`~kvruntime.decode_cache.DecodeSession` built from the block (the context
  copied once into its buffer, then the suffix in place): the decode actor before issue 47;
- ``adopted``: the session adopting the buffer the block was received into (the grant's room:
  ``kvtransport.transfer.blocks.SlotLayout``), so nothing is copied: the decode actor now.

Beside them the byte floor of the suffix forward (weights + the context's K/V read once, as
``bench.engine.costs``) and of the copy the copying ones add (the context's K/V read and written), at
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


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def decode_leg_rows(e, cached: int, reps: int, dev, fl, vocab: int, nominal_gbs: float | None, costs, timed) -> None:
    from kvruntime.decode_cache import DecodeSession
    from kvruntime.kv import KVBuffer, KVCache
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    ids = torch.randint(100, vocab, (cached,), generator=g).to(dev)
    pos = torch.arange(cached, device=dev)
    nominal = f"{nominal_gbs:.0f} GB/s nominal" if nominal_gbs else "nominal bandwidth not given (--nominal-gbs)"
    print(f"\nload average {_load()} (1/5/15 min) before the decode-leg rows")
    print(f"\n| suffix tokens over {cached} received (random KV) | prefill, past copied (before) "
          f"| prefill into the receive buffer (now) | session, copied | session, adopted (no copy) "
          f"| prefill now / adopted | adopted/copied | forward floor at {fl.bw / 1e9:.1f} GB/s copy "
          f"| + copy floor | forward floor at {nominal} |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for q in (1, 4, 8):
        sfx = torch.randint(100, vocab, (q,), generator=g).tolist()
        room = q + 16
        buf = torch.randn(e.num_layers, 2, e.kv_heads, cached + room, e.head_dim, device=dev, dtype=e.dtype)
        recv = KVCache(buf[:, :, :, :cached], pos, ids)          # the block as received with room
        plain = KVCache(buf[:, :, :, :cached].contiguous(), pos, ids)   # the same block received plain
        span = range(cached, cached + q)
        at = torch.tensor(list(span), device=dev)

        def prefill(_):
            e.prefill(sfx, at, plain, logits=True)

        def in_place(_):
            c = e.copied_bytes
            e.prefill(sfx, at, KVBuffer.holding(buf, recv), logits=True)
            assert e.copied_bytes == c

        def copied(_):
            DecodeSession(e, plain, room).step(sfx, span)

        def adopted(_):
            s = DecodeSession(e, recv, room, buffer=buf)
            assert s.copied_bytes == 0 and s.data is buf
            s.step(sfx, span)
        ts = {f: [] for f in (prefill, in_place, copied, adopted)}
        for _ in range(reps):                       # interleaved: the load drifts on a shared machine
            for f, t in ts.items():
                t.append(timed(f, 1, dev))
        a = DecodeSession(e, recv, room, buffer=buf).step(sfx, span)
        c = DecodeSession(e, plain, room).step(sfx, span)
        p = e.prefill(sfx, at, KVBuffer.holding(buf, recv), logits=True).logits
        fwd = costs(e, q, cached + q)[1]
        copy = 2 * plain.nbytes
        at_nominal = f"{fwd / (nominal_gbs * 1e9) * 1e3:.2f} ms" if nominal_gbs else "-"
        t_p, t_i, t_c, t_a = (statistics.median(t) for t in ts.values())
        same = "bit-equal" if torch.equal(a, c) and torch.equal(p, a) else "differ"
        print(f"| {q} | {t_p * 1e3:.1f} ms | {t_i * 1e3:.1f} ms | {t_c * 1e3:.1f} ms | {t_a * 1e3:.1f} ms | "
              f"{t_i / t_a:.2f}x | {t_a / t_c:.2f}x | {fwd / fl.bw * 1e3:.2f} ms | {copy / fl.bw * 1e3:.2f} ms | "
              f"{at_nominal} | (logits: prefill now, adopted, copied {same})", flush=True)
    print(f"\nload average {_load()} after the decode-leg rows")
