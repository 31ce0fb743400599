"""The prompt-index read on the request path (``get_prompt_blocks``, the plain prompt's
``lookup_state`` lap) never waits on a writer, on the real SQLite store; its LRU refresh is kept
and written with the store's next write or expiry (bench.state_reads measures the wait it had)."""
from __future__ import annotations

import sqlite3
import time

from cluster.control.state.base import StoreLimits
from cluster.control.state.sqlite import SqliteState


def test_prompt_read_answers_while_another_connection_holds_a_write_transaction(tmp_path):
    path = tmp_path / "state.db"
    s, now = SqliteState(str(path)), time.time()
    s.put_prompt_blocks("acme", {"h1": 256, "h2": 512}, now)
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")                 # a background record or expiry mid-transaction
    writer.execute("INSERT INTO prompt_index VALUES ('acme', 'h3', 768, ?)", (now,))
    try:    # with BEGIN IMMEDIATE the read waited the busy timeout out and raised StateStoreUnavailable
        assert s.get_prompt_blocks("acme", ["h1", "h2", "h3"], now + 1) == {"h1": 256, "h2": 512}
    finally:
        writer.execute("COMMIT")
        writer.close()
    assert s.get_prompt_blocks("acme", ["h3"], now + 1) == {"h3": 768}      # committed: seen
    s.close()


def test_prompt_read_refreshes_the_lru_in_memory_then_on_the_next_write(tmp_path):
    path = tmp_path / "state.db"
    s, now = SqliteState(str(path), StoreLimits(prompt_ttl_s=60)), time.time()
    s.put_prompt_blocks("acme", {"h1": 256, "h2": 512}, now)
    assert s.get_prompt_blocks("acme", ["h1"], now + 50) == {"h1": 256}
    used = dict(sqlite3.connect(path).execute("SELECT hash, used FROM prompt_index").fetchall())
    assert used == {"h1": now, "h2": now}             # the read wrote nothing
    # past h2's TTL: h1 is as recent as its read (not yet written), h2 expired
    assert s.get_prompt_blocks("acme", ["h1", "h2"], now + 100) == {"h1": 256}
    assert s.get_prompt_blocks("globex", ["h1"], now + 100) == {}            # per tenant
    assert s.expire(now + 105)["prompt_index"] == 1                           # h2 only
    used = dict(sqlite3.connect(path).execute("SELECT hash, used FROM prompt_index").fetchall())
    assert used == {"h1": now + 100}                  # the refresh written with the expiry
    other = SqliteState(str(path), StoreLimits(prompt_ttl_s=60))             # another replica sees it
    assert other.get_prompt_blocks("acme", ["h1"], now + 150) == {"h1": 256}
    other.close()
    s.close()
