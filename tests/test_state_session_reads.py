"""A session's read on the request path (``get_session``: a native session's next turn) never
waits on a writer, on the real SQLite store; its LRU refresh is kept and written with the
store's next write of sessions, the prompt index or its expiry (as the prompt index's is,
tests/test_state_reads.py)."""
from __future__ import annotations

import sqlite3
import time

from cluster.control.state.base import StoreLimits
from cluster.control.state.sqlite import SqliteState


def test_session_read_answers_while_another_connection_holds_a_write_transaction(tmp_path):
    path = tmp_path / "state.db"
    s, now = SqliteState(str(path)), time.time()
    s.put_session("acme", "s1", '{"a": 1}', now)
    writer = sqlite3.connect(path, isolation_level=None, timeout=0)
    writer.execute("BEGIN IMMEDIATE")                 # a background record or expiry mid-transaction
    writer.execute("INSERT INTO prompt_index VALUES ('acme', 'h3', 768, ?)", (now,))
    s._conn().execute("PRAGMA busy_timeout=200")      # with BEGIN IMMEDIATE the read waited this out and raised
    try:
        assert s.get_session("acme", "s1", now + 1) == '{"a": 1}'
    finally:
        writer.execute("COMMIT")
        writer.close()
    s.close()


def test_session_read_refreshes_the_lru_in_memory_then_on_the_next_write(tmp_path):
    path = tmp_path / "state.db"
    s, now = SqliteState(str(path), StoreLimits(session_ttl_s=60)), time.time()
    s.put_session("acme", "s1", "one", now)
    s.put_session("acme", "s2", "two", now)
    assert s.get_session("acme", "s1", now + 50) == "one"
    used = dict(sqlite3.connect(path).execute("SELECT session, used FROM sessions").fetchall())
    assert used == {"s1": now, "s2": now}             # the read wrote nothing
    # past s2's TTL: s1 is as recent as its read (not yet written), s2 expired
    assert s.get_session("acme", "s1", now + 100) == "one"
    assert s.get_session("acme", "s2", now + 100) is None
    assert s.get_session("globex", "s1", now + 100) is None                   # per tenant
    assert s.expire(now + 105)["sessions"] == 1                               # s2 only
    used = dict(sqlite3.connect(path).execute("SELECT session, used FROM sessions").fetchall())
    assert used == {"s1": now + 100}                  # the refresh written with the expiry
    other = SqliteState(str(path), StoreLimits(session_ttl_s=60))            # another replica sees it
    assert other.get_session("acme", "s1", now + 150) == "one"
    assert s.delete_session("acme", "s1") and other.get_session("acme", "s1", now + 150) is None
    other.close()
    s.close()
