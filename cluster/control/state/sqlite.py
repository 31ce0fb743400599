"""SQLite backend: one file (the embedded default). WAL journal and a busy timeout make it safe
for several processes on one node (router replicas, the CLI); each thread gets its own
connection. Bounds are enforced every ``_TRIM_EVERY`` writes and by :meth:`expire`."""
from __future__ import annotations

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
CREATE TABLE IF NOT EXISTS api_keys (hash TEXT PRIMARY KEY, key_id TEXT UNIQUE, data TEXT, created REAL);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v BLOB);
CREATE TABLE IF NOT EXISTS targets (name TEXT PRIMARY KEY, address TEXT, seen REAL);
"""


class SqliteState(StateStore):
    def __init__(self, path: str, limits: StoreLimits = StoreLimits()):
        self.path, self.limits = Path(path).expanduser(), limits
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._writes = 0
        self._lock = threading.Lock()
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
            c.execute("INSERT OR REPLACE INTO sessions VALUES (?,?,?,?)", (tenant, session, data, now))
        self._wrote(now)

    def get_session(self, tenant, session, now):
        with self._tx() as c:
            rows = c.execute("SELECT data, used FROM sessions WHERE tenant=? AND session=?",
                             (tenant, session)).fetchall()
            if not rows or rows[0][1] < now - self.limits.session_ttl_s:
                return None
            c.execute("UPDATE sessions SET used=? WHERE tenant=? AND session=?", (now, tenant, session))
            return rows[0][0]

    def delete_session(self, tenant, session):
        with self._tx() as c:
            return c.execute("DELETE FROM sessions WHERE tenant=? AND session=?", (tenant, session)).rowcount > 0

    # ---- prompt index -------------------------------------------------------------------------
    def put_prompt_blocks(self, tenant, blocks, now):
        with self._tx() as c:
            c.executemany("INSERT OR REPLACE INTO prompt_index VALUES (?,?,?,?)",
                          [(tenant, h, n, now) for h, n in blocks.items()])
        self._wrote(now)

    def get_prompt_blocks(self, tenant, hashes, now):
        if not hashes:
            return {}
        marks = ",".join("?" * len(hashes))
        with self._tx() as c:
            rows = c.execute(f"SELECT hash, tokens FROM prompt_index WHERE tenant=? AND hash IN ({marks}) AND used>=?",
                             (tenant, *hashes, now - self.limits.prompt_ttl_s)).fetchall()
            if rows:
                c.executemany("UPDATE prompt_index SET used=? WHERE tenant=? AND hash=?",
                              [(now, tenant, h) for h, _ in rows])
        return {h: n for h, n in rows}

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
        one = lambda sql, *a: self._q(sql, a)[0][0]  # noqa: E731
        return {"sessions": one("SELECT COUNT(*) FROM sessions WHERE used>=?", now - lim.session_ttl_s),
                "prompt_index": one("SELECT COUNT(*) FROM prompt_index WHERE used>=?", now - lim.prompt_ttl_s),
                "registrations": one("SELECT COUNT(*) FROM registrations"),
                "templates": one("SELECT COUNT(*) FROM templates")}

    def expire(self, now):
        lim = self.limits
        with self._tx() as c:
            s = c.execute("DELETE FROM sessions WHERE used<?", (now - lim.session_ttl_s,)).rowcount
            s += c.execute("DELETE FROM sessions WHERE rowid IN (SELECT rowid FROM sessions ORDER BY used DESC "
                           "LIMIT -1 OFFSET ?)", (lim.session_max,)).rowcount
            p = c.execute("DELETE FROM prompt_index WHERE used<?", (now - lim.prompt_ttl_s,)).rowcount
            p += c.execute("DELETE FROM prompt_index WHERE rowid IN (SELECT rowid FROM prompt_index ORDER BY used "
                           "DESC LIMIT -1 OFFSET ?)", (lim.prompt_max,)).rowcount
        return {"sessions": s, "prompt_index": p}

    def close(self):
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
            self._local.conn = None
