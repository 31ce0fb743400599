"""The measuring stage of ``kvnotes calibrate`` (full and ``--edits-only``): the resumable run log,
the progress bar, the reference engine and the loop that runs the cases into the log.

Resumable: every finished case is appended (one JSON line, fsync'd) to ``rows.jsonl`` in a run
directory keyed by the checkpoint's content hash, dtype, the case ids and the operations
(:func:`run_key`; default ``$KVNOTES_CACHE/calibrate/<model>-<key>``). A killed run, started
again with the same arguments, loads the finished cases and measures only the rest; the profile
is the same as an uninterrupted run's (apart from wall times). A progress bar on stderr shows
the cases done and an ETA (the mean time per case so far times the cases left).

Cases run one at a time through the reference engine, which prefills and decodes one sequence
per forward. Several cases per forward are not built: that needs a padded batched prefill and
decode in the engine, and its gain on CPU (where a forward over a few hundred tokens is already
matrix-matrix work) has not been measured yet (docs/fidelity.md, "Calibrating a model").
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

EDIT_KEY = {"edit answers": {"reference": True}}   # edit rows judged, with recompute's (run key)


def run_key(content_hash: str, dtype: str, case_ids: dict[str, list[str]], ops: dict) -> str:
    """What a run directory is keyed by: the weights, dtype, case ids per set and operations."""
    blob = json.dumps({"weights": content_hash, "dtype": dtype, "cases": case_ids,
                       "ops": {k: ops[k] for k in sorted(ops)}}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class RunLog:
    """The run directory's ``rows.jsonl``: one line per finished case, appended and fsync'd."""

    def __init__(self, directory: Path, key_doc: dict):
        self.dir = directory
        from kvruntime.private_files import private_dir
        private_dir(self.dir)             # the cases' texts and answers: mode 0700 (warned if looser)
        meta = self.dir / "run.json"
        if meta.exists() and json.loads(meta.read_text()) != key_doc:
            raise ValueError(f"{self.dir} holds another calibration run (other model, cases or operations); "
                             "pass another --run-dir")
        meta.write_text(json.dumps(key_doc, indent=1, sort_keys=True))
        self.path = self.dir / "rows.jsonl"
        self.done: dict[tuple[str, str], dict] = {}
        if self.path.exists():
            lines = self.path.read_text().splitlines()
            for i, line in enumerate(lines):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    if i == len(lines) - 1:
                        break                      # the line a kill cut short: measured again
                    raise ValueError(f"{self.path}: line {i + 1} is not JSON; remove the run directory")
                self.done[rec["set"], rec["case"]] = rec
            self._rewrite_clean()
        self._f = open(self.path, "a")

    @classmethod
    def open(cls, spec, dtype: str, key: str, run_dir: str | None) -> "RunLog":
        """The log of run ``key`` of ``spec``: ``run_dir``, or the default under the cache."""
        return cls(Path(run_dir) if run_dir else default_run_dir(spec.name, key),
                   {"model": spec.name, "content_hash": spec.content_hash, "dtype": dtype, "key": key})

    def _rewrite_clean(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for rec in self.done.values():
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def append(self, rec: dict) -> None:
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done[rec["set"], rec["case"]] = rec

    def rows(self, kind: str, ids: list[str]) -> dict[str, list[dict]]:
        """Per op, the logged rows of ``kind`` in case order (as one uninterrupted run orders them)."""
        out: dict[str, list[dict]] = {}
        for cid in ids:
            for op, row in self.done[kind, cid]["rows"].items():
                out.setdefault(op, []).append(row)
        return out

    def informative(self, ids: list[str]) -> dict[str, bool]:
        """Per edit case, whether the stale notes change recompute's greedy answer (as logged)."""
        return {c: self.done["edit", c]["informative"] for c in ids}

    def close(self) -> None:
        self._f.close()


def default_run_dir(name: str, key: str) -> Path:
    from kvruntime.checkpoint import cache_root
    return cache_root() / "calibrate" / f"{name}-{key}"


def check_device(device: str) -> None:
    """``--device``: cpu, or cuda[:N] on a machine whose torch sees that GPU (one-line error otherwise)."""
    import torch
    if device == "cpu":
        return
    if not device.startswith("cuda"):
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"--device {device}: no CUDA device is visible to torch "
                           f"(torch {torch.__version__}, built {'with' if torch.version.cuda else 'without'} CUDA)")
    idx = int(device.split(":", 1)[1]) if ":" in device else 0
    if idx >= torch.cuda.device_count():
        raise RuntimeError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")


def machine_line() -> str:
    """The profile's ``meta.machine``: architecture, cores and the torch threads used."""
    import torch
    return f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def progress_bar(total: int, done: int, enabled: bool):
    from tqdm import tqdm
    # smoothing=0: the ETA is the mean time per case measured in this run times the cases left
    return tqdm(total=total, initial=done, unit="case", desc="calibrate", file=sys.stderr, smoothing=0,
                disable=not enabled, dynamic_ncols=True,
                bar_format="{desc}: {n}/{total} cases |{bar}| {elapsed} elapsed, ETA {remaining} "
                           "({rate_inv_fmt}){postfix}")


def load_engine(spec, dtype: str, device: str, threads: int | None):
    """The reference engine for ``spec``; RuntimeError when its RoPE self-test fails (nothing to calibrate)."""
    from kvruntime.engine import ReferenceEngine
    engine = ReferenceEngine(spec, dtype=dtype, device=device, threads=threads)
    if not engine.rope.enabled:
        raise RuntimeError(f"model {spec.name}: RoPE self-test failed (error {engine.rope.self_test_error}); "
                           "repositioning is disabled for it, so there is nothing to calibrate")
    print(f"kvnotes: {spec.name} loaded on {engine.device} ({dtype}); RoPE self-test passed "
          f"(relative error {engine.rope.self_test_error:.2e})", file=sys.stderr)
    return engine


def measure(engine, log: RunLog, bar, compose_cases, dec_cases, edit_cases, passages, dec_passages, ops,
            dec_ops, edit_ops=None) -> None:
    """Run every case not yet in ``log`` (compose, then decision, then edit), one log line each."""
    from kvruntime.fidelity.runner import run_compose, run_edit
    quiet = lambda _msg: None          # noqa: E731 - the bar reports progress
    last = [time.monotonic(), time.process_time()]

    def record(kind):
        def on_case(case, rows, informative=None):
            now, cpu = time.monotonic(), time.process_time()
            # cpu_s: this process's CPU time for the case (1 thread: the case's wall time on an idle core)
            rec = {"set": kind, "case": case.id, "rows": rows, "wall_s": now - last[0], "cpu_s": cpu - last[1]}
            if informative is not None:
                rec["informative"] = informative
            log.append(rec)
            last[0], last[1] = now, cpu
            bar.set_postfix_str(f"{kind} {case.id}", refresh=False)
            bar.update(1)
        return on_case

    todo = [c for c in compose_cases if ("compose", c.id) not in log.done]
    if todo:
        run_compose(engine, todo, passages, ops=ops, progress=quiet, share_probe=False, on_case=record("compose"))
    todo = [c for c in dec_cases if ("decision", c.id) not in log.done]
    if todo:
        run_compose(engine, todo, {**passages, **dec_passages}, ops=dec_ops, progress=quiet, share_probe=False,
                    on_case=record("decision"))
    todo = [c for c in edit_cases if ("edit", c.id) not in log.done]
    if todo:
        run_edit(engine, todo, progress=quiet, on_case=record("edit"), ops=edit_ops, reference=True)
