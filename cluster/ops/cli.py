"""The ``kvnotes`` command line. Subcommands import what they need lazily so ``--help`` and
argument errors are instant. Bad input exits non-zero with one line, never a traceback."""
from __future__ import annotations

import argparse
import logging
import os
import sys


def _parser() -> argparse.ArgumentParser:
    from kvruntime.config.choices import DecodeEngineKind   # enum only: --help stays instant
    p = argparse.ArgumentParser(prog="kvnotes", description="KV cache as notes: compose and edit.")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="compose and edit on a real model, printing each step and its fidelity")
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--threads", type=int, default=None)

    sub.add_parser("models", help="list the registered models")

    r = sub.add_parser("run", help="the embedded default: local Ray, CPU, default model, router on 127.0.0.1:8000")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--decode-engine", default="reference", choices=[m.value for m in DecodeEngineKind],
                   help="decode actors run the reference engine or vLLM (kvnotes KV connector)")

    s = sub.add_parser("serve", help="start a cluster from a config file (YAML or JSON)")
    s.add_argument("--config", required=True)
    s.add_argument("--address", default=None,
                   help="join this Ray cluster (host:port or auto; overrides ray_address in the config)")

    c = sub.add_parser("calibrate", help="measure a model's fidelity profile (what balanced may compose)")
    c.add_argument("--model", required=True, help="checkpoint directory (or registry name)")
    c.add_argument("--cases", type=int, default=None, help="only the first N compose and N edit cases (default: all)")
    c.add_argument("--out", default=None, help="profiles directory (default: the config's profiles_dir, else "
                                               "~/.cache/kvnotes/profiles)")
    c.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: the config's dtype, else float32")
    c.add_argument("--device", default="cpu", help="cpu or cuda[:N] (an error if torch sees no such GPU)")
    c.add_argument("--threads", type=int, default=None)
    c.add_argument("--decisions", type=int, default=None,
                   help="yes/no decision cases for the answer target (default 20, capped by --cases; 0: none)")
    c.add_argument("--budget", type=float, default=None, metavar="HALF_WIDTH",
                   help="pick the compose + decision case count: the fewest cases whose 95%% Wilson interval of "
                        "an agreement rate at 95%% is at most +-HALF_WIDTH (e.g. 0.05); not with --cases/--decisions")
    c.add_argument("--run-dir", default=None, help="where finished cases are logged, so a killed run resumes "
                                                   "(default: $KVNOTES_CACHE/calibrate/<model>-<key of weights, "
                                                   "cases and operations>)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    c.add_argument("--edits-only", action="store_true",
                   help="measure only the field edits balanced may plan, judged against recompute, and add the "
                        "section edit_answers to the model's existing profile in --out (the rest is kept)")
    c.add_argument("--config", default=None, help="the cluster's config (profiles_dir, dtype, balanced_* target)")

    k = sub.add_parser("keys", help="API keys: each maps to a tenant (only its hash is stored)")
    ksub = k.add_subparsers(dest="action", required=True)
    kc = ksub.add_parser("create", help="create a key for a tenant; the key is the last line printed")
    kc.add_argument("--tenant", required=True)
    kl = ksub.add_parser("list", help="list keys (id, tenant, created), never the keys themselves")
    kr = ksub.add_parser("revoke", help="revoke a key by its id (from `keys list`)")
    kr.add_argument("key_id")
    for x in (kc, kl, kr):
        x.add_argument("--config", default=None, help="the cluster's config file (default: the embedded default's)")

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
    f.add_argument("--probes", nargs="+", default=["kv1"],
                   help="selective-recompute probes swept with --compose-only (kv<N>, progressive, q<last|late|N>)")
    f.add_argument("--decisions", type=int, default=None,
                   help="yes/no decision cases (E2: memory placed late) for the section compose_answers "
                        "(default 20, capped by --limit; 0: none)")
    f.add_argument("--seams", type=int, nargs="+", default=[1], help="seam tokens swept with --compose-only")
    f.add_argument("--rows-out", default=None, help="also write every per-case row as JSON lines to this file")
    f.add_argument("--from-rows", nargs="+", default=None,
                   help="no run: build the compose sweep from --rows-out files and print the top-1 flips")
    f.add_argument("--answered", action="store_true", help="only compose cases that carry an expected answer")
    f.add_argument("--unanswered", action="store_true", help="only compose cases without an expected answer")
    f.add_argument("--tables-dir", default=None, help="where to write <model>.json (default: shipped tables)")
    r = esub.add_parser("report", help="regenerate the tables in docs/fidelity.md from the saved summaries")
    r.add_argument("--doc", default="docs/fidelity.md")

    rep = sub.add_parser("report", help="render the Grafana dashboard's panels to PNG from Prometheus (no Grafana)")
    rep.add_argument("--prometheus", required=True, help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    rep.add_argument("--out", required=True, help="directory for the PNGs and index.md")
    rep.add_argument("--since", default="1h", help="time range ending now (30m, 1h, 2d)")
    rep.add_argument("--step", default=None, help="query resolution (default: range / 240)")

    def target_args(a):
        a.add_argument("--url", default=None, help="router URL (default: KVNOTES_URL, the config's, or :8000)")
        a.add_argument("--key", default=None, help="API key (default: KVNOTES_API_KEY or <data_dir>/api_key)")
        a.add_argument("--config", default=None, help="the cluster's config file (router address, key file)")

    ts = sub.add_parser("tier-server", help="run the lm:// KV tier server (its key from the cluster secret)")
    ts.add_argument("--config", required=True, help="the cluster's config (state_url, tier_remote_url, capacity)")
    ts.add_argument("--host", default=None, help="bind address (default: tier_remote_url's host)")
    ts.add_argument("--port", type=int, default=None, help="port (default: tier_remote_url's port)")
    ts.add_argument("--metrics-port", type=int, default=None, help="export kvnotes_tier_server_* here")

    target_args(sub.add_parser("status", help="workers per role, state store, tier and remote tier state"))
    for kind in ("skills", "memories", "templates"):
        k = sub.add_parser(kind, help=f"list, add or remove {kind} through the router's API")
        ksub = k.add_subparsers(dest="action", required=True)
        target_args(ksub.add_parser("list", help=f"registered {kind}" + ("" if kind == "templates"
                                                                          else " and whether the tier holds them")))
        a = ksub.add_parser("add", help="register a file, or every .txt/.md/.json file of a directory")
        a.add_argument("path")
        a.add_argument("--name", default=None, help="name for a single file (default: the file's stem)")
        target_args(a)
        rm = ksub.add_parser("rm", help=f"delete one of the {kind}")
        rm.add_argument("name")
        target_args(rm)
    return p


def _tier_server(args) -> int:
    """Serve the lm:// tier in the foreground with the key every prefill actor derives too."""
    from cluster.control.ray_backends import tier_key_of
    from kvruntime.config import ClusterConfig
    from kvtransport.tier.lmcache_remote import parse_lm_url
    from kvtransport.tier.server import serve

    cfg = ClusterConfig.from_file(args.config)
    if not cfg.tier.remote_url:
        raise ValueError(f"{args.config} sets no tier_remote_url: no prefill actor would use a tier server")
    host, port = parse_lm_url(cfg.tier.remote_url)
    serve(args.host or host, args.port or port, tier_key_of(cfg), cfg.tier.remote_capacity_bytes,
          metrics_port=args.metrics_port)
    return 0


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
            from kvruntime.config import ClusterConfig
            from cluster.ops.launcher import run_forever
            cfg = (ClusterConfig.of(model=args.model, port=args.port, decode_engine=args.decode_engine)
                   if args.cmd == "run"
                   else ClusterConfig.from_file(args.config))
            if args.cmd == "serve" and args.address:
                cfg = cfg.replace(ray_address=args.address)
            return run_forever(cfg, register_demo=args.cmd == "run")
        if args.cmd == "tier-server":
            return _tier_server(args)
        if args.cmd == "keys":
            return _keys(args)
        if args.cmd == "calibrate":
            from cluster.ops.calibrate import calibrate
            from kvruntime.config import ClusterConfig
            cfg = ClusterConfig.from_file(args.config) if args.config else None
            from cluster.control.planner import FidelityTarget
            if args.edits_only:
                if args.budget is not None or args.decisions is not None:
                    raise ValueError("--edits-only measures the edit cases only: drop --budget / --decisions")
                from cluster.ops.calibrate import calibrate_edits
                calibrate_edits(args.model, cases=args.cases, out=args.out or (cfg.policy.profiles_dir if cfg else None),
                                dtype=args.dtype or (cfg.workers.dtype if cfg else "float32"), device=args.device,
                                threads=args.threads,
                                target=FidelityTarget.from_config(cfg) if cfg else FidelityTarget.answers(),
                                command="kvnotes " + " ".join(argv if argv is not None else sys.argv[1:]),
                                run_dir=args.run_dir, progress=not args.no_progress)
                return 0
            calibrate(args.model, cases=args.cases, decisions=args.decisions,
                      out=args.out or (cfg.policy.profiles_dir if cfg else None),
                      dtype=args.dtype or (cfg.workers.dtype if cfg else "float32"), device=args.device, threads=args.threads,
                      target=FidelityTarget.from_config(cfg) if cfg else FidelityTarget.answers(),
                      command="kvnotes " + " ".join(argv if argv is not None else sys.argv[1:]),
                      run_dir=args.run_dir, budget=args.budget, progress=not args.no_progress)
            return 0
        if args.cmd == "demo":
            from cluster.ops.demo import run_demo
            return run_demo(args.model, threads=args.threads)
        if args.cmd == "eval" and args.what == "fidelity":
            from kvruntime.fidelity.cli import eval_fidelity
            return eval_fidelity(args, argv if argv is not None else sys.argv[1:])
        if args.cmd == "report":
            from cluster.ops.report import run as report
            return report(args.prometheus, args.out, since=args.since, step=args.step)
        if args.cmd in ("status", "skills", "memories", "templates"):
            from cluster.ops import admin
            t = admin.resolve_target(args.url, args.key, args.config)
            if args.cmd == "status":
                return admin.status(t)
            if args.action == "list":
                return admin.list_kind(t, args.cmd)
            if args.action == "add":
                return admin.add(t, args.cmd, args.path, args.name)
            return admin.remove(t, args.cmd, args.name)
        if args.cmd == "eval" and args.what == "report":
            from kvruntime.fidelity.cli import write_report
            return write_report(args.doc)
    except (ValueError, RuntimeError, FileNotFoundError, ConnectionError) as exc:   # ConnectionError: the state store
        print(f"kvnotes: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvnotes: interrupted", file=sys.stderr)
        return 130
    return 2


def _keys(args) -> int:
    import datetime

    from cluster.http.auth import check_tenant, create_key
    from cluster.control.state import open_state
    from kvruntime.config import ClusterConfig

    cfg = ClusterConfig.from_file(args.config) if args.config else ClusterConfig()
    if args.action == "create":
        check_tenant(args.tenant)
    state = open_state(cfg.state.resolved_url)
    try:
        if args.action == "create":
            key, rec = create_key(state, args.tenant)
            print(f"created key {rec.key_id} for tenant {rec.tenant}; it is shown only now:")
            print(key)
        elif args.action == "list":
            for r in state.list_api_keys():
                when = datetime.datetime.fromtimestamp(r.created, datetime.timezone.utc).isoformat(timespec="seconds")
                print(f"{r.key_id}  {r.tenant}  {when}")
        elif not state.revoke_api_key(args.key_id):
            raise ValueError(f"no key with id {args.key_id!r} (see `kvnotes keys list`)")
        else:
            print(f"revoked key {args.key_id}")
    finally:
        state.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
