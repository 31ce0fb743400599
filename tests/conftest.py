"""Shared fixtures: real engines, loaded once per test session (each load is ~5 s)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

_ENGINES: dict = {}


class DictSource:
    """An in-memory tier for executor/router tests (the shipped tier is LMCache behind
    ``prefill_workers.tier_reads.PrefillTier``, tested in test_tier*). Keyed by content like it."""

    def __init__(self, engine=None):
        self.d, self.engine, self.compiled = {}, engine, 0

    @staticmethod
    def _k(ref):
        return (ref.token_ids, ref.position, ref.tenant_salt, ref.approx, ref.prefix)

    def get(self, ref):
        return self.d.get(self._k(ref))

    def put(self, ref, kv):                 # copies, like the real tier (KVStore.put)
        from kvruntime.kv import KVCache
        self.d[self._k(ref)] = KVCache(kv.data.clone(), kv.positions.clone(), kv.token_ids.clone())
        return kv.nbytes

    def compile(self, ref):
        from kvruntime.ops import precompile_chunk
        context = ref.position == 0 and ref.prefix is None     # a stored context: from position 0 (PrefillTier)
        kv = precompile_chunk(self.engine, list(ref.token_ids), [] if context else
                              None if ref.prefix is None else list(ref.prefix))
        self.compiled += 1
        self.put(ref, kv)
        return kv


def api_key(cfg) -> str:
    """The key the embedded default created on its first start (``cluster.operator.launcher.start``)."""
    return cfg.state.api_key_file.read_text().strip()


def http_client(cfg, **kw):
    """An httpx client for a started cluster, sending its API key (``Authorization: Bearer``)."""
    import httpx
    return httpx.Client(base_url=f"http://127.0.0.1:{cfg.server.port}", timeout=kw.pop("timeout", 300),
                        headers={"authorization": f"Bearer {api_key(cfg)}", **kw.pop("headers", {})}, **kw)


def wait_for(pred, timeout_s: float, what: str, every: float = 0.5):
    """``pred()``'s first truthy value, polled every ``every`` s; AssertionError naming ``what``
    after ``timeout_s`` (fault tests stay bounded in time)."""
    import time
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server(workdir, *args: str):
    """A real redis-server (Debian package) on a free loopback port with extra ``args`` (e.g.
    ``--requirepass``); yields its port once it answers; stopped by PID."""
    import shutil
    import subprocess
    import time

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (scripts/dev.sh test installs Debian's redis-server)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import socket
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def redis_url(tmp_path):
    """A real redis-server without a password: ``redis://127.0.0.1:PORT/0``."""
    with redis_server(tmp_path) as port:
        yield f"redis://127.0.0.1:{port}/0"


REDIS_PASSWORD = "s3cret-Pa55:w/rd"          # characters that must survive URL quoting


@pytest.fixture
def redis_auth_url(tmp_path):
    """A real redis-server with ``--requirepass``: ``redis://:PASSWORD@127.0.0.1:PORT/0`` (quoted)."""
    from urllib.parse import quote
    with redis_server(tmp_path, "--requirepass", REDIS_PASSWORD) as port:
        yield f"redis://:{quote(REDIS_PASSWORD, safe='')}@127.0.0.1:{port}/0"


def get_engine(name: str):
    from kvruntime.engine import ReferenceEngine

    if name not in _ENGINES:
        # 1 thread: with Ray actors and test subprocesses on 2 cores, 2 threads ran ~25x slower
        _ENGINES[name] = ReferenceEngine(name, dtype="float32", threads=1)
    return _ENGINES[name]


@pytest.fixture(scope="module")
def one_torch_thread():
    """1 torch thread for a module: on this 2-core machine, with other jobs running, a prefill
    with 2 threads measured 25x slower than with 1 (OpenMP threads wait on each other)."""
    import torch
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def smol():
    return get_engine("smollm2-135m")


@pytest.fixture(scope="session")
def gemma():
    return get_engine("gemma3-270m")


@pytest.fixture(params=["smollm2-135m", "gemma3-270m"])
def engine(request):
    return get_engine(request.param)


def metric(text: str, name: str, **labels) -> float:
    """Sum of the Prometheus text-format samples named ``name`` whose labels include ``labels``."""
    import re
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            m = re.match(rf'{re.escape(name)}(\{{[^}}]*\}})?\s+([0-9.e+-]+)$', line)
            if m:
                total += float(m.group(2))
    return total


