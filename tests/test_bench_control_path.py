"""``bench.control_path``'s arithmetic on recorded requests (no servers), the stage clock the router
keeps for ``explain.control``, and what the control-path fixes must keep: the replica header on
plain and streamed responses, and the registrations' last use recorded (or a failed write counted)
while the request is answered."""
import asyncio
import copy
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from bench.control_path import markdown, stages_of, summarise
from cluster.control.context import StageClock


def _rec(send: float, ttft: float, laps: list, worker: dict, stages: dict, kind: str = "reposition") -> dict:
    start = send + 0.010                                # client -> router: 10 ms
    first = start + sum(v for _, v in laps)
    return {"send": send, "first": first + 0.005, "ttft": first + 0.005 - send, "prompt": 8000, "cached": 7900,
            "fallbacks": [], "explain": {"kind": kind, "stages": stages,
                                         "control": {"start": start, "first_token": first, "laps": laps,
                                                     "worker": worker}}}


PREFILLED = _rec(100.0, 0.0, [["http_auth", 0.001], ["http_body", 0.002], ["validate", 0.0005], ["render", 0.003],
                              ["lookup_state", 0.008], ["plan", 0.001], ["grant", 0.002], ["expect_call", 0.004],
                              ["prefill_call", 2.0], ["decode_call", 1.01]],
                 {"tier_lookup": 0.005, "prefill_build": 1.7, "prefill_send": 0.25},
                 {"tier_get": 0.1, "rerotate": 0.08, "forward": 1.3, "serialise": 0.001, "transfer": 0.249,
                  "receive": 0.0005, "load": 0.0015, "suffix_forward": 0.9, "first_token": 1.0})
HELD = _rec(200.0, 0.0, [["http_auth", 0.001], ["http_body", 0.002], ["validate", 0.0005], ["render", 0.002],
                         ["lookup_state", 0.006], ["plan", 0.001], ["grant", 0.001], ["expect_call", 0.003],
                         ["decode_call", 0.30]],
            {"tier_lookup": 0.004}, {"forward": 0.05, "suffix_forward": 0.24, "first_token": 0.245}, kind="reuse")


def test_stages_split_a_prefilled_request_into_control_kv_path_and_forward():
    s = stages_of(PREFILLED)
    assert s["client -> router"] == pytest.approx(0.010) and s["router -> client"] == pytest.approx(0.005)
    assert s["tier_lookup"] == pytest.approx(0.005) and s["lookup_state"] == pytest.approx(0.003)
    assert s["prefill Ray overhead"] == pytest.approx(2.0 - 1.7 - 0.25)
    assert s["decode call overhead"] == pytest.approx(1.01 - 0.0005 - 0.0015 - 1.0)
    # the KV path is what the prefill actor measured (build + send) plus the decode side's receive and load
    assert s["KV path"] == pytest.approx(1.7 + 0.25 + 0.002)
    assert s["KV path: prefill build outside its stages"] == pytest.approx(1.7 + 0.25 + 0.002 - 1.732)
    assert s["model forward"] == pytest.approx(1.0)
    assert s["control total"] == pytest.approx(s["TTFT"] - s["KV path"] - 1.0)
    # every control stage is accounted for: the listed ones add up to the control total
    listed = [k for k in s if k not in ("TTFT", "control total", "model forward") and not k.startswith("KV path")]
    assert sum(s[k] for k in listed) == pytest.approx(s["control total"])


def test_a_request_the_decode_engine_completes_itself_counts_its_forward_as_kv_path():
    s = stages_of(HELD)
    assert "prefill Ray overhead" not in s and s["KV path"] == pytest.approx(0.05)
    assert s["decode call overhead"] == pytest.approx(0.30 - 0.245 - 0.05)
    listed = [k for k in s if k not in ("TTFT", "control total", "model forward") and not k.startswith("KV path")]
    assert sum(s[k] for k in listed) == pytest.approx(s["control total"])


def test_medians_and_the_table():
    other = _rec(300.0, 0.0, [[k, 3 * v] for k, v in PREFILLED["explain"]["control"]["laps"]],
                 {k: 3 * v for k, v in PREFILLED["explain"]["control"]["worker"].items()}, PREFILLED["explain"]["stages"])
    med = summarise([PREFILLED, HELD, other])
    assert med["render"] == pytest.approx(0.003)                  # median of 3, 2 and 9 ms
    assert med["prefill Ray overhead"] == pytest.approx(0.05)      # 0 for the request that had no prefill
    run = {"model": "m", "dtype": "float32", "reps": 3, "machine": "x",
           "sizes": {"8192": {"requests": [PREFILLED, HELD, other], "prompt_tokens": 8000, "load": "1.00 1.00 1.00"}}}
    text = markdown(run)
    assert "### 8192 tokens (8000 prompt tokens, 3 requests, plan reposition, reuse; load average 1.00" in text
    assert "| render | 3.0 |" in text and f"| **control total** | **{med['control total'] * 1e3:.1f}** | 100% |" in text
    ctl = med["control total"]
    assert f"| tier_lookup | 5.0 | {0.005 / ctl:.0%} |" in text


