"""SQLite backend: one file (the embedded default). WAL journal and a busy timeout make it safe
for several processes on one node (router replicas, the CLI); each thread gets its own
connection. Bounds are enforced every ``_TRIM_EVERY`` writes and by :meth:`expire`."""
from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from pathlib import Path

from cluster.control.state.base import ApiKeyRecord, Registration, StateStore, StoreLimits, TemplateRecord

_TRIM_EVERY = 64
_SCHEMA = """
CREATE TABLE IF NOT EXISTS registrations (tenant TEXT, kind TEXT, name TEXT, data TEXT,
    PRIMARY KEY (tenant, kind, name));
CREATE TABLE IF NOT EXISTS templates (tenant TEXT, name TEXT, data TEXT, PRIMARY KEY (tenant, name));
CREATE TABLE IF NOT EXISTS sessions (tenant TEXT, session TEXT, data TEXT, used REAL,
    PRIMARY KEY (tenant, session));
CREATE INDEX IF NOT EXISTS sessions_used ON sessions (used);
CREATE TABLE IF NOT EXISTS prompt_index (tenant TEXT, hash TEXT, tokens INTEGER, used REAL,
    PRIMARY KEY (tenant, hash));
CREATE INDEX IF NOT EXISTS prompt_used ON prompt_index (used);
CREATE TABLE IF NOT EXISTS fingerprints (tenant TEXT, key TEXT, n INTEGER, data TEXT, used REAL,
    PRIMARY KEY (tenant, key));
CREATE INDEX IF NOT EXISTS fingerprints_used ON fingerprints (used);
CREATE TABLE IF NOT EXISTS held_prompts (tenant TEXT, key TEXT, ids BLOB, used REAL, PRIMARY KEY (tenant, key));
CREATE INDEX IF NOT EXISTS held_prompts_used ON held_prompts (used);
CREATE TABLE IF NOT EXISTS decode_held (tenant TEXT, key TEXT, tokens INTEGER, used REAL, PRIMARY KEY (tenant, key));
CREATE INDEX IF NOT EXISTS decode_held_used ON decode_held (used);
CREATE TABLE IF NOT EXISTS responses (tenant TEXT, id TEXT, data TEXT, stored REAL, PRIMARY KEY (tenant, id));
CREATE INDEX IF NOT EXISTS responses_stored ON responses (stored);
CREATE TABLE IF NOT EXISTS api_keys (hash TEXT PRIMARY KEY, key_id TEXT UNIQUE, data TEXT, created REAL);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v BLOB);
CREATE TABLE IF NOT EXISTS targets (name TEXT PRIMARY KEY, address TEXT, seen REAL);
"""


