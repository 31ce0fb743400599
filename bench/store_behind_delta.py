"""Store-behind's delta on a growing conversation: the prefill worker's time per store when it
compiles only what the tier lacks (continuing from the previous turn's stored KV,
``prefill_workers.store_delta``) against compiling every turn's prompt from position 0, side by
side in one run (the two modes interleaved turn by turn, under two tenants' salts so neither
finds the other's KV), through ``StoreBehind`` itself: the real prompt index and decode-held
record on SQLite, the real LMCache tier, the shipped SmolLM2-135M on the CPU in fp32.

    python -m bench.store_behind_delta [--turns 6] [--system 300] [--turn-tokens 120]

Per turn: the prompt's length, the tokens each mode computed and the prefill worker's seconds
(``PrecompileInfo.seconds``), and the largest difference between the two stored KVs (the delta
equals a compile from 0 within the engine's float tolerance). Prints ``uptime`` with the table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile

import torch

SYSTEM = ("System: you are the booking assistant of a ferry company. Tools: find_departures(port, date), "
          "book(departure_id, passengers), refund(booking_id, reason). Fares: adults 210 kroner, children half. ")
TURN = ("User: which ferries leave Tromso for Skjervoy tomorrow morning, and is there room for two adults?\n"
        "Assistant: find_departures(port='Tromso', date='tomorrow') returned 08:15 and 16:40; both have room. ")


class _Tier:
    """Backends whose only part is one prefill worker's tier (``PrefillTier``), timing each store."""

    def __init__(self, tier):
        self.tier, self.infos = tier, []

    async def contains(self, refs, index=0):
        return self.tier.contains(refs)

    async def precompile(self, ref, index=0, base=None):
        info = self.tier.precompile(ref, base)
        self.infos.append((len(ref.token_ids), info))
        return info


def _conversation(engine, system: int, turn: int, turns: int) -> list[tuple[int, ...]]:
    """Each turn's whole prompt: a system part of ``system`` tokens, then ``turn`` tokens a turn."""
    sys_ids = (engine.encode(SYSTEM * (system // 40 + 1)))[:system]
    turn_ids = (engine.encode(TURN * (turn // 40 + 1)))[:turn]
    return [tuple(sys_ids + turn_ids * (t + 1)) for t in range(turns)]


def run(turns: int, system: int, turn: int) -> list[dict]:
    from cluster.control.decode_held import DecodeHeld
    from cluster.control.metrics import Metrics
    from cluster.control.prompt_index import PromptIndex
    from cluster.control.state import open_state
    from cluster.control.store_behind import StoreBehind
    from cluster.control.tier_lookup import TierLookup
    from kvruntime.config import TierConfig
    from kvruntime.engine import ReferenceEngine
    from kvruntime.messages.keys import tenant_salt
    from kvruntime.messages.plan import KVRef
    from kvtransport.tier.lmcache_store import LMCacheStore
    from prefill_workers.tier_reads import PrefillTier

    class FromZero(StoreBehind):
        async def base(self, tenant, ref, index):       # what store-behind did before: always from position 0
            return None

    engine = ReferenceEngine("smollm2-135m", threads=1)
    store = LMCacheStore.for_engine(engine, TierConfig(cpu_bytes=2 << 30))
    tmp = tempfile.TemporaryDirectory()
    state = open_state(f"sqlite:///{tmp.name}/state.db")
    rows = []
    try:
        modes = {}
        for name, cls in (("delta", StoreBehind), ("from0", FromZero)):
            b, m = _Tier(PrefillTier(store, engine)), Metrics()
            held = DecodeHeld(state, metrics=m)
            modes[name] = (b, cls(b, m, PromptIndex(state, m, TierLookup(b, m)), held=held), held,
                           tenant_salt(name, b"bench"))
        for t, prompt in enumerate(_conversation(engine, system, turn, turns)):
            row = {"turn": t, "prompt_tokens": len(prompt)}
            for name, (b, sb, held, salt) in sorted(modes.items(), reverse=bool(t % 2)):   # interleaved
                async def one():
                    held.note(name, prompt)          # the exact plan ran on the decode engine
                    sb.schedule(name, KVRef(prompt[:-1], 0, salt), 0, 0)
                    await sb.drain()
                asyncio.run(one())
                n, info = b.infos[-1]
                row[f"{name}_computed"], row[f"{name}_s"] = n - info.start, round(info.seconds, 3)
            a = modes["delta"][0].tier.get(KVRef(prompt[:-1], 0, modes["delta"][3]))
            z = modes["from0"][0].tier.get(KVRef(prompt[:-1], 0, modes["from0"][3]))
            row["max_abs_diff"] = float((a.data - z.data).abs().max())
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        state.close()
        store.close()
        tmp.cleanup()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system", type=int, default=300)
    p.add_argument("--turn-tokens", type=int, default=120)
    a = p.parse_args()
    torch.set_num_threads(1)
    rows = run(a.turns, a.system, a.turn_tokens)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print("| turn | prompt tokens | computed, delta / from 0 | prefill worker s, delta / from 0 | ratio | max abs diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["from0_s"] / r["delta_s"] if r["delta_s"] else float("inf")
        print(f"| {r['turn']} | {r['prompt_tokens']} | {r['delta_computed']} / {r['from0_computed']} | "
              f"{r['delta_s']:.3f} / {r['from0_s']:.3f} | {ratio:.2f}x | {r['max_abs_diff']:.1e} |")
    later = rows[1:]
    if later:
        d, z = sum(r["delta_s"] for r in later), sum(r["from0_s"] for r in later)
        print(f"turns 1..{len(rows) - 1}: {d:.2f} s vs {z:.2f} s of prefill worker time ({z / d:.2f}x less)")


if __name__ == "__main__":
    main()
