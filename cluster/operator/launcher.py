"""Bring the cluster up: Ray (local or an existing cluster), the worker actors, and the Serve
router on host:port. ``kvnotes run`` uses the embedded default config; ``kvnotes serve
--config FILE`` a real deployment's."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

from cluster.operator.demo import DEMO_QUESTION, DEMO_SKILL, DEMO_SKILL_NAME
from kvruntime.config import ClusterConfig
from kvruntime.config.server import ROUTER_RESOURCE_UNITS

log = logging.getLogger(__name__)


class ConnectError(RuntimeError):
    """The configured Ray cluster could not be reached (the message says which and why)."""


def ray_auth_mode(cfg: ClusterConfig, token_path: Path | None = None) -> str | None:
    """The ``RAY_AUTH_MODE`` to join ``cfg.ray.address`` with: the config's, else ``token`` when
    Ray's token file exists (Ray 2.60 heads started by ``ray start`` require it), else unset."""
    if cfg.ray.auth_mode:
        return cfg.ray.auth_mode
    token_path = token_path or Path.home() / ".ray" / "auth_token"
    return "token" if token_path.exists() or os.environ.get("RAY_AUTH_TOKEN") else None


def _probe(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a host:port that does not accept connections (Ray would retry for minutes)."""
    import socket

    if address == "auto" or "://" in address:
        return                   # "auto": Ray finds the local head itself, or fails at once
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConnectError(f"ray_address must be host:port or auto, got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectError(f"cannot connect to the Ray cluster at {address}: {exc.strerror or exc} "
                           f"(is `ray start --head` running there?)") from None


def connect(cfg: ClusterConfig) -> None:
    """Join the Ray cluster at ``cfg.ray.address``; ConnectError (one line) when it cannot."""
    import ray

    _probe(cfg.ray.address)
    mode = ray_auth_mode(cfg)
    if mode and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = mode
        from ray._raylet import Config
        Config.initialize("")     # Ray read its config at import: make it see the auth mode (as Ray itself does)
        log.info("joining %s with RAY_AUTH_MODE=%s", cfg.ray.address, mode)
    try:
        ray.init(address=cfg.ray.address, namespace="kvnotes", log_to_driver=False)
    except Exception as exc:   # Ray raises ConnectionError, RuntimeError, AuthenticationError, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = "" if mode == "token" else " (a token-auth head needs ~/.ray/auth_token or ray_auth_mode: token)"
        raise ConnectError(f"cannot connect to the Ray cluster at {cfg.ray.address}: {type(exc).__name__}: "
                           f"{first[:300]}{hint}") from None


def check_model(cfg: ClusterConfig):
    """The model's spec (a checkpoint directory: read, hashed, its architecture checked), or
    ``ValueError`` of one line (``ModelRefused`` names what is missing) before anything starts."""
    from kvruntime.models import get_model_spec
    return get_model_spec(cfg.workers.model)


def check_prompt_block(cfg: ClusterConfig) -> None:
    """``tier_chunk_size`` must be the prompt index's block (``cluster.control.prompt_index.PROMPT_BLOCK``):
    a stored prompt serves the prefixes that end on a tier piece boundary, and the index records
    prefixes at its own block's multiples, so any other piece size would plan reuse the tier cannot
    serve. ValueError of one line before anything starts (the index does not read the size yet)."""
    from cluster.control.prompt_index import PROMPT_BLOCK
    if cfg.tier.chunk_size != PROMPT_BLOCK:
        raise ValueError(f"tier_chunk_size {cfg.tier.chunk_size} is not supported: the prompt index records "
                         f"prefixes every {PROMPT_BLOCK} tokens, so the tier's pieces must be {PROMPT_BLOCK} tokens")


def calibration_line(cfg: ClusterConfig, spec) -> str:
    """One line: which fidelity profile the planner reads for this model, or that there is none."""
    from kvruntime.fidelity.profiles import calibration_line as line, find_profile
    return line(find_profile(spec, cfg.policy.profiles_dir), cfg.workers.model)


def start(cfg: ClusterConfig, *, local_cpus: int | None = None) -> None:
    """Start everything and return once the router answers; idempotent within one Ray session."""
    import ray
    from ray import serve

    from kvtransport.transfer.options import check

    check(cfg)               # kv_grpc / kv_nixl: a bad key fails here, not inside every actor
    check_model(cfg)         # a refused architecture fails here in one line, before Ray starts
    check_prompt_block(cfg)  # the tier's piece size is the prompt index's block
    http_options(cfg)        # the router's TLS files readable, before anything starts
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    if not ray.is_initialized():
        if cfg.ray.address:
            connect(cfg)
        else:
            start_local_ray(cfg, local_cpus)
    from cluster.control.ray_backends import start_workers
    from cluster.http.serve_app import RouterIngress

    ensure_api_key(cfg)
    check_private_files(cfg)     # a warning per secret or tenant file others may read
    cfg = listen_on_loopback(cfg)
    check_router_resource(cfg)
    t = time.monotonic()
    start_workers(cfg)
    log.info("workers ready in %.1f s", time.monotonic() - t)
    serve.start(http_options=http_options(cfg), detached=False, controller_options=controller_options())
    serve.run(RouterIngress.options(num_replicas=cfg.server.router_replicas,
                                    ray_actor_options=router_actor_options(cfg),
                                    max_ongoing_requests=cfg.server.router_max_ongoing_requests,
                                    max_queued_requests=cfg.server.router_max_queued_requests,
                                    graceful_shutdown_wait_loop_s=cfg.server.router_shutdown_wait_loop_s).bind(cfg),
              name="kvnotes", route_prefix="/", blocking=False)


def http_options(cfg: ClusterConfig) -> dict:
    """Serve's HTTP options: host, port, and HTTPS when ``tls_cert_file`` / ``tls_key_file`` are set."""
    opts = {"host": cfg.server.host, "port": cfg.server.port}
    if cfg.server.tls_cert_file:
        cert, key = (Path(p).expanduser() for p in (cfg.server.tls_cert_file, cfg.server.tls_key_file))
        for name, p in (("tls_cert_file", cert), ("tls_key_file", key)):
            if not os.access(p, os.R_OK):
                raise ValueError(f"{name}: {p} is not a readable file (the router's HTTPS certificate and key)")
        opts.update(ssl_certfile=str(cert), ssl_keyfile=str(key))
    return opts


def controller_options() -> dict:
    """The Serve controller's environment, inherited by its HTTP proxies: uvicorn rewrites no
    client address from ``X-Forwarded-For`` (``cluster.http.forwarded`` applies trusted_proxies)."""
    from cluster.http.forwarded import SERVE_PROXY_ENV
    return {"runtime_env": {"env_vars": dict(SERVE_PROXY_ENV)}}


def check_private_files(cfg: ClusterConfig) -> list[str]:
    """One warning line per file or directory holding secrets or tenant data that others may read
    (the SQLite state file, its -wal / -shm and directory, the key file, the fs:// tier, local disk tier)."""
    from kvruntime.private_files import looser_than_private
    paths = [cfg.state.api_key_file, cfg.state.api_key_file.parent]
    url = cfg.state.resolved_url
    if url.startswith("sqlite:///"):
        db = Path(url[len("sqlite:///"):]).expanduser()
        paths += [db.parent, db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
    paths += [Path(d).expanduser() for d in (cfg.tier.persist_dir, cfg.tier.disk_path) if d]
    lines = [w for w in dict.fromkeys(looser_than_private(p) for p in dict.fromkeys(paths)) if w]
    for line in lines:
        log.warning("%s", line)
    return lines


def router_actor_options(cfg: ClusterConfig) -> dict:
    """The router replicas' Ray options: no CPU (they wait on workers), and a fraction of
    ``server.router_resource`` when set, which keeps them on the node types that declare it."""
    name = cfg.server.router_resource
    return {"num_cpus": 0, **({"resources": {name: ROUTER_RESOURCE_UNITS}} if name else {})}


def check_router_resource(cfg: ClusterConfig) -> None:
    """``RuntimeError`` before anything starts when ``server.router_resource`` is set and the
    cluster's nodes declare too little of it: the router replicas would wait for a node forever."""
    import ray

    name = cfg.server.router_resource
    if not name:
        return
    have, need = ray.cluster_resources().get(name, 0), cfg.server.router_replicas * ROUTER_RESOURCE_UNITS
    if have < need:
        raise RuntimeError(f"router_resource {name!r}: the cluster's nodes declare {have:g} of it, "
                           f"{cfg.server.router_replicas} router replica(s) need {need:g}; declare "
                           f"{{{name}: 1}} on the node type that holds the routers (deploy/cluster.yaml: "
                           f"the head) or unset router_resource")


def listen_on_loopback(cfg: ClusterConfig) -> ClusterConfig:
    """``cfg`` with ``bind_host: 127.0.0.1`` when it serves a loopback host from a one-node Ray
    cluster it did not join by address: Ray itself always runs on the node's reachable address
    (it replaces 127.0.0.1), so kvnotes' own listeners (decode inboxes, metrics exporters) are put
    on loopback here instead. An explicit ``bind_host`` is kept."""
    import ray
    if cfg.server.bind_host is None and cfg.local_loopback and len([n for n in ray.nodes() if n.get("Alive")]) == 1:
        log.info("serving %s from one node: kvnotes listeners bind 127.0.0.1", cfg.server.host)
        return cfg.replace(bind_host="127.0.0.1")
    return cfg


def start_local_ray(cfg: ClusterConfig, local_cpus: int | None = None) -> int:
    """``ray.init`` a local instance (``local_cpus`` given: always a fresh one, never a ``ray start``
    cluster found on the machine, which refuses num_cpus; else attach to a local cluster if there is
    one, or start one). Ray gives a raylet 30 s to register with its GCS and then raises, leaving a
    half-started node (a loaded machine, a port taken between Ray choosing and binding it): that
    node is shut down and Ray started again, up to ``cfg.ray.start_attempts`` times in all, each
    retry logged with Ray's reason. Returns the retries taken; raises Ray's last error."""
    import psutil
    import ray

    found = None
    if local_cpus is None:
        found = found_ray_address()
        if found:
            log.warning("no ray_address set: attaching to the Ray cluster at %s that this machine runs (RAY_ADDRESS "
                        "or the latest `ray start`); set ray_address to choose one, or RAY_ADDRESS=local for a "
                        "fresh local Ray", found)
    me = psutil.Process()
    for attempt in range(1, cfg.ray.start_attempts + 1):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            # a Ray started here: its worker processes (Serve's proxy, the router replicas, the probers)
            # at ray_worker_niceness, ahead of the model workers (kvruntime.cpu_priority); an existing
            # local cluster keeps the niceness its `ray start` gave it
            fresh = ({"_system_config": {"worker_niceness": cfg.ray.worker_niceness}}
                     if local_cpus is not None or not found else {})
            ray.init(address="local" if local_cpus is not None else None, num_cpus=local_cpus, namespace="kvnotes",
                     include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0"}}, **fresh)
            return attempt - 1
        except (ValueError, TypeError):
            raise                  # a bad argument: starting again cannot help
        except Exception as exc:   # Ray raises a bare Exception for a raylet that never registered
            ray.shutdown()
            # the failed node was never handed to ray (shutdown does not know it): stop, by PID, what
            # this attempt started (GCS, raylet, reaper, log monitor ...) before the next one
            _stop_pids([p for p in me.children(recursive=True) if p.pid not in before])
            if attempt == cfg.ray.start_attempts:
                raise
            log.warning("local Ray did not start (attempt %d of %d): %s: starting it again (ray_start_attempts)",
                        attempt, cfg.ray.start_attempts, str(exc).strip().splitlines()[0] if str(exc).strip() else
                        type(exc).__name__)
    raise AssertionError("unreachable")


def found_ray_address() -> str | None:
    """The cluster ``ray.init(address=None)`` would attach to (``RAY_ADDRESS``, else the latest
    ``ray start`` cluster recorded on this machine), or None when it would start a fresh one."""
    from ray._private.services import canonicalize_bootstrap_address
    return canonicalize_bootstrap_address(None)


def _stop_pids(procs, grace_s: float = 10.0) -> None:
    """SIGTERM ``procs`` (psutil.Process), SIGKILL those alive after ``grace_s``."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    for p in psutil.wait_procs(procs, timeout=grace_s)[1]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def ensure_api_key(cfg: ClusterConfig) -> str | None:
    """With auth on: the key in ``<data_dir>/api_key`` (created, printed and saved mode 0600 on
    first start when the state store holds no key); None when auth is off or other keys exist."""
    if not cfg.server.auth:
        return None
    from cluster.http.auth import ensure_default_key
    from cluster.control.state import configured_limits, open_state
    state = open_state(cfg.state.resolved_url, configured_limits(cfg))
    try:
        return ensure_default_key(state, cfg.server.tenant, cfg.state.api_key_file)
    finally:
        state.close()


def check_state(cfg: ClusterConfig) -> None:
    """Open and close the state store: ConnectionError (one line, password redacted) when it does
    not answer or refuses the credentials in ``state_url``."""
    from cluster.control.state import configured_limits, open_state
    open_state(cfg.state.resolved_url, configured_limits(cfg)).close()


def stop(cfg: ClusterConfig) -> None:
    import ray
    from ray import serve

    from cluster.control.ray_backends import stop_workers
    if not ray.is_initialized():
        return            # never connected: nothing to stop (serve.shutdown() would start a local Ray)
    try:
        serve.shutdown()
    finally:
        stop_workers(cfg)
        ray.shutdown()


def run_forever(cfg: ClusterConfig, *, register_demo: bool) -> int:
    """Start, print how to call it, serve until Ctrl-C / SIGTERM, then stop everything."""
    from kvtransport.transfer.options import check
    check(cfg)                         # kv_grpc / kv_nixl: a bad option is one line, nothing started or written
    spec = check_model(cfg)            # refused: one line from the CLI, nothing started
    where = f"joining the Ray cluster at {cfg.ray.address}" if cfg.ray.address else "starting local cluster"
    print(f"kvnotes: {where} (model {cfg.workers.model}, {cfg.workers.prefill.count} prefill + "
          f"{cfg.workers.decode.count} decode actors); the first start converts the model (~30 s)...", flush=True)
    base = f"{'https' if cfg.server.tls_cert_file else 'http'}://{cfg.server.host}:{cfg.server.port}"
    check_state(cfg)                   # a state store that is down or refuses us: one line, nothing started
    print(f"kvnotes: {calibration_line(cfg, spec)}", flush=True)
    try:
        start(cfg)
        key = ensure_api_key(cfg)
        if register_demo and cfg.server.auth and key is None:
            from cluster.http.auth import no_key_hint
            print(f"{no_key_hint(cfg.state.api_key_file)}; the demo skill is not registered", flush=True)
        elif register_demo:
            import httpx
            auth = {"authorization": f"Bearer {key}"} if key else {}
            r = httpx.post(f"{base}/v1/skills", json={"name": DEMO_SKILL_NAME, "text": DEMO_SKILL}, headers=auth,
                           timeout=300)
            if r.status_code != 201:
                raise RuntimeError(f"registering the demo skill failed: HTTP {r.status_code}: {r.text[:300]}")
            print(f"kvnotes: registered demo skill '{DEMO_SKILL_NAME}' ({r.json()['tokens']} tokens precompiled)")
    except ConnectError:
        raise                          # nothing was started
    except BaseException:
        print("kvnotes: start failed; stopping what was started", flush=True)
        stop(cfg)
        raise
    # the key read by the shell's own printf (a builtin: never on a command line `ps` shows)
    hdr = (f"-H @<(printf 'authorization: Bearer %s' \"$(cat {cfg.state.api_key_file})\") "
           if cfg.server.auth else "")
    print(f"""kvnotes: serving {cfg.workers.model} on {base}  (Ctrl-C to stop)
  curl -s {base}/v1/notes/completions {hdr}-H 'content-type: application/json' -d '{{"segments": [{{"skill": "{DEMO_SKILL_NAME}"}}, {{"text": "{DEMO_QUESTION}"}}], "max_tokens": 48, "temperature": 0, "explain": true}}'
  curl -s {base}/v1/chat/completions {hdr}-H 'content-type: application/json' -d '{{"model": "{cfg.served_name(spec.name)}", "messages": [{{"role": "user", "content": "Hi!"}}], "max_tokens": 32}}'
  kvnotes status --url {base}     # workers, state, tier (the key read from {cfg.state.api_key_file}, or $KVNOTES_API_KEY)
  metrics: every process is listed at {base}/metrics/targets (Prometheus: deploy/prometheus.yml);
  dashboard: deploy/grafana/kvnotes.json; without Grafana: kvnotes report --prometheus URL --out DIR""", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    print("kvnotes: stopping...", flush=True)
    stop(cfg)
    print("kvnotes: stopped", flush=True)
    return 0