class SqliteState(StateStore):
    def __init__(self, path: str, limits: StoreLimits = StoreLimits()):
        self.path, self.limits = Path(path).expanduser(), limits
        # the cluster secret and every tenant's data: the file 0600 in a 0700 directory before SQLite
        # opens it (SQLite gives its -wal and -shm files the database file's mode); looser ones warned
        from kvruntime.private_files import private_file
        private_file(self.path)
        self._local = threading.local()
        self._writes = 0
        self._lock = threading.Lock()
        self._touched: dict[tuple[str, str], float] = {}   # prompt-index reads' LRU refresh, not yet written
        self._session_touched: dict[tuple[str, str], float] = {}   # session reads' LRU refresh, not yet written
        self._conn().executescript(_SCHEMA)

    def _is_outage(self, exc):
        # the file cannot be opened, written or locked within the busy timeout (another process
        # holds it; the disk failed or is read-only); SQL errors stay bugs (500)
        return isinstance(exc, sqlite3.OperationalError) and any(
            m in str(exc).lower() for m in ("locked", "busy", "unable to open", "disk i/o", "readonly"))

    def ping(self):
        self._q("SELECT 1")

    def _conn(self) -> sqlite3.Connection:
        c = getattr(self._local, "conn", None)
        if c is None:
            c = sqlite3.connect(self.path, timeout=10.0, isolation_level=None)
            c.execute("PRAGMA journal_mode=WAL")
            c.execute("PRAGMA synchronous=NORMAL")
            c.execute("PRAGMA busy_timeout=10000")
            self._local.conn = c
        return c

    def _tx(self):
        conn = self._conn()

        class _Tx:
            def __enter__(self_inner):
                conn.execute("BEGIN IMMEDIATE")
                return conn

            def __exit__(self_inner, exc_type, *_):
                conn.execute("ROLLBACK" if exc_type else "COMMIT")
        return _Tx()

    def _q(self, sql: str, args=()) -> list[tuple]:
        return self._conn().execute(sql, args).fetchall()

    def _wrote(self, now: float) -> None:
        with self._lock:
            self._writes += 1
            due = self._writes % _TRIM_EVERY == 0
        if due:
            self.expire(now)

    # ---- registrations ------------------------------------------------------------------------
    def put_registration(self, reg: Registration) -> None:
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO registrations VALUES (?,?,?,?)",
                      (reg.tenant, reg.kind, reg.name, reg.to_json()))

    def get_registration(self, tenant, kind, name):
        rows = self._q("SELECT data FROM registrations WHERE tenant=? AND kind=? AND name=?", (tenant, kind, name))
        return Registration.from_json(rows[0][0]) if rows else None

    def list_registrations(self, tenant, kind):
        rows = self._q("SELECT data FROM registrations WHERE tenant=? AND kind=? ORDER BY name", (tenant, kind))
        return [Registration.from_json(r[0]) for r in rows]

    def registrations_by_tier(self):
        out: dict[tuple[str, str], int] = {}
        for (data,) in self._q("SELECT data FROM registrations"):
            r = Registration.from_json(data)
            k = (r.kind, "unknown" if r.in_tier is None else str(bool(r.in_tier)).lower())
            out[k] = out.get(k, 0) + 1
        return out

    def delete_registration(self, tenant, kind, name):
        with self._tx() as c:
            return c.execute("DELETE FROM registrations WHERE tenant=? AND kind=? AND name=?",
                             (tenant, kind, name)).rowcount > 0

    def mark_used(self, tenant, kind, name, now, in_tier):
        from dataclasses import replace
        with self._tx() as c:
            rows = c.execute("SELECT data FROM registrations WHERE tenant=? AND kind=? AND name=?",
                             (tenant, kind, name)).fetchall()
            if not rows:
                return
            reg = Registration.from_json(rows[0][0])
            reg = replace(reg, last_used=now, in_tier=reg.in_tier if in_tier is None else in_tier)
            c.execute("UPDATE registrations SET data=? WHERE tenant=? AND kind=? AND name=?",
                      (reg.to_json(), tenant, kind, name))

    # ---- templates --------------------------------------------------------------------------
    def put_template(self, t):
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO templates VALUES (?,?,?)", (t.tenant, t.name, t.to_json()))

    def get_template(self, tenant, name):
        rows = self._q("SELECT data FROM templates WHERE tenant=? AND name=?", (tenant, name))
        return TemplateRecord.from_json(rows[0][0]) if rows else None

    def list_templates(self, tenant):
        return [TemplateRecord.from_json(r[0])
                for r in self._q("SELECT data FROM templates WHERE tenant=? ORDER BY name", (tenant,))]

    def delete_template(self, tenant, name):
        with self._tx() as c:
            return c.execute("DELETE FROM templates WHERE tenant=? AND name=?", (tenant, name)).rowcount > 0

    # ---- sessions -----------------------------------------------------------------------------
    def put_session(self, tenant, session, data, now):
        with self._tx() as c:
            self._write_touches(c)
            c.execute("INSERT OR REPLACE INTO sessions VALUES (?,?,?,?)", (tenant, session, data, now))
        self._wrote(now)

    def get_session(self, tenant, session, now):
        """A read only, on the request path (a session's next turn): no write lock, like the
        prompt index's (``BEGIN IMMEDIATE`` waited up to the busy timeout on any open write
        transaction); the LRU refresh is kept here and written with this store's next write of
        sessions or the prompt index, its expiry or sizes."""
        rows = self._q("SELECT data, used FROM sessions WHERE tenant=? AND session=?", (tenant, session))
        if not rows:
            return None
        with self._lock:
            used = max(rows[0][1], self._session_touched.get((tenant, session), rows[0][1]))
            if used < now - self.limits.session_ttl_s:
                return None
            self._session_touched[(tenant, session)] = max(now, used)
        return rows[0][0]

    def delete_session(self, tenant, session):
        with self._lock:
            self._session_touched.pop((tenant, session), None)
        with self._tx() as c:
            return c.execute("DELETE FROM sessions WHERE tenant=? AND session=?", (tenant, session)).rowcount > 0

    # ---- prompt index -------------------------------------------------------------------------
    def put_prompt_blocks(self, tenant, blocks, now):
        with self._tx() as c:
            self._write_touches(c)
            c.executemany("INSERT OR REPLACE INTO prompt_index VALUES (?,?,?,?)",
                          [(tenant, h, n, now) for h, n in blocks.items()])
        self._wrote(now)

    def get_prompt_blocks(self, tenant, hashes, now):
        """A read only, on the request path: no write lock (a WAL reader never waits on a writer,
        where ``BEGIN IMMEDIATE`` waited up to the busy timeout on any open write transaction);
        the LRU refresh is kept here and written with this store's next prompt-index write or expiry."""
        if not hashes:
            return {}
        rows = []
        for i in range(0, len(hashes), 500):            # under SQLite's bound on bound parameters
            part = hashes[i:i + 500]
            rows += self._q(f"SELECT hash, tokens, used FROM prompt_index WHERE tenant=? AND hash IN "
                            f"({','.join('?' * len(part))})", (tenant, *part))
        cutoff = now - self.limits.prompt_ttl_s
        with self._lock:
            out = {h: n for h, n, used in rows if max(used, self._touched.get((tenant, h), used)) >= cutoff}
            for h in out:
                self._touched[(tenant, h)] = max(now, self._touched.get((tenant, h), now))
        return out

    def _write_touches(self, c) -> None:
        """Write the prompt-index and session reads' LRU refresh (inside a write transaction;
        bounded by the tables' rows: one entry per (tenant, hash) or (tenant, session) read since
        the last write)."""
        with self._lock:
            touched, self._touched = self._touched, {}
            sessions, self._session_touched = self._session_touched, {}
        if touched:
            c.executemany("UPDATE prompt_index SET used=max(used, ?) WHERE tenant=? AND hash=?",
                          [(t, tenant, h) for (tenant, h), t in touched.items()])
        if sessions:
            c.executemany("UPDATE sessions SET used=max(used, ?) WHERE tenant=? AND session=?",
                          [(t, tenant, k) for (tenant, k), t in sessions.items()])

    # ---- prompt-matching fingerprints ---------------------------------------------------------
    def count_fingerprints(self, tenant, keys, now):
        if not keys:
            return {}
        with self._tx() as c:
            out = {k: c.execute("INSERT INTO fingerprints VALUES (?,?,1,'',?) ON CONFLICT (tenant, key) DO UPDATE "
                                "SET n=n+1, used=excluded.used RETURNING n", (tenant, k, now)).fetchone()[0]
                   for k in dict.fromkeys(keys)}
        self._wrote(now)
        return out

    def put_fingerprints(self, tenant, entries, now):
        with self._tx() as c:
            c.executemany("INSERT INTO fingerprints VALUES (?,?,0,?,?) ON CONFLICT (tenant, key) DO UPDATE "
                          "SET data=excluded.data, used=excluded.used", [(tenant, k, d, now) for k, d in entries.items()])
        self._wrote(now)

    def get_fingerprints(self, tenant, keys, now, touch=True):
        if not keys:
            return {}
        keys = list(dict.fromkeys(keys))
        with self._tx() if touch else contextlib.nullcontext(self._conn()) as c:   # a read only: no write lock
            rows = []
            for i in range(0, len(keys), 500):          # under SQLite's bound on bound parameters
                part = keys[i:i + 500]
                rows += c.execute(f"SELECT key, n, data FROM fingerprints WHERE tenant=? AND key IN "
                                  f"({','.join('?' * len(part))}) AND used>=?",
                                  (tenant, *part, now - self.limits.fingerprint_ttl_s)).fetchall()
            if rows and touch:
                c.executemany("UPDATE fingerprints SET used=? WHERE tenant=? AND key=?",
                              [(now, tenant, k) for k, _, _ in rows])
        return {k: (n, d) for k, n, d in rows}

    def delete_fingerprints(self, tenant, keys):
        with self._tx() as c:
            return sum(c.execute("DELETE FROM fingerprints WHERE tenant=? AND key=?", (tenant, k)).rowcount
                       for k in dict.fromkeys(keys))

    def put_held_prompt(self, tenant, key, token_ids, now):
        from array import array
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO held_prompts VALUES (?,?,?,?)",
                      (tenant, key, array("q", token_ids).tobytes(), now))
        self._wrote(now)

    def get_held_prompt(self, tenant, key, now, touch=True):
        from array import array
        with self._tx() if touch else contextlib.nullcontext(self._conn()) as c:   # a read only: no write lock
            rows = c.execute("SELECT ids FROM held_prompts WHERE tenant=? AND key=? AND used>=?",
                             (tenant, key, now - self.limits.held_prompt_ttl_s)).fetchall()
            if not rows:
                return None
            if touch:
                c.execute("UPDATE held_prompts SET used=? WHERE tenant=? AND key=?", (now, tenant, key))
        return tuple(array("q", rows[0][0]))

    # ---- what the decode engines' prefix caches hold (read only on the request path) ------------
    def put_decode_held(self, tenant, blocks, now):
        if blocks:
            with self._tx() as c:
                c.executemany("INSERT OR REPLACE INTO decode_held VALUES (?,?,?,?)",
                              [(tenant, k, n, now) for k, n in blocks.items()])
            self._wrote(now)

    def get_decode_held(self, tenant, keys, now):
        keys, rows = list(dict.fromkeys(keys)), []
        for i in range(0, len(keys), 500):              # under SQLite's bound on bound parameters
            part = keys[i:i + 500]
            rows += self._q(f"SELECT key, tokens FROM decode_held WHERE tenant=? AND key IN ({','.join('?' * len(part))})"
                            " AND used>=?", (tenant, *part, now - self.limits.decode_held_ttl_s))
        return dict(rows)

    # ---- stored responses (expired and over-limit ones dropped on each store) --------------------
    def put_response(self, tenant, response_id, data, now):
        lim = self.limits
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO responses VALUES (?,?,?,?)", (tenant, response_id, data, now))
            c.execute("DELETE FROM responses WHERE stored<?", (now - lim.response_ttl_s,))
            c.execute("DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses ORDER BY stored DESC "
                      "LIMIT -1 OFFSET ?)", (lim.response_max,))

    def get_response(self, tenant, response_id, now):
        rows = self._q("SELECT data FROM responses WHERE tenant=? AND id=? AND stored>=?",
                       (tenant, response_id, now - self.limits.response_ttl_s))
        return rows[0][0] if rows else None

    def delete_response(self, tenant, response_id):
        with self._tx() as c:
            return c.execute("DELETE FROM responses WHERE tenant=? AND id=?", (tenant, response_id)).rowcount > 0

    # ---- API keys -----------------------------------------------------------------------------
    def put_api_key(self, key_hash, rec):
        with self._tx() as c:
            c.execute("INSERT INTO api_keys VALUES (?,?,?,?)", (key_hash, rec.key_id, rec.to_json(), rec.created))

    def api_key(self, key_hash):
        rows = self._q("SELECT data FROM api_keys WHERE hash=?", (key_hash,))
        return ApiKeyRecord.from_json(rows[0][0]) if rows else None

    def list_api_keys(self):
        return [ApiKeyRecord.from_json(r[0]) for r in self._q("SELECT data FROM api_keys ORDER BY created, key_id")]

    def revoke_api_key(self, key_id):
        with self._tx() as c:
            return c.execute("DELETE FROM api_keys WHERE key_id=?", (key_id,)).rowcount > 0

    # ---- metrics targets ----------------------------------------------------------------------
    def put_target(self, name, address, now):
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO targets VALUES (?, ?, ?)", (name, address, now))

    def targets(self, now, ttl_s):
        with self._tx() as c:
            c.execute("DELETE FROM targets WHERE seen<?", (now - ttl_s,))
            return dict(c.execute("SELECT name, address FROM targets ORDER BY name").fetchall())

    # ---- secret, sizes, expiry ----------------------------------------------------------------
    def secret(self) -> bytes:
        with self._tx() as c:
            c.execute("INSERT OR IGNORE INTO meta VALUES ('secret', ?)", (os.urandom(32),))
            return bytes(c.execute("SELECT v FROM meta WHERE k='secret'").fetchone()[0])

    def sizes(self, now):
        lim = self.limits
        if self._touched or self._session_touched:      # counted as recent as their last read
            with self._tx() as c:
                self._write_touches(c)
        one = lambda sql, *a: self._q(sql, a)[0][0]  # noqa: E731
        return {"sessions": one("SELECT COUNT(*) FROM sessions WHERE used>=?", now - lim.session_ttl_s),
                "prompt_index": one("SELECT COUNT(*) FROM prompt_index WHERE used>=?", now - lim.prompt_ttl_s),
                "registrations": one("SELECT COUNT(*) FROM registrations"),
                "templates": one("SELECT COUNT(*) FROM templates"),
                "fingerprints": one("SELECT COUNT(*) FROM fingerprints WHERE used>=?", now - lim.fingerprint_ttl_s),
                "held_prompts": one("SELECT COUNT(*) FROM held_prompts WHERE used>=?", now - lim.held_prompt_ttl_s),
                "decode_held": one("SELECT COUNT(*) FROM decode_held WHERE used>=?", now - lim.decode_held_ttl_s)}

    def expire(self, now):
        lim = self.limits
        with self._tx() as c:
            self._write_touches(c)          # a prompt read since the last write is as recent as that read
            s = c.execute("DELETE FROM sessions WHERE used<?", (now - lim.session_ttl_s,)).rowcount
            s += c.execute("DELETE FROM sessions WHERE rowid IN (SELECT rowid FROM sessions ORDER BY used DESC "
                           "LIMIT -1 OFFSET ?)", (lim.session_max,)).rowcount
            p = c.execute("DELETE FROM prompt_index WHERE used<?", (now - lim.prompt_ttl_s,)).rowcount
            p += c.execute("DELETE FROM prompt_index WHERE rowid IN (SELECT rowid FROM prompt_index ORDER BY used "
                           "DESC LIMIT -1 OFFSET ?)", (lim.prompt_max,)).rowcount
            bounded = {}
            for table, ttl, cap in (("fingerprints", lim.fingerprint_ttl_s, lim.fingerprint_max),
                                    ("held_prompts", lim.held_prompt_ttl_s, lim.held_prompt_max),
                                    ("decode_held", lim.decode_held_ttl_s, lim.decode_held_max)):
                n = c.execute(f"DELETE FROM {table} WHERE used<?", (now - ttl,)).rowcount
                n += c.execute(f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} ORDER BY used DESC "
                               "LIMIT -1 OFFSET ?)", (cap,)).rowcount
                bounded[table] = n
        return {"sessions": s, "prompt_index": p, **bounded}

    def close(self):
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
            self._local.conn = None
