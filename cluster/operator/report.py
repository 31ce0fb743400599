"""``kvnotes report``: the Grafana dashboard's panels rendered to PNG without Grafana.

Grafana cannot be installed on every machine (none of our build hosts can reach a package of it),
so the report asks Prometheus the dashboard's own queries (:data:`cluster.operator.dashboard.ROWS`, the
single source of every panel) over a time range through its HTTP API (``/api/v1/query_range``)
and draws each row as one PNG with matplotlib, plus ``index.md`` listing every panel, its query
and whether it returned data. A panel with no series is drawn as "no data" and listed, never
dropped: an empty panel is a finding (a metric not exported, a plan kind never exercised).
``index.md`` also tabulates the shadow checks per operation over the range (checks, top-1 and
greedy-16 agreement, mismatches of exact operations): the numbers the fidelity panels draw.
"""
from __future__ import annotations

import json
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cluster.operator.dashboard import ROWS, Panel

_DURATION = re.compile(r"^(\d+)([smhd])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``"90s"``, ``"15m"``, ``"1h"``, ``"2d"`` -> seconds; ValueError for anything else."""
    m = _DURATION.match(text.strip()) if isinstance(text, str) else None
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"bad duration {text!r}: use a positive number with s, m, h or d (e.g. 30m)")
    return int(m.group(1)) * _SECONDS[m.group(2)]


@dataclass
class Series:
    legend: str
    times: list[float]       # unix seconds
    values: list[float]      # NaN where Prometheus returned NaN (e.g. 0/0)


@dataclass
class PanelResult:
    row: str
    panel: Panel
    series: list[Series] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def has_data(self) -> bool:
        return any(any(v == v for v in s.values) for s in self.series)   # some non-NaN point


