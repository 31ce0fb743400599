"""Every process exports its own Prometheus series on its own port.

Router replicas, prefill actors and decode actors each call :func:`start_exporter` once: a
``prometheus_client`` HTTP server on a free port of :func:`listen_host`, serving that process'
registry (a decode actor running vLLM serves the process-wide default registry, where vLLM's
engine metrics ``vllm:*`` live). Nothing is aggregated in one process: Prometheus scrapes every
endpoint, found through the router's HTTP service discovery (``GET /metrics/targets``, see
``deploy/prometheus.yml``), and the dashboard sums across processes. A restarted process starts
its counters at zero, which ``rate()`` treats as a counter reset: nothing is double counted and
nothing is lost but the restarted process' unscraped last seconds.
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)
_fallbacks_logged: set[str] = set()
_fallbacks_lock = threading.Lock()


def log_fallback_once(logger: logging.Logger, reason: str, msg: str, *args) -> None:
    """A fallback's warning, once per process and ``reason`` (``msg % args`` on ``logger``); every
    occurrence is counted by the caller in ``kvnotes_fallbacks_total{reason}``, which the line names."""
    with _fallbacks_lock:
        if reason in _fallbacks_logged:
            return
        _fallbacks_logged.add(reason)
    logger.warning("%s (counted in kvnotes_fallbacks_total{reason=%s}; logged once)",
                   msg % args if args else msg, reason)


def node_ip() -> str:
    """The node's address as Ray reports it ("127.0.0.1" outside Ray)."""
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # no Ray runtime here: a loopback-only exporter (tests, one process)
        pass
    return "127.0.0.1"


def listen_host(bind_host: str | None = None) -> str:
    """The address kvnotes' own listeners bind and advertise: ``bind_host`` (config) when set,
    else the address Ray runs on (:func:`node_ip`; 127.0.0.1 on a loopback node). Never 0.0.0.0."""
    return bind_host or node_ip()


def start_exporter(registry=None, host: str = "127.0.0.1", port: int = 0) -> str:
    """Serve ``registry`` (default: the process-wide one) on ``host`` at ``port`` (0: a free one); returns
    ``"host:port"`` as a Prometheus target. Raises OSError when the port cannot be bound.

    Always the classic text format (0.0.4), whatever the scraper accepts: ``prometheus_client``'s
    own server answers an OpenMetrics-accepting Prometheus with names escaped to underscores, so
    vLLM's ``vllm:prefix_cache_queries_total`` would arrive as ``vllm_prefix_cache_queries_total``
    and match no dashboard query."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import REGISTRY, generate_latest

    reg = registry if registry is not None else REGISTRY

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] not in ("/", "/metrics"):
                self.send_error(404)
                return
            try:
                body = generate_latest(reg)
            except Exception as exc:   # a collector failed: the scrape fails visibly (up = 0)
                log.warning("metrics collection failed: %s", exc)
                self.send_error(500, str(exc)[:200])
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):    # scrapes every few seconds: not worth a log line each
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kvnotes-metrics", daemon=True).start()
    target = f"{host}:{server.server_address[1]}"
    log.info("metrics exported on http://%s/metrics", target)
    return target
