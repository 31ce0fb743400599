"""Refresh tests/test_costs.json (each test module's seconds, which tests/conftest.py uses to hand
the longest units of work to the xdist workers first) from a JUnit report of a whole run:

    OMP_NUM_THREADS=1 python -m pytest -p no:xdist --junitxml=/tmp/run.xml && python scripts/test_costs.py /tmp/run.xml

Run it serially (``-p no:xdist``) on a quiet machine: the table is only an order, but times
taken beside another worker mix in that worker's load."""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "test_costs.json"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/test_costs.py JUNIT.xml", file=sys.stderr)
        return 2
    try:
        root = ET.parse(argv[0]).getroot()
    except (OSError, ET.ParseError) as exc:
        print(f"test_costs: cannot read {argv[0]}: {exc}", file=sys.stderr)
        return 2
    seconds: dict[str, float] = defaultdict(float)
    for case in root.iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((m for m in module if m.startswith("test_")), None)     # tests.test_x[.Class]
        if name:
            seconds[f"{name}.py"] += float(case.get("time") or 0.0)
    if not seconds:
        print(f"test_costs: no test cases in {argv[0]}", file=sys.stderr)
        return 2
    # every module, short ones too: an unlisted module counts as unmeasured (tests/conftest.py _cost)
    table = {m: max(round(s, 1), 0.1) for m, s in sorted(seconds.items(), key=lambda kv: -kv[1])}
    OUT.write_text(json.dumps(table, indent=0) + "\n")
    print(f"{OUT}: {len(table)} modules, {sum(table.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