class PrometheusClient:
    """The two calls the report needs, on Prometheus' HTTP API (no client library)."""

    def __init__(self, base_url: str, timeout: float = 30.0):
        if not re.match(r"^https?://[^/\s]+", base_url or ""):
            raise ValueError(f"--prometheus must be an http(s) URL like http://127.0.0.1:9090, got {base_url!r}")
        self.base, self.timeout = base_url.rstrip("/"), timeout

    def _get(self, path: str, params: dict) -> dict:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:   # 400/422: a bad query; the body says why
            try:
                body = json.loads(e.read() or b"{}")
            except ValueError:
                body = {}
            return {"status": "error", "error": body.get("error", f"HTTP {e.code}")}
        except (urllib.error.URLError, OSError) as e:
            raise RuntimeError(f"cannot reach Prometheus at {self.base}: {getattr(e, 'reason', e)}") from None

    def check(self) -> None:
        """Fail with one clear line when the URL is not a Prometheus that answers."""
        body = self._get("/api/v1/status/buildinfo", {})
        if body.get("status") != "success":
            raise RuntimeError(f"{self.base} does not answer as Prometheus: {body.get('error', body)}")

    def query(self, expr: str, at: float) -> dict:
        return self._get("/api/v1/query", {"query": expr, "time": f"{at:.3f}"})

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict:
        return self._get("/api/v1/query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                 "step": f"{step:g}"})


def legend(template: str, labels: dict) -> str:
    """Grafana's legend format: ``"p90 {{plan}}"`` with ``plan="reuse"`` -> ``"p90 reuse"``."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip() or \
        (",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value")


def collect(client: PrometheusClient, start: float, end: float, step: float, progress=None) -> list[PanelResult]:
    out = []
    for row in ROWS:
        for p in row.panels:
            res = PanelResult(row.title, p)
            for q in p.queries:
                body = client.query_range(q.expr, start, end, step)
                if body.get("status") != "success":
                    res.errors.append(f"{q.expr}: {body.get('error', 'failed')}")
                    continue
                for s in body["data"]["result"]:
                    pts = s.get("values", [])
                    res.series.append(Series(legend(q.legend, s.get("metric", {})), [float(t) for t, _ in pts],
                                             [float(v) for _, v in pts]))
            out.append(res)
            if progress:
                progress(res)
    return out


@dataclass
class OpFidelity:
    op: str
    checks: int
    agree: dict[str, float]           # metric (top1, greedy16) -> share of the checks that agreed
    mismatches: int | None            # exact operations only (None: no exactness claim to break)


def _totals(client: PrometheusClient, expr: str, at: float, labels: tuple[str, ...]) -> dict[tuple, float]:
    body = client.query(expr, at)
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr}: {body.get('error', body)}")
    return {tuple(s["metric"].get(k, "") for k in labels): float(s["value"][1]) for s in body["data"]["result"]}


def fidelity_by_op(client: PrometheusClient, start: float, end: float) -> list[OpFidelity]:
    """Shadow checks per operation over [start, end]: counter totals (summed over processes) at
    ``end`` minus those at ``start`` (a series born in the range counts from 0, a process restart
    from its new total), so a short workload's counts are exact, not extrapolated like increase()."""
    def over(expr, labels):
        a, b = _totals(client, expr, start, labels), _totals(client, expr, end, labels)
        return {k: (v - a.get(k, 0.0) if v >= a.get(k, 0.0) else v) for k, v in b.items()}
    checks = over("sum by (op) (kvnotes_fidelity_kl_count)", ("op",))
    agree = over("sum by (op, metric) (kvnotes_fidelity_agree_total)", ("op", "metric"))
    mism = over("sum by (op) (kvnotes_fidelity_exact_mismatch_total)", ("op",))
    out = []
    for (op,) in sorted(set(checks) | set(mism)):
        n = int(round(checks.get((op,), 0.0)))
        if n == 0 and not mism.get((op,)):
            continue
        shares = {m: agree.get((op, m), 0.0) / n for m in ("top1", "greedy16")} if n else {}
        out.append(OpFidelity(op, n, shares, int(round(mism[(op,)])) if (op,) in mism else None))
    return out


def fidelity_lines(rows: list[OpFidelity]) -> list[str]:
    """``index.md``'s table of :func:`fidelity_by_op`."""
    lines = ["## Shadow checks by operation", "",
             "Sampled shadow recomputes in the range, per operation (reuse(frame) is claimed exact: any "
             "mismatch is a bug).", "",
             "| operation | checks | top-1 agreement | greedy-16 agreement | exact mismatches |", "|---|---|---|---|---|"]
    for r in rows:
        pct = {m: (f"{r.agree[m]:.1%}" if m in r.agree else "-") for m in ("top1", "greedy16")}
        lines.append(f"| {r.op} | {r.checks} | {pct['top1']} | {pct['greedy16']} | "
                     f"{'n/a' if r.mismatches is None else r.mismatches} |")
    if not rows:
        lines.append("| (no shadow checks in the range) | 0 | - | - | - |")
    return lines + [""]


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def render(results: list[PanelResult], out_dir: Path, start: float, end: float,
           fidelity: list[OpFidelity] | None = None) -> list[Path]:
    """One PNG per dashboard row (its panels as subplots) and ``index.md``; returns the PNGs."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("kvnotes report needs matplotlib (pip install matplotlib)") from None

    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = []
    for i, row in enumerate(ROWS, 1):
        fig = _row_figure(plt, row, [r for r in results if r.row == row.title], start, end)
        path = out_dir / f"{i:02d}-{_slug(row.title)}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        pngs.append(path)
    (out_dir / "index.md").write_text("\n".join(_index_lines(results, start, end, fidelity)))
    return pngs


def _utc(t: float):
    from datetime import datetime, timezone
    return datetime.fromtimestamp(t, tz=timezone.utc)


def _row_figure(plt, row, panels: list[PanelResult], start: float, end: float):
    """One dashboard row: its panels two to a line, titled with the time range."""
    cols = 2
    rows_n = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(13, 3.6 * rows_n), squeeze=False)
    for ax, res in zip(axes.flat, panels):
        ax.set_title(res.panel.title, fontsize=10)
        if not res.has_data:
            _centred(ax, "no data" + (f"\n{res.errors[0][:80]}" if res.errors else ""), color="grey")
        elif res.panel.kind == "stat":
            last = [(s.legend, s.values[-1]) for s in res.series if s.values]
            _centred(ax, "\n".join(f"{name}: {v:g}" for name, v in last), fontsize=16,
                     color="green" if all(v >= 1 for _, v in last) else "red")
        else:
            _plot_series(ax, res, start, end)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    span = f"{_utc(start):%Y-%m-%d %H:%M:%S} - {_utc(end):%H:%M:%S} UTC"
    fig.suptitle(f"kvnotes: {row.title}  ({span})", fontsize=12)
    fig.tight_layout()
    return fig


def _centred(ax, text: str, **style) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, **style)
    ax.set_xticks([])
    ax.set_yticks([])


def _plot_series(ax, res: PanelResult, start: float, end: float) -> None:
    import matplotlib.dates as mdates
    for s in res.series:
        ts = [_utc(t) for t in s.times]
        style = "--" if res.panel.dash_recompute and "recompute" in s.legend else "-"
        # sparse series (a short workload in a long range) get markers, or a lone point is invisible
        ax.plot(ts, s.values, style, label=s.legend, linewidth=1.4, marker="o" if len(ts) < 30 else None,
                markersize=3)
    ax.set_xlim(_utc(start), _utc(end))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.set_ylabel(res.panel.unit.split(":", 1)[1] if res.panel.unit.startswith("suffix:") else res.panel.unit,
                  fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _index_lines(results: list[PanelResult], start: float, end: float,
                 fidelity: list[OpFidelity] | None) -> list[str]:
    """``index.md``: each row's PNG and a table of its panels (data or not, series, queries)."""
    lines = ["# kvnotes report", "",
             f"Prometheus range {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(start))} to "
             f"{time.strftime('%H:%M:%S', time.gmtime(end))} UTC; panels and queries from `cluster/operator/dashboard.py`.", ""]
    for i, row in enumerate(ROWS, 1):
        lines += [f"## {row.title}", "", f"![{row.title}]({i:02d}-{_slug(row.title)}.png)", "",
                  "| panel | data | series | query |", "|---|---|---|---|"]
        for res in (r for r in results if r.row == row.title):
            q = "<br>".join(f"`{x.expr}`" for x in res.panel.queries).replace("|", "\\|")
            state = "yes" if res.has_data else ("error" if res.errors else "no data")
            lines.append(f"| {res.panel.title} | {state} | {len(res.series)} | {q} |")
        lines.append("")
    if fidelity is not None:
        lines += fidelity_lines(fidelity)
    return lines


def run(prometheus: str, out: str, since: str = "1h", step: str | None = None, end: float | None = None) -> int:
    client = PrometheusClient(prometheus)
    span = parse_duration(since)
    step_s = parse_duration(step) if step else max(1.0, span / 240)
    end = end if end is not None else time.time()
    start = end - span
    client.check()
    total = sum(len(r.panels) for r in ROWS)
    done = [0]

    def progress(res: PanelResult) -> None:
        done[0] += 1
        state = "ok" if res.has_data else ("error" if res.errors else "no data")
        print(f"\r[{done[0]:>2}/{total}] {res.row}: {res.panel.title[:50]:<50} {state:<8}", end="",
              file=sys.stderr, flush=True)

    results = collect(client, start, end, step_s, progress)
    print(file=sys.stderr)
    fidelity = fidelity_by_op(client, start, end)
    pngs = render(results, Path(out), start, end, fidelity)
    empty = [r.panel.title for r in results if not r.has_data]
    print(f"kvnotes report: {len(pngs)} PNGs and index.md in {out}; {total - len(empty)}/{total} panels have data")
    for t in empty:
        print(f"  no data: {t}")
    for r in fidelity:
        print(f"  shadow {r.op}: {r.checks} checks, top-1 {r.agree.get('top1', float('nan')):.1%}, greedy-16 "
              f"{r.agree.get('greedy16', float('nan')):.1%}"
              + ("" if r.mismatches is None else f", {r.mismatches} exact mismatches"))
    return 0
