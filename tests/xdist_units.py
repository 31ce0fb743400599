"""pytest-xdist scheduling by unit of work (``scripts/dev.sh test`` with no arguments: ``-n 2``).

A unit is a test module, or every module that shares one kept cluster (tests/conftest.py
``KEPT_CLUSTERS``): each unit goes whole to the next free worker, so a module's (or kept
cluster's) tests run in one process one after another and each cluster starts once. The workers
collect and name the units (conftest's collection hook, which also orders them longest first);
they write ``{test file: unit}`` to the file ``KVNOTES_TEST_UNITS`` names, which the controller
set before starting them and reads here when it splits the collection. (xdist's own
``loadgroup`` marks groups by rewriting ``item._nodeid``, which pytest 9 no longer reads.)"""
from __future__ import annotations

import json
import os
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

ENV = "KVNOTES_TEST_UNITS"


def write_units(units: dict[str, str]) -> None:
    """In a worker: publish ``{test file: unit}`` for the controller (atomic; every worker writes
    the same map)."""
    path = os.environ.get(ENV)
    if not path:
        return
    tmp = Path(f"{path}.{os.getpid()}")
    tmp.write_text(json.dumps(units))
    tmp.replace(path)


class UnitScheduling(LoadScopeScheduling):
    """``LoadScopeScheduling`` whose scope is the unit, in the workers' collection order."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        config.option.loadscopereorder = False      # the workers ordered the units: keep that order
        self._units: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._units is None:
            path = os.environ.get(ENV)
            if not path or not Path(path).exists():
                raise RuntimeError(f"{ENV} ({path!r}): no unit map from the workers")
            self._units = json.loads(Path(path).read_text())
        file = nodeid.split("::", 1)[0]
        return self._units.get(file, file)

    def _reschedule(self, node) -> None:
        """The next unit once ``node`` starts the last test it holds, not the last two (xdist's
        default): a worker runs a test only when it knows the next one, so one is enough, and a
        unit handed out while a long second-to-last test still runs (test_faults' migration test)
        could wait there while the other worker is idle at the end of the run."""
        if node.shutting_down:
            return
        if self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
            return
        super()._reschedule(node)
