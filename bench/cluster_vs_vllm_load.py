"""The mixed Poisson load of ``bench.cluster_vs_vllm``: compose, cold and field-edit requests (one
third each) arriving at a Poisson rate, sent to kvnotes, then the same arrival times to plain vLLM
(its prefix cache on with one salt, as deployed). Each request is a thread; TTFT is client-side."""
from __future__ import annotations

import random
import threading
import time
import uuid



def cold_ids(s, size: int, rep: int) -> list[int]:
    q = s.question(" What does the note say first?")
    text = f"Note {uuid.uuid4().hex}. " + s.text(7919 * (rep + 1), size - len(q) - len(s.render.frame()) - 24)
    return list(s.render.frame()) + s.render.encode(text) + q


STATUSES = ["PENDING", "SHIPPED", "DELAYED", "DELIVERED", "RETURNED", "LOST", "HELD", "CANCELLED"]
EDIT_Q = "What is the order status now? One word."


def register_template(s, size: int, tag: str) -> tuple[str, str]:
    name = f"{tag}-booking-{size}"
    text = "Booking record. Current order status: {status}. Notes follow.\n" + s.text(3 * size, size - 80)
    r = s.kv.post("/v1/templates", json={"name": name, "text": text, "labels": {"status": "order status"}})
    if r.status_code != 201:
        raise RuntimeError(f"registering template: HTTP {r.status_code} {r.text[:200]}")
    return name, text


def edit_turn(s, name: str, text: str, session: str, salt: str, value: str, n: int) -> tuple[dict, dict]:
    kv = s.kv_native({"session": session, "kv_policy": "fast", "edit_strategy": "auto",
                      "segments": [{"template": name, "fields": {"status": value}}, {"text": EDIT_Q}]}, n)
    return kv, s.vllm_ids(s.template_ids(text, value) + s.question(EDIT_Q), salt, n)


def mixed_load(s, rate: float, count: int, size: int, n: int, seed: int, tag: str) -> list[dict]:
    """Poisson arrivals of compose / cold / edit (one third each) at ``rate``, on each system in turn."""
    k = max(2, round(size / 1024))
    names = [f"{tag}-load-{i}" for i in range(k)]
    chunks = []
    for i, nm in enumerate(names):
        text = s.text(50_000 + i * 997, int(size * 0.96 / k))
        if s.kv.post("/v1/skills", json={"name": nm, "text": text}).status_code != 201:
            raise RuntimeError(f"registering {nm} failed")
        chunks.append(list(s.render.chunk_ids(text)))
    tname, ttext = register_template(s, size, f"{tag}-load")
    n_edit = len(range(2, count, 3))
    sessions = [f"{tag}-load-{j}-{uuid.uuid4().hex[:6]}" for j in range(n_edit)]
    vsalt = uuid.uuid4().hex                       # plain vLLM: one salt, its prefix cache on as deployed
    for sess in sessions:                          # turn 0 of every session on both (warm, not timed)
        edit_turn(s, tname, ttext, sess, vsalt, STATUSES[0], n)
    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) for _ in range(count)]
    runs = []
    for system in ("kvnotes", "vLLM"):
        recs, lock = [], threading.Lock()

        def one(i: int, at: float, t0: float) -> None:
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            kind = ("compose", "cold", "edit")[i % 3]
            if kind == "compose":
                order = [(i + j) % k for j in range(k)]
                q = f"Question {i}: what is said about item {i}?"
                if system == "kvnotes":
                    r = s.kv_native({"segments": [{"skill": names[j]} for j in order] + [{"text": q}],
                                     "kv_policy": "fast"}, n)
                else:
                    ids = list(s.render.frame()) + [t for j in order for t in chunks[j]] + s.question(q)
                    r = s.vllm_ids(ids, vsalt, n)
            elif kind == "cold":
                ids = cold_ids(s, size, 1000 + i)
                r = s.kv_ids(ids, n) if system == "kvnotes" else s.vllm_ids(ids, vsalt, n)
            else:
                value, sess = STATUSES[1 + i % (len(STATUSES) - 1)], sessions[i // 3]
                if system == "kvnotes":
                    r = s.kv_native({"session": sess, "kv_policy": "fast", "edit_strategy": "auto",
                                     "segments": [{"template": tname, "fields": {"status": value}}, {"text": EDIT_Q}]}, n)
                else:
                    r = s.vllm_ids(s.template_ids(ttext, value) + s.question(EDIT_Q), vsalt, n)
            r.update(kind=kind, done=time.perf_counter() - t0)
            with lock:
                recs.append(r)

        t0, at, threads = time.perf_counter(), 0.0, []
        for i, g in enumerate(gaps):
            at += g
            threads.append(threading.Thread(target=one, args=(i, at, t0)))
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if len(recs) != count:
            raise RuntimeError(f"mixed load on {system}: {count - len(recs)} request(s) failed (see stderr)")
        runs.append({"rate": rate, "system": system, "records": recs, "span": max(r["done"] for r in recs)})
    return runs
