"""The ``kvnotes`` command line. Subcommands import what they need lazily so ``--help`` and
argument errors are instant. Bad input exits non-zero with one line, never a traceback."""
from __future__ import annotations

import argparse
import logging
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvnotes", description="KV cache as notes: compose and edit.")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="compose and edit on a real model, printing each step and its fidelity")
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--threads", type=int, default=None)

    sub.add_parser("models", help="list the registered models")

    r = sub.add_parser("run", help="the embedded default: local Ray, CPU, default model, router on 127.0.0.1:8000")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--decode-engine", default="reference", choices=["reference", "vllm"],
                   help="decode actors run the reference engine or vLLM (kvnotes KV connector)")

    s = sub.add_parser("serve", help="start a cluster from a config file (YAML or JSON)")
    s.add_argument("--config", required=True)

    e = sub.add_parser("eval", help="measurements")
    esub = e.add_subparsers(dest="what", required=True)
    f = esub.add_parser("fidelity", help="run the fidelity harness on the shipped case set")
    f.add_argument("--model", default="smollm2-135m")
    f.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    f.add_argument("--device", default="cpu")
    f.add_argument("--threads", type=int, default=None)
    f.add_argument("--limit", type=int, default=None, help="only the first N cases of each set")
    f.add_argument("--no-cot", action="store_true", help="skip the chain-of-thought edit variant")
    f.add_argument("--compose-only", action="store_true",
                   help="only the compose r sweep, merged into the model's summary (compose_sweep)")
    f.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.10, 0.15, 0.25, 0.50],
                   help="selective-recompute ratios swept with --compose-only")
    f.add_argument("--answered", action="store_true", help="only compose cases that carry an expected answer")
    f.add_argument("--tables-dir", default=None, help="where to write <model>.json (default: shipped tables)")
    r = esub.add_parser("report", help="regenerate the tables in docs/fidelity.md from the saved summaries")
    r.add_argument("--doc", default="docs/fidelity.md")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("KVNOTES_LOG", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "models":
            from kvruntime.models import list_models
            print("\n".join(list_models()))
            return 0
        if args.cmd in ("run", "serve"):
            from kvruntime.messages.config import ClusterConfig
            from cluster.launcher import run_forever
            cfg = (ClusterConfig(model=args.model, port=args.port, decode_engine=args.decode_engine)
                   if args.cmd == "run"
                   else ClusterConfig.from_file(args.config))
            return run_forever(cfg, register_demo=args.cmd == "run")
        if args.cmd == "demo":
            from cluster.demo import run_demo
            return run_demo(args.model, threads=args.threads)
        if args.cmd == "eval" and args.what == "fidelity":
            from kvruntime.fidelity.cli import eval_fidelity
            return eval_fidelity(args, argv if argv is not None else sys.argv[1:])
        if args.cmd == "eval" and args.what == "report":
            from kvruntime.fidelity.cli import write_report
            return write_report(args.doc)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"kvnotes: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvnotes: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
