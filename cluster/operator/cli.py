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
    _add_cluster_commands(sub)
    _add_calibrate(sub)
    _add_keys(sub)
    _add_eval(sub)
    _add_operator_commands(sub)
    return p


def _add_cluster_commands(sub) -> None:
    """demo, models, run, serve."""
    from kvruntime.config.choices import DecodeEngineKind   # enum only: --help stays instant
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


def _add_calibrate(sub) -> None:
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


def _add_keys(sub) -> None:
    k = sub.add_parser("keys", help="API keys: each maps to a tenant (only its hash is stored)")
    ksub = k.add_subparsers(dest="action", required=True)
    kc = ksub.add_parser("create", help="create a key for a tenant; the key is the last line printed")
    kc.add_argument("--tenant", required=True)
    kl = ksub.add_parser("list", help="list keys (id, tenant, created), never the keys themselves")
    kr = ksub.add_parser("revoke", help="revoke a key by its id (from `keys list`)")
    kr.add_argument("key_id")
    for x in (kc, kl, kr):
        x.add_argument("--config", default=None, help="the cluster's config file (default: the embedded default's)")


def _add_eval(sub) -> None:
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


def _target_args(a) -> None:
    a.add_argument("--url", default=None, help="router URL (default: KVNOTES_URL, the config's, or :8000)")
    a.add_argument("--key", default=None, help="API key (default: KVNOTES_API_KEY or <data_dir>/api_key)")
    a.add_argument("--config", default=None, help="the cluster's config file (router address, key file)")


def _add_operator_commands(sub) -> None:
    """report, tier-server, status, and skills / memories / templates through the router's API."""
    rep = sub.add_parser("report", help="render the Grafana dashboard's panels to PNG from Prometheus (no Grafana)")
    rep.add_argument("--prometheus", required=True, help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    rep.add_argument("--out", required=True, help="directory for the PNGs and index.md")
    rep.add_argument("--since", default="1h", help="time range ending now (30m, 1h, 2d)")
    rep.add_argument("--step", default=None, help="query resolution (default: range / 240)")

    ts = sub.add_parser("tier-server", help="run the lm:// KV tier server (its key from the cluster secret)")
    ts.add_argument("--config", required=True, help="the cluster's config (state_url, tier_remote_url, capacity)")
    ts.add_argument("--host", default=None, help="bind address (default: tier_remote_url's host)")
    ts.add_argument("--port", type=int, default=None, help="port (default: tier_remote_url's port)")
    ts.add_argument("--metrics-port", type=int, default=None, help="export kvnotes_tier_server_* here")

    _target_args(sub.add_parser("status", help="workers per role, state store, tier and remote tier state"))
    for kind in ("skills", "memories", "templates"):
        k = sub.add_parser(kind, help=f"list, add or remove {kind} through the router's API")
        ksub = k.add_subparsers(dest="action", required=True)
        _target_args(ksub.add_parser("list", help=f"registered {kind}" + ("" if kind == "templates"
                                                                           else " and whether the tier holds them")))
        a = ksub.add_parser("add", help="register a file, or every .txt/.md/.json file of a directory")
        a.add_argument("path")
        a.add_argument("--name", default=None, help="name for a single file (default: the file's stem)")
        _target_args(a)
        rm = ksub.add_parser("rm", help=f"delete one of the {kind}")
        rm.add_argument("name")
        _target_args(rm)


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
          metrics_port=args.metrics_port, tls=cfg.tier.remote_tls)
    return 0


def _models(args, argv) -> int:
    from kvruntime.models import list_models
    print("\n".join(list_models()))
    return 0


def _run(args, argv) -> int:
    """``run`` (the embedded default) and ``serve`` (a config file)."""
    from cluster.operator.launcher import run_forever
    from kvruntime.config import ClusterConfig
    if args.cmd == "run":
        cfg = ClusterConfig.of(model=args.model, port=args.port, decode_engine=args.decode_engine)
    else:
        cfg = ClusterConfig.from_file(args.config)
        if args.address:
            cfg = cfg.replace(ray_address=args.address)
    return run_forever(cfg, register_demo=args.cmd == "run")


def _calibrate(args, argv) -> int:
    from cluster.control.planner import FidelityTarget
    from cluster.operator.calibrate import calibrate, calibrate_edits
    from kvruntime.config import ClusterConfig
    cfg = ClusterConfig.from_file(args.config) if args.config else None
    common = dict(cases=args.cases, out=args.out or (cfg.policy.profiles_dir if cfg else None),
                  dtype=args.dtype or (cfg.workers.dtype if cfg else "float32"), device=args.device,
                  threads=args.threads, target=FidelityTarget.from_config(cfg) if cfg else FidelityTarget.answers(),
                  command="kvnotes " + " ".join(argv), run_dir=args.run_dir, progress=not args.no_progress)
    if args.edits_only:
        if args.budget is not None or args.decisions is not None:
            raise ValueError("--edits-only measures the edit cases only: drop --budget / --decisions")
        calibrate_edits(args.model, **common)
    else:
        calibrate(args.model, decisions=args.decisions, budget=args.budget, **common)
    return 0


def _demo(args, argv) -> int:
    from cluster.operator.demo import run_demo
    return run_demo(args.model, threads=args.threads)


def _eval(args, argv) -> int:
    from kvruntime.fidelity.cli import eval_fidelity, write_report
    return eval_fidelity(args, argv) if args.what == "fidelity" else write_report(args.doc)


def _report(args, argv) -> int:
    from cluster.operator.report import run as report
    return report(args.prometheus, args.out, since=args.since, step=args.step)


def _admin(args, argv) -> int:
    """``status`` and skills / memories / templates: plain HTTP calls to the router."""
    from cluster.operator import admin
    t = admin.resolve_target(args.url, args.key, args.config)
    if args.cmd == "status":
        return admin.status(t)
    if args.action == "list":
        return admin.list_kind(t, args.cmd)
    if args.action == "add":
        return admin.add(t, args.cmd, args.path, args.name)
    return admin.remove(t, args.cmd, args.name)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("KVNOTES_LOG", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = _parser().parse_args(argv)
    commands = {"models": _models, "run": _run, "serve": _run, "tier-server": lambda a, _: _tier_server(a),
                "keys": lambda a, _: _keys(a), "calibrate": _calibrate, "demo": _demo, "eval": _eval,
                "report": _report, "status": _admin, "skills": _admin, "memories": _admin, "templates": _admin}
    try:
        return commands[args.cmd](args, argv)
    except (ValueError, RuntimeError, FileNotFoundError, ConnectionError) as exc:   # ConnectionError: the state store
        print(f"kvnotes: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvnotes: interrupted", file=sys.stderr)
        return 130


def _keys(args) -> int:
    import datetime

    from cluster.http.auth import check_tenant, create_key
    from cluster.control.state import configured_limits, open_state
    from kvruntime.config import ClusterConfig

    cfg = ClusterConfig.from_file(args.config) if args.config else ClusterConfig()
    if args.action == "create":
        check_tenant(args.tenant)
    state = open_state(cfg.state.resolved_url, configured_limits(cfg))
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
