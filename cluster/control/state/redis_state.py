"""Redis backend (multi-node): a real ``redis-server`` named by ``state_url: redis://HOST:PORT/DB``
(``redis://:PASSWORD@...`` / ``redis://USER:PASSWORD@...`` with authentication, ``rediss://`` for
TLS: redis-py reads them from the URL itself; errors show the URL redacted).

Layout (every key under the prefix ``kvn:``; tenant and names are JSON-encoded inside key names,
so no separator can be forged):
- ``kvn:reg:[tenant,kind]``   hash  name -> Registration JSON
- ``kvn:tpl:[tenant]``        hash  name -> TemplateRecord JSON
- ``kvn:sess:[tenant,id]``    string (session JSON) with a TTL; ``kvn:sess-lru`` zset member -> last use
- ``kvn:pfx:[tenant,hash]``   string (tokens) with a TTL;        ``kvn:pfx-lru``  zset member -> last use
- ``kvn:fp:[tenant,key]``    hash  n (sightings), d (data), with a TTL; ``kvn:fp-lru``  zset member -> last use
- ``kvn:held:[tenant,key]``  string (the held prompt's ids, int64 little-endian) with a TTL; ``kvn:held-lru``
- ``kvn:dh:[tenant,key]``     string (tokens) with a TTL: what a decode engine's prefix cache holds; ``kvn:dh-lru``
- ``kvn:resp:[tenant,id]``    string (a stored response's JSON) with a TTL; ``kvn:resp-lru`` zset member -> stored at
- ``kvn:keys``                hash  SHA-256 of an API key -> ApiKeyRecord JSON; ``kvn:keyid`` key_id -> hash
- ``kvn:secret``              the cluster secret (SET NX)
- ``kvn:targets``             hash  process name -> metrics endpoint; ``kvn:targets:seen`` zset name -> last refresh
TTLs are Redis' own; the maximum counts are enforced by trimming the LRU zsets on write.
"""
from __future__ import annotations

import json
import os

from cluster.control.state.base import (ApiKeyRecord, Registration, StateStore, StateStoreUnavailable, StoreLimits,
                                        TemplateRecord, redact_url)

P = "kvn:"


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def _k(kind: str, *parts) -> str:
    return P + kind + ":" + json.dumps(list(parts), separators=(",", ":"))


