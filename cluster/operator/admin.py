"""Operator commands over the router's HTTP API: ``kvnotes status`` and ``kvnotes skills|memories|
templates list|add|rm``. They are plain HTTP clients with the same authentication as any other
client (``Authorization: Bearer <key>``), so they work against any replica of any deployment and
never touch the state store or Ray directly.

Where the URL and key come from, first match wins: ``--url`` / ``--key``; the environment
(``KVNOTES_URL``, ``KVNOTES_API_KEY``); ``--config FILE`` (the router's host and port, and the key
file ``<data_dir>/api_key`` the embedded cluster writes); else ``http://127.0.0.1:8000``.
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

KINDS = {"skills": "skill", "memories": "memory", "templates": "template"}
_NAME_OK = re.compile(r"[^A-Za-z0-9._-]+")
TEXT_SUFFIXES = (".txt", ".md", ".json")


class AdminError(RuntimeError):
    """A failure to report in one line (the CLI exits 2)."""


@dataclass(frozen=True)
class Target:
    url: str
    key: str | None

    @property
    def headers(self) -> dict:
        return {"authorization": f"Bearer {self.key}"} if self.key else {}


def resolve_target(url: str | None, key: str | None, config: str | None) -> Target:
    cfg = None
    if config:
        from kvruntime.config import ClusterConfig
        cfg = ClusterConfig.from_file(config)
    url = url or os.environ.get("KVNOTES_URL") or (
        f"http://{'127.0.0.1' if cfg.server.host in ('0.0.0.0', '::') else cfg.server.host}:{cfg.server.port}" if cfg else
        "http://127.0.0.1:8000")
    key = key or os.environ.get("KVNOTES_API_KEY")
    if not key:                  # the key file of the config's state store (the embedded default's without one)
        from kvruntime.config import ClusterConfig
        f = (cfg or ClusterConfig()).state.api_key_file
        if f.exists():
            key = f.read_text().strip()
    return Target(url.rstrip("/"), key)


def _request(t: Target, method: str, path: str, body: dict | None = None, timeout: float = 600.0):
    import httpx
    try:
        r = httpx.request(method, t.url + path, json=body, headers=t.headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise AdminError(f"cannot reach the router at {t.url}: {exc}") from None
    if r.status_code >= 400:
        try:
            err = r.json().get("error", {})
            msg = err.get("message", r.text[:200]) if isinstance(err, dict) else str(err)
        except ValueError:
            msg = r.text[:200]
        raise AdminError(f"{method} {path}: HTTP {r.status_code}: {msg}")
    return r


def _metrics(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text format -> {name: [(labels, value)]} (comments skipped)."""
    out: dict[str, list] = {}
    for line in text.splitlines():
        m = re.match(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$', line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        try:
            out.setdefault(m.group(1), []).append((labels, float(m.group(3))))
        except ValueError:
            continue
    return out


def status(t: Target, out=sys.stdout) -> int:
    """Workers per role with health and load, state store sizes, tier and remote tier state."""
    import httpx
    try:
        h = httpx.get(t.url + "/health", headers=t.headers, timeout=30)
    except httpx.HTTPError as exc:
        raise AdminError(f"cannot reach the router at {t.url}: {exc}") from None
    health = h.json() if h.headers.get("content-type", "").startswith("application/json") else {}
    model = health.get("model", "?")
    if isinstance(model, dict):          # name, id (weights), calibrated, profile
        model = (f"{model.get('name', '?')} ({model.get('id', '?')}, "
                 f"{'calibrated' if model.get('calibrated') else 'NOT calibrated: balanced = exact reuse only'})")
    print(f"router   {t.url}  HTTP {h.status_code}  status={health.get('status', '?')}  model={model}", file=out)
    workers = health.get("workers") or {}
    for role, info in sorted(workers.items()) if isinstance(workers, dict) else ():
        print(f"workers  {role}: {info.get('live', '?')}/{info.get('total', '?')} alive", file=out)
        for w in info.get("workers", []) if isinstance(info, dict) else []:
            extra = "  ".join(f"{k}={v}" for k, v in w.items() if k not in ("name", "alive"))
            print(f"  {w.get('name', '?'):<12} {'alive' if w.get('alive') else 'DOWN':<6} {extra}", file=out)
    m = _metrics(_request(t, "GET", "/metrics").text)

    def one(name, **labels):
        vals = [v for lab, v in m.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
        return vals[0] if vals else None

    state = {lab.get("kind"): int(v) for lab, v in m.get("kvnotes_state_entries", [])}
    if state:
        print("state    " + "  ".join(f"{k}={v}" for k, v in sorted(state.items())), file=out)
    remote = one("kvnotes_tier_remote_up")
    print(f"tier     remote={'n/a' if remote is None else ('up' if remote >= 1 else 'DOWN')}", file=out)
    # each prefill actor's own endpoint (found like Prometheus finds it): what its tiers hold now
    for g in _request(t, "GET", "/metrics/targets").json():
        if g["labels"].get("kvnotes_role") != "prefill":
            continue
        try:
            wm = _metrics(httpx.get(f"http://{g['targets'][0]}/metrics", timeout=10).text)
        except httpx.HTTPError as exc:
            print(f"  {g['labels'].get('kvnotes_process')}: metrics unreachable ({type(exc).__name__})", file=out)
            continue
        held = "  ".join(f"{lab.get('tier')}={v / 2**20:.1f} MiB" for lab, v in wm.get("kvnotes_tier_bytes", []))
        print(f"  {g['labels'].get('kvnotes_process'):<12} {held or 'no local tier'}", file=out)
    for kind in ("skills", "memories"):
        items = _request(t, "GET", f"/v1/{kind}").json().get("data", [])
        out_of = [i["name"] for i in items if not i.get("in_tier")]
        print(f"{kind:<8} {len(items)} registered, {len(items) - len(out_of)} in the tier"
              + (f" (out: {', '.join(out_of[:5])}{' ...' if len(out_of) > 5 else ''})" if out_of else ""), file=out)
    return 0 if h.status_code == 200 else 1


def list_kind(t: Target, kind: str, out=sys.stdout) -> int:
    items = _request(t, "GET", f"/v1/{kind}").json().get("data", [])
    if kind == "templates":
        for i in items:
            print(f"{i['name']:<32} v{i.get('version', '?'):<4} fields={','.join(i.get('fields', []))}", file=out)
    else:
        for i in items:
            print(f"{i['name']:<32} {i.get('tokens', '?'):>6} tokens  "
                  f"{'in tier' if i.get('in_tier') else 'OUT of tier'}  key={str(i.get('key', ''))[:12]}", file=out)
    print(f"{len(items)} {kind}", file=out)
    return 0


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not found:
            raise AdminError(f"{path}: no {', '.join(TEXT_SUFFIXES)} files to add")
        return found
    raise AdminError(f"{path}: no such file or directory")


def _payload(kind: str, f: Path, name: str | None) -> dict:
    try:
        text = f.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise AdminError(f"{f}: not UTF-8 text") from None
    name = name or _NAME_OK.sub("-", f.stem).strip("-")
    if kind == "templates" and f.suffix == ".json":
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise AdminError(f"{f}: not valid JSON: {exc}") from None
        if not isinstance(body, dict) or "text" not in body:
            raise AdminError(f'{f}: a template file holds {{"text": ..., "labels": {{...}}}}')
        return {"name": body.get("name", name), **{k: body[k] for k in ("text", "labels") if k in body}}
    return {"name": name, "text": text}


def add(t: Target, kind: str, path: str, name: str | None = None, out=sys.stdout) -> int:
    """Register one file, or every text file of a directory (name = file stem), with a progress
    bar; every file is tried, failures are listed, and the exit code says whether any failed."""
    from tqdm import tqdm
    files = _files(Path(path))
    if name and len(files) > 1:
        raise AdminError("--name applies to a single file, not a directory")
    failed = []
    bar = tqdm(files, desc=f"adding {kind}", unit="file", file=sys.stderr, disable=len(files) < 2)
    for f in bar:
        body = _payload(kind, f, name)
        bar.set_postfix_str(body["name"][:24])
        try:
            r = _request(t, "POST", f"/v1/{kind}", body).json()
        except AdminError as exc:
            failed.append(f"{f.name}: {exc}")
            continue
        if kind == "templates":
            tqdm.write(f"{r['name']}: template v{r.get('version')} fields={','.join(r.get('fields', []))}", file=out)
        else:
            tqdm.write(f"{r['name']}: {r['tokens']} tokens, "
                       f"{'already in the tier' if r.get('cached') else 'precompiled in %.2f s' % r.get('seconds', 0)}",
                       file=out)
    for line in failed:
        print(f"failed: {line}", file=sys.stderr)
    print(f"{len(files) - len(failed)}/{len(files)} {kind} added", file=out)
    return 1 if failed else 0


def remove(t: Target, kind: str, name: str, out=sys.stdout) -> int:
    from urllib.parse import quote
    r = _request(t, "DELETE", f"/v1/{kind}/{quote(name, safe='')}").json()
    print(f"{name}: deleted" + (", evicted from the tier" if r.get("evicted") else ""), file=out)
    return 0