def test_stage_clock_laps_add_up_and_worker_times_accumulate():
    c = StageClock()
    time.sleep(0.002)
    c.lap("a")
    c.lap("b")
    c.add("tier_lookup", 0.25)
    c.add("tier_lookup", 0.5)
    t = time.perf_counter()
    assert [k for k, _ in c.laps] == ["a", "b"] and c.laps[0][1] >= 0.002
    assert sum(v for _, v in c.laps) <= t - c.start
    j = c.as_json()
    assert j["worker"] == {"tier_lookup": 0.75} and j["laps"][0][0] == "a" and j["start"] == c.start


def test_the_replica_header_is_on_plain_and_streamed_responses():
    from cluster.http.serve_app import REPLICA_HEADER, _TagReplica, app

    r = TestClient(app).get("/no-such-route")
    assert r.status_code == 404 and r.headers[REPLICA_HEADER] == "local" and "request_id" in r.json()["error"]

    async def stream(_):
        async def body():
            for i in range(3):
                yield f"data: {i}\n\n".encode()
        return StreamingResponse(body(), media_type="text/event-stream")
    small = Starlette(routes=[Route("/s", stream)])
    small.add_middleware(_TagReplica)
    r = TestClient(small).get("/s")
    assert r.headers[REPLICA_HEADER] == "local" and r.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"


@pytest.mark.slow
def test_a_composed_request_records_its_laps_and_its_chunks_last_use(smol, tmp_path):
    """The router's laps in order (explain.control), the tier lookup and the prefill actor's own
    times; the registrations' last use written off the request's path, and a failed write counted
    while the request is answered."""
    from cluster.control.state import StateStoreUnavailable
    from kvtransport.transfer.endpoints import BlockKVSender
    from kvtransport.transfer.grpc_transport import GrpcTransport
    from tests.conftest import metric
    from tests.test_router_fallback import LATE_SKILL, _complete, _router

    router, b = _router(smol, BlockKVSender(GrpcTransport()), tmp_path)

    async def timed():
        return await _complete(router, LATE_SKILL, "fast", clock=StageClock())
    try:
        asyncio.run(router.register_chunk("skill", "default", "museum", "The Varga Museum closes at 17:30."))
        before = router.state.get_registration("default", "skill", "museum").last_used
        toks, fin = asyncio.run(timed())
        assert len(toks) > 0 and fin.plan.kind.value == "reposition"
        names = [k for k, _ in fin.clock.laps]
        assert names == ["validate", "render", "lookup_state", "plan", "grant", "expect_call", "prefill_call",
                         "decode_call"]
        assert set(fin.clock.extra) == {"tier_lookup", "prefill_build", "prefill_send"}
        assert fin.clock.first_token is not None and fin.clock.first_token > fin.clock.start
        reg = router.state.get_registration("default", "skill", "museum")
        assert reg.last_used > before and reg.in_tier is True

        def down(*a, **kw):
            raise StateStoreUnavailable("state store down (test)")
        router.state.mark_used = down
        toks2, fin2 = asyncio.run(_complete(router, LATE_SKILL, "fast"))
        assert toks2 == toks and fin2.clock is None              # no HTTP layer: no clock, same answer
        assert metric(router.metrics.render().decode(), "kvnotes_fallbacks_total", reason="mark_used_failed") == 1
    finally:
        b.rx.stop()


def test_the_held_copy_after_the_first_token_is_shown_but_in_no_total():
    rec = copy.deepcopy(PREFILLED)
    rec["explain"]["stages"]["held_copy"] = 0.13
    s, base = stages_of(rec), stages_of(PREFILLED)
    assert s["held_copy (after the first token)"] == pytest.approx(0.13)
    for k in ("control total", "KV path", "model forward", "decode call overhead"):
        assert s[k] == pytest.approx(base[k])
    table = markdown({"sizes": {"4096": {"prompt_tokens": 4000, "requests": [rec]}}})
    assert "| held_copy (after the first token, in no total) | 130.0 | |" in table
    assert f"| **control total** | **{base['control total'] * 1e3:.1f}** | 100% |" in table
