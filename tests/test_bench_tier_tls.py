"""``python -m bench.tier_tls`` end to end at a tiny size, in this process: both servers start
(one with TLS, certificates from a throwaway CA), a chunk round-trips through each (the bench
raises otherwise), a row with both ratios is printed, and both servers are stopped by PID.
Numbers are not checked (speed lives in the benchmark's own runs)."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")]


def test_plain_and_tls_rows_in_one_run(capsys, monkeypatch):
    import bench.tier_tls as bench
    from kvtransport.tier import server as tier_server
    started, stopped = [], []
    start, stop = tier_server.start_tier_server, tier_server.stop_tier_server
    monkeypatch.setattr(bench, "start_tier_server", lambda *a, **kw: started.append(start(*a, **kw)) or started[-1])
    monkeypatch.setattr(bench, "stop_tier_server", lambda s: (stop(s), stopped.append(s.pid)))
    bench.main(["--tokens", "256", "--repeats", "1"])
    out = capsys.readouterr().out
    row = [line.split() for line in out.splitlines() if line.split()[:1] == ["256"]]
    assert len(row) == 1 and len(row[0]) == 8 and all(float(x) > 0 for x in row[0][2:]), out
    assert len(started) == 2 and sorted(stopped) == sorted(s.pid for s in started)
    assert all(s.proc.poll() is not None for s in started)                  # both exited