class RedisState(StateStore):
    def __init__(self, url: str, limits: StoreLimits = StoreLimits()):
        import redis

        self.limits = limits
        shown = redact_url(url)
        # short timeouts and one immediate retry (a pooled connection that died with a restarted
        # Redis is replaced at once): a dead store fails within ~2 x timeout_s, not after a hang
        # (redis-py's default is 10 retries with backoff)
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        try:
            self.r = redis.Redis.from_url(url, socket_timeout=limits.timeout_s,
                                          socket_connect_timeout=limits.timeout_s, retry=Retry(NoBackoff(), 1))
            self.r.ping()
        except redis.AuthenticationError as exc:          # no password, or a wrong one: not an outage
            raise ConnectionError(f"state store {shown} refused the credentials ({_line(exc)}): give the password "
                                  "in state_url as redis://:PASSWORD@HOST:PORT/DB") from None
        except redis.ResponseError as exc:                # e.g. NOAUTH on a server that requires a password
            raise ConnectionError(f"state store {shown} refused the connection: {_line(exc)}") from None
        except ValueError as exc:                         # a malformed URL
            raise ConnectionError(f"state store {shown}: {_line(exc)}") from None
        except redis.RedisError as exc:                   # unreachable, TLS failure
            raise StateStoreUnavailable("open", exc, shown) from None

    def _is_outage(self, exc):
        # ConnectionError covers refused / reset connections, a Redis still loading its AOF
        # (BusyLoadingError) and failed authentication; TimeoutError a store that does not answer
        import redis
        return isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError))

    def ping(self):
        self.r.ping()

    # ---- registrations ------------------------------------------------------------------------
    def put_registration(self, reg):
        self.r.hset(_k("reg", reg.tenant, reg.kind), reg.name, reg.to_json())

    def get_registration(self, tenant, kind, name):
        v = self.r.hget(_k("reg", tenant, kind), name)
        return Registration.from_json(v) if v else None

    def list_registrations(self, tenant, kind):
        d = self.r.hgetall(_k("reg", tenant, kind))
        return [Registration.from_json(d[n]) for n in sorted(d)]

    def registrations_by_tier(self):
        out: dict[tuple[str, str], int] = {}
        for key in self.r.scan_iter(P + "reg:*"):
            for data in self.r.hvals(key):
                r = Registration.from_json(data)
                k = (r.kind, "unknown" if r.in_tier is None else str(bool(r.in_tier)).lower())
                out[k] = out.get(k, 0) + 1
        return out

    def delete_registration(self, tenant, kind, name):
        return bool(self.r.hdel(_k("reg", tenant, kind), name))

    def mark_used(self, tenant, kind, name, now, in_tier):
        from dataclasses import replace
        key = _k("reg", tenant, kind)
        v = self.r.hget(key, name)
        if v:
            reg = Registration.from_json(v)
            reg = replace(reg, last_used=now, in_tier=reg.in_tier if in_tier is None else in_tier)
            self.r.hset(key, name, reg.to_json())

    # ---- templates --------------------------------------------------------------------------
    def put_template(self, t):
        self.r.hset(_k("tpl", t.tenant), t.name, t.to_json())

    def get_template(self, tenant, name):
        v = self.r.hget(_k("tpl", tenant), name)
        return TemplateRecord.from_json(v) if v else None

    def list_templates(self, tenant):
        d = self.r.hgetall(_k("tpl", tenant))
        return [TemplateRecord.from_json(d[n]) for n in sorted(d)]

    def delete_template(self, tenant, name):
        return bool(self.r.hdel(_k("tpl", tenant), name))

    # ---- bounded maps (sessions, prompt index) ------------------------------------------------
    def _put_bounded(self, kind: str, items: dict[str, str], ttl: float, cap: int, now: float) -> None:
        lru = P + kind + "-lru"
        pipe = self.r.pipeline()
        for key, value in items.items():
            pipe.set(key, value, px=int(ttl * 1000))
            pipe.zadd(lru, {key: now})
        pipe.execute()
        over = self.r.zcard(lru) - cap
        if over > 0:
            dropped = [m for m, _ in self.r.zpopmin(lru, over)]
            if dropped:
                self.r.delete(*dropped)

    def _get_bounded(self, kind: str, keys: list[str], ttl: float, now: float) -> list:
        lru = P + kind + "-lru"
        pipe = self.r.pipeline()
        for key in keys:
            pipe.get(key)
            pipe.pexpire(key, int(ttl * 1000))
        out = pipe.execute()[0::2]
        hits = {k: now for k, v in zip(keys, out) if v is not None}
        if hits:
            self.r.zadd(lru, hits, xx=True)
        return out

    def put_session(self, tenant, session, data, now):
        self._put_bounded("sess", {_k("sess", tenant, session): data}, self.limits.session_ttl_s,
                          self.limits.session_max, now)

    def get_session(self, tenant, session, now):
        v = self._get_bounded("sess", [_k("sess", tenant, session)], self.limits.session_ttl_s, now)[0]
        return v.decode() if v is not None else None

    def delete_session(self, tenant, session):
        key = _k("sess", tenant, session)
        self.r.zrem(P + "sess-lru", key)
        return bool(self.r.delete(key))

    def put_prompt_blocks(self, tenant, blocks, now):
        if blocks:
            self._put_bounded("pfx", {_k("pfx", tenant, h): str(n) for h, n in blocks.items()},
                              self.limits.prompt_ttl_s, self.limits.prompt_max, now)

    def get_prompt_blocks(self, tenant, hashes, now):
        if not hashes:
            return {}
        vals = self._get_bounded("pfx", [_k("pfx", tenant, h) for h in hashes], self.limits.prompt_ttl_s, now)
        return {h: int(v) for h, v in zip(hashes, vals) if v is not None}

    # ---- prompt-matching fingerprints ---------------------------------------------------------
    def _trim(self, kind: str, cap: int) -> None:
        lru = P + kind + "-lru"
        over = self.r.zcard(lru) - cap
        if over > 0:
            dropped = [m for m, _ in self.r.zpopmin(lru, over)]
            if dropped:
                self.r.delete(*dropped)

    def _fp_write(self, tenant, items, now, op) -> list:
        ttl = int(self.limits.fingerprint_ttl_s * 1000)
        pipe = self.r.pipeline()
        for k, value in items:
            key = _k("fp", tenant, k)
            op(pipe, key, value)
            pipe.pexpire(key, ttl)
            pipe.zadd(P + "fp-lru", {key: now})
        out = pipe.execute()[0::3]
        self._trim("fp", self.limits.fingerprint_max)
        return out

    def count_fingerprints(self, tenant, keys, now):
        keys = list(dict.fromkeys(keys))
        got = self._fp_write(tenant, [(k, None) for k in keys], now, lambda pipe, key, _: pipe.hincrby(key, "n", 1))
        return {k: int(n) for k, n in zip(keys, got)}

    def put_fingerprints(self, tenant, entries, now):
        if entries:
            self._fp_write(tenant, list(entries.items()), now, lambda pipe, key, d: pipe.hset(key, "d", d))

    def get_fingerprints(self, tenant, keys, now, touch=True):
        if not keys:
            return {}
        keys = list(dict.fromkeys(keys))
        pipe = self.r.pipeline()
        for k in keys:
            pipe.hmget(_k("fp", tenant, k), "n", "d")
        vals = pipe.execute()
        hits = {k: (int(n or 0), (d or b"").decode()) for k, (n, d) in zip(keys, vals) if n is not None or d is not None}
        if hits and touch:
            ttl = int(self.limits.fingerprint_ttl_s * 1000)
            pipe = self.r.pipeline()
            for k in hits:
                pipe.pexpire(_k("fp", tenant, k), ttl)
            pipe.zadd(P + "fp-lru", {_k("fp", tenant, k): now for k in hits}, xx=True)
            pipe.execute()
        return hits

    def delete_fingerprints(self, tenant, keys):
        names = [_k("fp", tenant, k) for k in dict.fromkeys(keys)]
        if not names:
            return 0
        self.r.zrem(P + "fp-lru", *names)
        return int(self.r.delete(*names))

    def put_held_prompt(self, tenant, key, token_ids, now):
        from array import array
        self._put_bounded("held", {_k("held", tenant, key): array("q", token_ids).tobytes()},
                          self.limits.held_prompt_ttl_s, self.limits.held_prompt_max, now)

    def get_held_prompt(self, tenant, key, now, touch=True):
        from array import array
        name = _k("held", tenant, key)
        v = self._get_bounded("held", [name], self.limits.held_prompt_ttl_s, now)[0] if touch else self.r.get(name)
        return tuple(array("q", v)) if v is not None else None

    # ---- what the decode engines' prefix caches hold (read only on the request path) ------------
    def put_decode_held(self, tenant, blocks, now):
        if blocks:
            self._put_bounded("dh", {_k("dh", tenant, k): str(n) for k, n in blocks.items()},
                              self.limits.decode_held_ttl_s, self.limits.decode_held_max, now)

    def get_decode_held(self, tenant, keys, now):
        keys = list(dict.fromkeys(keys))
        if not keys:
            return {}
        vals = self.r.mget([_k("dh", tenant, k) for k in keys])      # Redis' TTL drops expired ones
        return {k: int(v) for k, v in zip(keys, vals) if v is not None}

    # ---- stored responses (TTL from storing; the oldest trimmed past response_max) -------------
    def put_response(self, tenant, response_id, data, now):
        self._put_bounded("resp", {_k("resp", tenant, response_id): data}, self.limits.response_ttl_s,
                          self.limits.response_max, now)

    def get_response(self, tenant, response_id, now):
        key = _k("resp", tenant, response_id)      # reading does not extend a stored response's life
        pipe = self.r.pipeline()
        pipe.get(key)
        pipe.zscore(P + "resp-lru", key)
        v, stored = pipe.execute()
        return v.decode() if v is not None and stored is not None and stored >= now - self.limits.response_ttl_s \
            else None

    def delete_response(self, tenant, response_id):
        key = _k("resp", tenant, response_id)
        self.r.zrem(P + "resp-lru", key)
        return bool(self.r.delete(key))

    # ---- API keys -----------------------------------------------------------------------------
    def put_api_key(self, key_hash, rec):
        if not self.r.hsetnx(P + "keyid", rec.key_id, key_hash):
            raise ValueError(f"key id {rec.key_id} already exists")
        self.r.hset(P + "keys", key_hash, rec.to_json())

    def api_key(self, key_hash):
        v = self.r.hget(P + "keys", key_hash)
        return ApiKeyRecord.from_json(v) if v else None

    def list_api_keys(self):
        recs = [ApiKeyRecord.from_json(v) for v in self.r.hgetall(P + "keys").values()]
        return sorted(recs, key=lambda r: (r.created, r.key_id))

    def revoke_api_key(self, key_id):
        h = self.r.hget(P + "keyid", key_id)
        if h is None:
            return False
        pipe = self.r.pipeline()
        pipe.hdel(P + "keys", h)
        pipe.hdel(P + "keyid", key_id)
        pipe.execute()
        return True

    # ---- metrics targets ----------------------------------------------------------------------
    def put_target(self, name, address, now):
        pipe = self.r.pipeline()
        pipe.hset(P + "targets", name, address)
        pipe.zadd(P + "targets:seen", {name: now})
        pipe.execute()

    def targets(self, now, ttl_s):
        old = self.r.zrangebyscore(P + "targets:seen", "-inf", now - ttl_s)
        if old:
            pipe = self.r.pipeline()
            pipe.hdel(P + "targets", *old)
            pipe.zrem(P + "targets:seen", *old)
            pipe.execute()
        return {k.decode(): v.decode() for k, v in sorted(self.r.hgetall(P + "targets").items())}

    # ---- secret, sizes, expiry ----------------------------------------------------------------
    def secret(self):
        self.r.set(P + "secret", os.urandom(32), nx=True)
        return bytes(self.r.get(P + "secret"))

    def _prune(self, kind: str, ttl: float, now: float) -> int:
        """Drop LRU members whose key expired (Redis removed the value itself)."""
        lru = P + kind + "-lru"
        stale = self.r.zrangebyscore(lru, "-inf", now - ttl)
        if stale:
            self.r.zrem(lru, *stale)
            self.r.delete(*stale)
        return len(stale)

    def sizes(self, now):
        self._prune("sess", self.limits.session_ttl_s, now)
        self._prune("pfx", self.limits.prompt_ttl_s, now)
        regs = sum(self.r.hlen(k) for k in self.r.scan_iter(P + "reg:*"))
        tpls = sum(self.r.hlen(k) for k in self.r.scan_iter(P + "tpl:*"))
        self._prune("fp", self.limits.fingerprint_ttl_s, now)
        self._prune("held", self.limits.held_prompt_ttl_s, now)
        self._prune("dh", self.limits.decode_held_ttl_s, now)
        return {"sessions": self.r.zcard(P + "sess-lru"), "prompt_index": self.r.zcard(P + "pfx-lru"),
                "registrations": regs, "templates": tpls, "fingerprints": self.r.zcard(P + "fp-lru"),
                "held_prompts": self.r.zcard(P + "held-lru"), "decode_held": self.r.zcard(P + "dh-lru")}

    def expire(self, now):
        out = {}
        names = {"sess": "sessions", "pfx": "prompt_index", "fp": "fingerprints", "held": "held_prompts",
                 "dh": "decode_held"}
        lim = self.limits
        for kind, ttl, cap in (("sess", lim.session_ttl_s, lim.session_max), ("pfx", lim.prompt_ttl_s, lim.prompt_max),
                               ("fp", lim.fingerprint_ttl_s, lim.fingerprint_max),
                               ("held", lim.held_prompt_ttl_s, lim.held_prompt_max),
                               ("dh", lim.decode_held_ttl_s, lim.decode_held_max)):
            n = self._prune(kind, ttl, now)
            lru = P + kind + "-lru"
            over = self.r.zcard(lru) - cap
            if over > 0:
                dropped = [m for m, _ in self.r.zpopmin(lru, over)]
                self.r.delete(*dropped)
                n += len(dropped)
            out[names[kind]] = n
        return out

    def close(self):
        self.r.close()