def direct_text(prompt_ids, n: int, model: str = "smollm2-135m") -> str:
    """Greedy continuation of ``prompt_ids`` by a full recompute in this process (the oracle)."""
    from kvruntime.ops import recompute

    e = get_engine(model)
    out = recompute(e, list(prompt_ids))
    toks = []
    for t in e.greedy(out.kv, out.logits, n, stop_at_eos=True):
        if t in e.eos_ids:
            break
        toks.append(t)
    return e.decode(toks)


def sd_prometheus_config(router_base: str, scrape_s: str = "1s") -> str:
    """deploy/prometheus.yml as shipped (HTTP service discovery through the router), pointed at
    ``router_base`` with short scrape and refresh intervals; its rule file name is kept."""
    from pathlib import Path

    import yaml
    conf = yaml.safe_load((Path(__file__).resolve().parent.parent / "deploy" / "prometheus.yml").read_text())
    conf["global"]["scrape_interval"] = scrape_s
    for job in conf["scrape_configs"]:
        for sd in job["http_sd_configs"]:
            sd["url"] = f"{router_base}/metrics/targets"
            sd["refresh_interval"] = "2s"
    return yaml.safe_dump(conf)


@contextlib.contextmanager
def prometheus_server(config_text: str, workdir, files: dict | None = None):
    """Debian's prometheus with ``config_text`` (and ``files`` copied beside it) on a free loopback
    port; yields its base URL once ready; stopped by PID."""
    import shutil
    import subprocess
    import time
    import urllib.request
    from pathlib import Path

    exe = shutil.which("prometheus")
    if exe is None:
        pytest.fail("prometheus is not installed (scripts/dev.sh test installs Debian's prometheus)")
    d = Path(workdir)
    d.mkdir(parents=True, exist_ok=True)
    for name, src in (files or {}).items():
        shutil.copy(src, d / name)
    (d / "prometheus.yml").write_text(config_text)
    port = free_port()
    log = open(d / "log.txt", "wb")
    proc = subprocess.Popen([exe, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"prometheus exited: {(d / 'log.txt').read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(base + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready: {(d / 'log.txt').read_text()[-2000:]}"
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def prom_query(base: str, expr: str) -> list:
    """Result vector of an instant query (raises on an HTTP error or a failed query)."""
    import json
    import urllib.parse
    import urllib.request
    with urllib.request.urlopen(f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> directory of a tiny random-weight HF checkpoint (tests/tiny_checkpoints.py)."""
    from tests.tiny_checkpoints import build_all
    return build_all(tmp_path_factory.mktemp("tiny-checkpoints"))


def tiny_engine(checkpoints: dict, family: str, dtype: str = "float32", device: str = "cpu"):
    """The reference engine of a tiny checkpoint, loaded once per session, dtype and device."""
    from kvruntime.engine import ReferenceEngine
    key = (str(checkpoints[family]), dtype) if device == "cpu" else (str(checkpoints[family]), dtype, device)
    if key not in _ENGINES:
        _ENGINES[key] = ReferenceEngine(str(checkpoints[family]), dtype=dtype, threads=1, device=device)
    return _ENGINES[key]


# ---- one local Ray for the cluster modules -------------------------------------------------------
# A local Ray (GCS, raylet, its agents, idle workers) costs seconds to start and stop, and a loaded
# 2-core machine sometimes fails to start one. Cluster fixtures that ask for ``local_ray`` share a
# single one: ``start_cluster`` starts it on first use, ``stop_cluster`` stops that module's cluster
# (its Serve app; its worker actors are parked for a next cluster with the same worker settings, else
# stopped by the next start) and keeps Ray for the next module. Those modules
# run one after another, at the end (pytest_collection_modifyitems), and Ray is shut down before the
# first test that does not ask for it: no other test, and no subprocess's ``ray.init()``, finds it.
_RAY = {"owned": False, "active": False, "serve": None,   # serve: (host, port) of the kept Serve proxy
        "parked": None}     # (worker signature, cfg) of the worker actors the last cluster left running
RAY_CPUS = 5                    # the most any shared-Ray module asks for (test_faults: 2 + 2 actors + router)


@pytest.fixture(scope="session")
def local_ray():
    """Marks a (module) cluster fixture as one on the session's shared local Ray (start_cluster)."""
    return None


def shared_ray(cfg, local_cpus: int = 4, reuse_workers: bool = False) -> None:
    """The shared local Ray, started if needed (with at least ``local_cpus`` CPUs); call only while
    no other cluster of this process runs. Parked worker actors are stopped, except, with
    ``reuse_workers``, those started with ``cfg``'s worker settings."""
    import ray

    from cluster.operator.launcher import start_local_ray
    if ray.is_initialized() and ray.cluster_resources().get("CPU", 0) < local_cpus:
        ray.shutdown()
    if not ray.is_initialized():
        _RAY.update(serve=None, parked=None)
        start_local_ray(cfg, max(local_cpus, RAY_CPUS))
    _RAY.update(owned=True, active=True)
    _stop_parked(keep=_worker_signature(cfg) if reuse_workers else None)


# ---- worker actors kept from one cluster to the next with the same worker settings ---------------
# The prefill and decode actors (a process each, the model loaded: most of a cluster's start) read
# only the config's workers, tier and transport sections and the bind host; the router reads the
# rest (limits, auth, state store, proxies). ``stop_cluster`` leaves the actors running ("parked");
# the next ``start_cluster`` whose actors would be started with the same settings finds them by
# name (``get_if_exists``) under its own router, any other start stops them first. What they keep is
# salted per state store (each cluster's secret), so one cluster's tier holds nothing another can
# hit; their own exporters' counters go on (tests read worker counters as deltas).
def _worker_signature(cfg) -> tuple:
    return (cfg.workers, cfg.tier, cfg.transport, cfg.server.bind_host)


def _stop_parked(keep: tuple | None = None) -> None:
    """Stop the parked worker actors (waited for until Ray no longer finds them) unless their
    signature is ``keep``."""
    parked = _RAY["parked"]
    if parked is None or parked[0] == keep:
        return
    _RAY["parked"] = None
    import ray
    if ray.is_initialized():
        _stop_workers_waited(parked[1])


_CLUSTER_PORT: list = []


def cluster_port() -> int:
    """The router port of every cluster on the shared Ray (``start_cluster``): one per session, so
    Serve's controller and HTTP proxy (~8 s to start and stop) are kept from one cluster to the next
    and only the ``kvnotes`` app is replaced. A cluster on another port or host gets a fresh Serve."""
    if not _CLUSTER_PORT:
        _CLUSTER_PORT.append(free_port())
    return _CLUSTER_PORT[0]


def _serve_for(cfg) -> None:
    """Shut down the kept Serve when ``cfg`` serves on another host or port (its proxy listens
    where the first cluster asked; ``serve.start`` would silently keep that)."""
    from ray import serve
    want = (cfg.server.host, cfg.server.port)
    if _RAY["serve"] is not None and _RAY["serve"] != want:
        serve.shutdown()
        _RAY["serve"] = None


def start_cluster(cfg, local_cpus: int = 4) -> None:
    """``cluster.operator.launcher.start`` on the shared local Ray (the fixture asks for ``local_ray``)."""
    from cluster.operator.launcher import start
    shared_ray(cfg, local_cpus, reuse_workers=True)
    _RAY["parked"] = None               # this cluster's now (found by name, or started)
    _serve_for(cfg)
    try:
        start(cfg, local_cpus=local_cpus)
        _RAY["serve"] = (cfg.server.host, cfg.server.port)
    except BaseException:
        stop_cluster(cfg, park=False)   # actors of a failed start are not handed to the next cluster
        raise


def stop_cluster(cfg, park: bool = True) -> None:
    """Stop what ``start_cluster`` started except Ray and Serve's controller and proxy (kept for the
    next cluster on ``cluster_port()``): the ``kvnotes`` app (its router replicas); the worker actors
    are parked for the next cluster with the same worker settings (``park``; else, or when the
    app's stop failed, stopped and waited for until Ray no longer finds them, so the next cluster's
    get_if_exists cannot get a dying one). Safe to call twice."""
    import ray
    from ray import serve

    _RAY["active"] = False
    if not ray.is_initialized():
        return
    try:
        if _RAY["serve"] is None:
            serve.shutdown()            # a Serve this module started itself (or a failed start)
        elif "kvnotes" in serve.status().applications:
            serve.delete("kvnotes")
    except Exception:                   # the kept Serve is in doubt: a fresh one for the next cluster
        serve.shutdown()
        _RAY["serve"] = None
        park = False
    finally:
        if not park:
            if _RAY["parked"] is not None and _RAY["parked"][0] == _worker_signature(cfg):
                _RAY["parked"] = None
            _stop_workers_waited(cfg)
        elif _RAY["parked"] is None:    # (a second call finds them parked already)
            _RAY["parked"] = (_worker_signature(cfg), cfg)


def _stop_workers_waited(cfg) -> None:
    """Kill ``cfg``'s worker actors and wait (at most 60 s) until Ray no longer finds them."""
    import time

    import ray

    from cluster.control.ray_backends import NAMESPACE, stop_workers
    stop_workers(cfg)
    names = [f"prefill-{i}" for i in range(cfg.workers.prefill.count)] + [f"decode-{i}" for i in range(cfg.workers.decode.count)]
    deadline = time.monotonic() + 60
    for name in names:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            time.sleep(0.1)


# A cluster fixture that several modules ask for (by the same name) is started once while they run
# one after another: ``kept(name, make)`` in the fixture body keeps what the generator ``make()``
# yields until the next test's module does not ask for ``name``, then runs the rest of ``make()``.
# Only for clusters whose tests leave them as found for the next module (no actor killed, no
# setting changed); a module asking for one asks for no other cluster.
_KEPT: dict = {}                # fixture name -> [value, generator]
_MODULE_FIXTURES: dict = {}     # module name -> every fixture name its tests ask for


def kept(name: str, make):
    if name not in _KEPT:
        gen = make()
        _KEPT[name] = [next(gen), gen]
    return _KEPT[name][0]


def release_kept(name: str) -> None:
    """Stop the kept ``name`` now, if it runs (before another cluster starts in this process)."""
    if name not in _KEPT:
        return
    _, gen = _KEPT.pop(name)
    try:
        next(gen)
    except StopIteration:
        pass


def _uses(item) -> set:
    """The fixtures ``item``'s module asks for, and the kept clusters it names in ``KEEPS`` (a
    module that takes one through ``kept()`` itself, for some parameters only)."""
    mod = getattr(item, "module", None)
    return _MODULE_FIXTURES.get(getattr(mod, "__name__", None), set()) | set(getattr(mod, "KEEPS", ()))


@pytest.fixture(scope="module")
def default_cluster(tmp_path_factory, local_ray):
    """The default config (SmolLM2, one prefill and one decode actor, a 256 MiB tier, API keys on):
    ``(cfg, client sending the key)``, kept for the modules that ask for it (test_e2e_cluster,
    test_e2e_held_prefix, test_e2e_structured, test_prompt_reuse, test_request_pricing, and
    test_e2e_default_compose's SmolLM2 case); each registers only names and texts of its own and
    asserts counters by their change."""
    return kept("default_cluster", lambda: _default_cluster(tmp_path_factory))


def _default_cluster(tmp_path_factory):
    from kvruntime.config import ClusterConfig
    cfg = ClusterConfig.of(port=cluster_port(), tier_cpu_bytes=256 << 20, data_dir=str(tmp_path_factory.mktemp("state")))
    start_cluster(cfg, local_cpus=4)
    client = http_client(cfg)
    try:
        assert client.get("/health").json()["status"] == "ok"
        yield cfg, client
    finally:
        client.close()
        stop_cluster(cfg)


@pytest.hookimpl(tryfirst=True)         # before ``-m`` deselects by marker, and before xdist reads groups
def pytest_collection_modifyitems(config, items):
    """The ``ray`` marker: tests on the shared local Ray (they ask for ``local_ray``) get it here;
    tests that start a local Ray themselves (``start_local_ray``, ``kvnotes serve``) declare it.

    Under pytest-xdist (``scripts/dev.sh test`` with no arguments: ``-n 2``) each test belongs to a
    unit: its module, or the kept cluster its module asks for; tests/xdist_units.py hands each unit
    whole to the next free worker, so each module- or kept-scoped cluster starts once. Each worker
    is its own process with its own local Ray."""
    for it in items:
        if "local_ray" in getattr(it, "fixturenames", ()):
            it.add_marker(pytest.mark.ray)
    _index_module_fixtures(items)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from tests.xdist_units import write_units
        write_units({it.nodeid.split("::", 1)[0]: _unit(it) for it in items})


class _ClusterOrder:
    """Ordering of the cluster modules (a second ``pytest_collection_modifyitems``, run last)."""

    @staticmethod
    @pytest.hookimpl(trylast=True)      # after pytest's own reordering by fixture parameters
    def pytest_collection_modifyitems(session, config, items):
        if _distributed(config):
            _order_longest_units_first(items)
        else:
            _order_cluster_modules_last(items)


def pytest_configure(config):
    config.pluginmanager.register(_ClusterOrder(), "kvnotes-cluster-order")
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        import tempfile                 # the controller: where its workers publish the units (xdist_units)
        from tests.xdist_units import ENV
        os.environ[ENV] = str(Path(tempfile.mkdtemp(prefix="kvnotes-units-")) / "units.json")
        _convert_shipped_models()


# After a model's conversion: vLLM's model-class inspection of its architecture, cached under
# VLLM_CACHE_ROOT/modelinfos. vLLM runs it in a subprocess of its own (vLLM imported again: 64 s
# of Gemma's 101 s decode-actor start at load 12, 74.2 s -> 11.8 s for EngineArgs' config cold ->
# cached) on the first start of each architecture on a machine, i.e. inside a test's cluster
# start while the other worker runs; done here, beside the other model's conversion. Best effort
# (no vLLM, or a vLLM without this private method: vLLM inspects at its first start, as before).
_WARM_VLLM = """
import glob, json, os
archs = json.loads((ckpt / "config.json").read_text())["architectures"]
root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "vllm")
if not all(glob.glob(os.path.join(os.path.expanduser(root), "modelinfos", f"*-{a}.json")) for a in archs):
    try:
        from vllm.model_executor.models.registry import ModelRegistry
        for a in archs:
            ModelRegistry._try_inspect_model_cls(a)
    except ImportError:
        pass
    except Exception as exc:
        print(f"kvnotes tests: vLLM's inspection of {archs} not cached ahead ({exc!r}): its first start does it",
              file=sys.stderr)
"""


def _convert_shipped_models() -> None:
    """The shipped models converted once, before the xdist workers start: on a fresh machine every
    worker and every actor it starts would otherwise convert the same GGUF side by side. One
    process per model, at once (transformers' lazy imports are not thread-safe); a converted one
    is found in a second. Each then has vLLM inspect its architecture once (``_WARM_VLLM``)."""
    import subprocess
    import sys
    code = ("import sys; from kvruntime.checkpoint import ensure_checkpoint; "
            "from kvruntime.models import get_model_spec; ckpt = ensure_checkpoint(get_model_spec(sys.argv[1]))"
            + _WARM_VLLM)
    names = ("smollm2-135m", "gemma3-270m")
    root = Path(__file__).resolve().parent.parent
    procs = [subprocess.Popen([sys.executable, "-c", code, n], cwd=root) for n in names]
    failed = [n for n, p in zip(names, procs) if p.wait() != 0]
    if failed:
        raise pytest.UsageError(f"converting the shipped model(s) {failed} failed: see the lines above")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from tests.xdist_units import UnitScheduling
    return UnitScheduling(config, log)


def _distributed(config) -> bool:
    """True in a pytest-xdist worker, or a controller that hands out work (``-n``)."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or bool(getattr(config.option, "numprocesses", None))


def _module_name(item) -> str | None:
    return getattr(getattr(item, "module", None), "__name__", None)


def _index_module_fixtures(items) -> None:
    """``_MODULE_FIXTURES``: every fixture name each module's tests ask for, and its ``KEEPS``."""
    _MODULE_FIXTURES.clear()
    for it in items:
        mod = getattr(it, "module", None)
        _MODULE_FIXTURES.setdefault(_module_name(it), set()).update(
            getattr(it, "fixturenames", ()), getattr(mod, "KEEPS", ()))


def _unit(item) -> str:
    """The unit of work ``item`` belongs to: the kept cluster its module asks for, else the
    ``WORKERS_UNIT`` its module names (modules whose clusters start the same worker actors, which
    they then take over one from the next: ``stop_cluster``), else its module."""
    names = _MODULE_FIXTURES.get(_module_name(item), set())
    return (next((k for k in KEPT_CLUSTERS if k in names), None)
            or getattr(getattr(item, "module", None), "WORKERS_UNIT", None) or str(_module_name(item)))


_COSTS: dict = {}


# an unlisted module: a short one, unless a test of it is marked slow (a real model, a cluster):
# then a long one, so it is not handed out last, where it would leave the other worker idle
UNLISTED_S, UNLISTED_SLOW_S = 2.0, 40.0


def _cost(module: str | None, slow: bool = False) -> float:
    """Seconds a module took alone on a quiet 2-core machine (tests/test_costs.json, refreshed with
    ``scripts/test_costs.py``); a module not listed: ``UNLISTED_SLOW_S`` when ``slow`` (one of its
    tests is marked slow), else ``UNLISTED_S``."""
    if not _COSTS:
        import json
        _COSTS.update(json.loads((Path(__file__).parent / "test_costs.json").read_text()))
    return float(_COSTS.get(f"{str(module).rpartition('.')[2]}.py", UNLISTED_SLOW_S if slow else UNLISTED_S))


def _order_longest_units_first(items):
    """For xdist (tests/xdist_units.py: each unit goes whole to the next free worker, in this order): the
    longest units first, so the two workers end together; the units on the shared local Ray before
    the others, so a worker starts its Ray once and stops it once. Each unit's own order is kept."""
    _index_module_fixtures(items)
    mods: dict = {}                     # unit -> its modules, in collection order
    slow: set = set()                   # modules with a test marked slow
    for it in items:
        mods.setdefault(_unit(it), {})[_module_name(it)] = None
        if it.get_closest_marker("slow") is not None:
            slow.add(_module_name(it))
    rank = {u: (not any("local_ray" in _MODULE_FIXTURES.get(m, ()) for m in ms),
                -sum(_cost(m, m in slow) for m in ms), i) for i, (u, ms) in enumerate(mods.items())}
    # stable: each unit's own order kept, but a module taking a kept cluster for some parameters
    # only (``KEEPS``) last in its unit, so the kept cluster is not stopped and started again
    items.sort(key=lambda it: (rank[_unit(it)], bool(getattr(getattr(it, "module", None), "KEEPS", ()))))


def _order_cluster_modules_last(items):
    """Modules with a ``local_ray`` cluster run last, one after another, those asking for the same
    kept cluster next to each other (each module's own order, and every other module's, unchanged)."""
    _index_module_fixtures(items)
    shared = [m for m, names in _MODULE_FIXTURES.items() if "local_ray" in names]
    if not shared:
        return

    keeps = {_module_name(it) for it in items if getattr(getattr(it, "module", None), "KEEPS", ())}

    units = {_module_name(it): getattr(it.module, "WORKERS_UNIT", "") for it in items if hasattr(it, "module")}

    def group(mod):                     # modules keeping the same cluster (or naming the same WORKERS_UNIT):
        names = _MODULE_FIXTURES[mod]   # adjacent, in name order, those taking it for some parameters only last
        return (min((i for i, k in enumerate(KEPT_CLUSTERS) if k in names), default=len(KEPT_CLUSTERS)),
                units.get(mod, ""), mod in keeps)
    order = {m: i for i, m in enumerate(sorted(shared, key=lambda m: (group(m), shared.index(m))))}
    rest = [it for it in items if _module_name(it) not in order]
    block = [it for it in items if _module_name(it) in order]
    block.sort(key=lambda it: order[it.module.__name__])        # stable: each module's own order kept
    items[:] = rest + block


KEPT_CLUSTERS = ("default_cluster", "vllm_cluster")


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    yield                                   # this item's (and an ending module's) fixtures are finalised now
    upcoming = set() if nextitem is None else _uses(nextitem)
    for name in [n for n in _KEPT if n not in upcoming]:
        release_kept(name)
    if _RAY["owned"] and not _RAY["active"] and not _KEPT and "local_ray" not in upcoming:
        import ray
        _RAY.update(owned=False, serve=None, parked=None)     # parked workers go with Ray
        if ray.is_initialized():
            ray.shutdown()


@pytest.hookimpl(trylast=True)          # after the fixtures still set up are finalised
def pytest_sessionfinish(session, exitstatus):
    """A run stopped early (-x, Ctrl-C) skips the last teardown: stop what is kept, and our Ray."""
    for name in list(_KEPT):
        release_kept(name)
    if _RAY["owned"]:
        import ray
        _RAY.update(owned=False, active=False, serve=None, parked=None)
        if ray.is_initialized():
            ray.shutdown()
