"""What ``kvnotes calibrate`` costs on a real model shape: seconds per case, by case kind.

``python -m bench.calibrate_cost --shape llama3-8b --device cuda --dtype bfloat16 --cases 3 --decisions 2``

Builds a checkpoint of the shape with **random weights** on the device (transformers' config class,
``bench.engine.SHAPES``; saved once to a temporary directory, /dev/shm where it exists) and runs
:func:`cluster.operator.calibrate.calibrate` on it: ``--cases`` compose and edit cases and ``--decisions``
yes/no cases, every operation the planner can choose. The answers of random weights mean nothing:
only the cost is measured (a benchmark input, never served or shipped). Prints the engine's RoPE
self-test result, the build / save / hash times, and seconds per case of each kind.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def build_checkpoint(shape: str, device: str, dtype: str, root: Path) -> Path:
    import transformers as T

    from bench.engine import SHAPES
    from tests.tiny_checkpoints import tokenizer
    tok = tokenizer("llama")
    cfg = T.LlamaConfig(**SHAPES[shape], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        m = T.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    for p in m.parameters():                   # small weights keep activations finite
        p.data.normal_(0, 0.02) if p.dim() > 1 else p.data.fill_(1.0)
    d = root / f"random-{shape}"
    m.save_pretrained(d)
    tok.save_pretrained(d)
    del m
    return d


def main(argv=None) -> int:
    from cluster.operator.calibrate import calibrate
    from kvruntime.models import get_model_spec

    ap = argparse.ArgumentParser(prog="python -m bench.calibrate_cost")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cases", type=int, default=3)
    ap.add_argument("--decisions", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="calib-cost-", dir=shm if shm.is_dir() else None))
    t = time.perf_counter()
    ckpt = build_checkpoint(a.shape, a.device, a.dtype, root)
    built = time.perf_counter() - t
    t = time.perf_counter()
    spec = get_model_spec(str(ckpt))              # content hash of the weights
    hashed = time.perf_counter() - t
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    print(f"{a.shape} shape, random weights (cost only: its answers mean nothing; never served or shipped); "
          f"built and saved in {built:.1f} s, content hash {hashed:.1f} s; device {a.device}, {a.dtype}", flush=True)
    t = time.perf_counter()
    out = calibrate(str(ckpt), cases=a.cases, decisions=a.decisions, dtype=a.dtype, device=a.device,
                    threads=a.threads, out=str(root / "profiles"), run_dir=str(root / "run"), progress=True)
    total = time.perf_counter() - t
    per_kind: dict[str, list[float]] = {}
    for line in (root / "run" / "rows.jsonl").read_text().splitlines():
        rec = json.loads(line)
        per_kind.setdefault(rec["set"], []).append(rec.get("wall_s", 0.0))
    print(f"calibrate: {total:.1f} s in all (engine load and RoPE self-test included) for "
          f"{sum(len(v) for v in per_kind.values())} cases of {spec.name}")
    for kind, ws in per_kind.items():
        print(f"  {kind}: {len(ws)} cases, {sum(ws) / max(1, len(ws)):.1f} s per case")
    print(f"  at the full case set (90 compose + 40 decision + 65 edit): ~"
          f"{sum(sum(ws) / max(1, len(ws)) * n for ws, n in ((per_kind.get('compose', []), 90), (per_kind.get('decision', []), 40), (per_kind.get('edit', []), 65))) / 60:.0f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
