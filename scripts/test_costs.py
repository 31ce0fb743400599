"""Refresh tests/test_costs.json (each test module's seconds, which tests/conftest.py uses to hand
the longest units of work to the xdist workers first) from JUnit reports:

    OMP_NUM_THREADS=1 python -m pytest -p no:xdist --junitxml=/tmp/run.xml && python scripts/test_costs.py /tmp/run.xml

Run it serially (``-p no:xdist``) on a quiet machine: the table is only an order, but times
taken beside another worker mix in that worker's load. Without ``--merge`` the table is rewritten
from the reports (a whole run); with ``--merge`` only the modules the reports hold are replaced
(some modules measured: new ones, or ones whose time changed), every other entry kept.
``--scale F`` multiplies the measured seconds (a run on a loaded machine, scaled by a listed
module's listed/measured ratio, measured in the same run)."""
from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "test_costs.json"


def module_seconds(report: str) -> dict[str, float]:
    """``{test_x.py: seconds}`` summed over the report's test cases (setup, call and teardown)."""
    root = ET.parse(report).getroot()
    seconds: dict[str, float] = defaultdict(float)
    for case in root.iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((m for m in module if m.startswith("test_")), None)     # tests.test_x[.Class]
        if name:
            seconds[f"{name}.py"] += float(case.get("time") or 0.0)
    return seconds


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="scripts/test_costs.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", metavar="JUNIT.xml")
    ap.add_argument("--merge", action="store_true", help="replace only the modules the reports hold")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the measured seconds (default 1)")
    args = ap.parse_args(argv)
    if args.scale <= 0:
        print(f"test_costs: --scale must be > 0, got {args.scale}", file=sys.stderr)
        return 2
    seconds: dict[str, float] = {}
    for report in args.reports:
        try:
            seconds.update(module_seconds(report))          # a module in two reports: the later one
        except (OSError, ET.ParseError) as exc:
            print(f"test_costs: cannot read {report}: {exc}", file=sys.stderr)
            return 2
    if not seconds:
        print(f"test_costs: no test cases in {' '.join(args.reports)}", file=sys.stderr)
        return 2
    # every module, short ones too: an unlisted module counts as unmeasured (tests/conftest.py _cost)
    table = json.loads(OUT.read_text()) if args.merge else {}
    table.update({m: max(round(s * args.scale, 1), 0.1) for m, s in seconds.items()})
    table = dict(sorted(table.items(), key=lambda kv: -kv[1]))
    OUT.write_text(json.dumps(table, indent=0) + "\n")
    print(f"{OUT}: {len(table)} modules ({len(seconds)} from the reports), {sum(table.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
