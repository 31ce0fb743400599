"""Admission control (cluster.control.admission) on a fake clock: the queue wait it predicts from
the measured interval between first tokens, 503 when full and 429 for a tenant over its share,
both with a Retry-After from the predicted drain time, and one tenant's burst not starving another."""
import pytest

from cluster.control.admission import Admission, AdmissionConfig
from cluster.control.errors import RequestError
from cluster.control.metrics import Metrics


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _adm(**kw):
    clock = Clock()
    m = Metrics()
    return Admission(AdmissionConfig(**{"max_queue_wait_s": 4.0, "cold_queue": 3, **kw}), m, clock), clock, m


def _measure(adm, clock, interval=1.0, n=3):
    """Serve n requests back to back, one first token every ``interval`` seconds."""
    clock.t += 60          # earlier tenants leave the tenant window
    ts = [adm.admit("warm") for _ in range(n)]
    for t in ts:
        clock.t += interval
        t.first_token()
        t.release()
    clock.t += 60          # "warm" leaves the tenant window
    return adm.interval


def test_cold_queue_is_bounded_then_the_measured_interval_predicts_the_wait():
    adm, clock, m = _adm()
    held = [adm.admit("a") for _ in range(3)]
    with pytest.raises(RequestError) as e:
        adm.admit("a")
    assert e.value.status == 503 and e.value.code == "overloaded" and e.value.retry_after >= 1
    for t in held:
        t.release()                    # ended before a first token: no service sample
    assert adm.interval is None and adm.total == 0
    assert _measure(adm, clock, 1.0) == pytest.approx(1.0)
    ok = [adm.admit("a") for _ in range(5)]          # waits 0..4 s: within max_queue_wait_s 4
    with pytest.raises(RequestError) as e:
        adm.admit("a")                              # 5 ahead x 1 s > 4 s
    assert e.value.status == 503 and e.value.to_json()["error"]["type"] == "service_unavailable"
    assert e.value.retry_after == pytest.approx(2.0)   # 5 ahead, 4 slots: two departures until it fits
    assert m.registry.get_sample_value("kvnotes_shed_total", {"reason": "queue_full"}) == 2
    assert m.registry.get_sample_value("kvnotes_admission_queue_depth") == 5
    assert m.registry.get_sample_value("kvnotes_admission_predicted_wait_seconds") == pytest.approx(5.0)
    clock.t += 1
    ok[0].first_token()
    ok[0].release()
    adm.admit("a")                                  # room again after one departure


def test_a_request_deadline_shorter_than_the_wait_is_refused():
    adm, clock, m = _adm()
    _measure(adm, clock, 1.0)
    adm.admit("a")
    adm.admit("a")
    with pytest.raises(RequestError) as e:
        adm.admit("a", deadline_s=1.5)              # 2 s predicted wait
    assert e.value.status == 503 and "deadline_s" in e.value.message
    assert e.value.retry_after == pytest.approx(1.5)   # until one of the two ahead has gone: (2 - 1.5 / 1 + 1) x 1 s
    assert m.registry.get_sample_value("kvnotes_shed_total", {"reason": "deadline"}) == 1
    assert adm.total == 2                           # the refused one left the queue
    # as the HTTP layer does it: admitted before the body is read, the body's deadline_s checked after
    t = adm.admit("a")                              # 2 s predicted wait: admitted without a deadline
    assert adm.total == 3
    with pytest.raises(RequestError) as e:
        adm.within_deadline(t, 1.5)
    assert e.value.status == 503 and not t.queued and adm.total == 2
    assert m.registry.get_sample_value("kvnotes_shed_total", {"reason": "deadline"}) == 2
    t = adm.admit("a", deadline_s=3.0)
    adm.within_deadline(t, 3.0)                     # within it: kept
    assert t.queued and adm.total == 3


def test_a_tenant_burst_does_not_starve_another_tenants_steady_traffic():
    adm, clock, m = _adm(max_queue_wait_s=8.0)
    _measure(adm, clock, 1.0)
    b = adm.admit("b")                              # b's steady traffic: one at a time
    burst, refused = [], []
    for _ in range(20):
        try:
            burst.append(adm.admit("a"))
        except RequestError as exc:
            refused.append(exc)
    assert refused and all(e.status == 429 and e.code == "tenant_over_share" for e in refused)
    assert all(e.retry_after >= 1 for e in refused)
    assert len(burst) == 4                          # 8 slots shared by 2 tenants
    for _ in range(5):                              # b keeps getting in while a's burst waits
        clock.t += 1
        b.first_token()
        b.release()
        b = adm.admit("b")
    assert m.registry.get_sample_value("kvnotes_shed_total", {"reason": "tenant_over_share"}) == len(refused)


def test_disabled_admits_everything():
    adm, clock, m = _adm(enabled=False)
    for _ in range(50):
        adm.admit("a")
    assert adm.total == 0


def test_a_stall_without_first_tokens_raises_the_predicted_wait_at_once():
    adm, clock, m = _adm()
    _measure(adm, clock, 1.0)
    adm.admit("a")
    adm.admit("a")
    adm.admit("a")                                  # 2 ahead x 1 s: within 4 s
    clock.t += 3                                    # no first token for 3 s
    with pytest.raises(RequestError) as e:
        adm.admit("a")                              # 3 ahead x 3 s > 4 s
    assert e.value.status == 503


def _alone(adm, clock, ttft: float, n: int):
    """``n`` requests, each admitted to an empty queue and at its first token ``ttft`` s later."""
    for _ in range(n):
        t = adm.admit("solo")
        clock.t += ttft
        t.first_token()
        t.release()


def test_the_ttft_objective_refuses_a_predicted_first_token_past_factor_times_the_unloaded_p90():
    adm, clock, m = _adm(max_queue_wait_s=30.0, ttft_factor=2.0)
    _alone(adm, clock, 1.0, 2)
    assert adm.snapshot()["ttft_budget_s"] is None               # two samples: the objective waits
    _alone(adm, clock, 1.0, 1)
    assert adm.snapshot()["ttft_budget_s"] == pytest.approx(2.0)  # 2 x the unloaded p90 (1 s)
    assert m.registry.get_sample_value("kvnotes_admission_ttft_budget_seconds") == pytest.approx(2.0)
    assert adm.interval == pytest.approx(1.0)
    clock.t += 60
    first, second = adm.admit("a"), adm.admit("a")            # predicted first tokens at 1 and 2 s: admitted
    with pytest.raises(RequestError) as e:
        adm.admit("a")                                        # (2 ahead + 1) x 1 s = 3 s > 2 s
    assert e.value.status == 503 and e.value.code == "overloaded"
    assert "time to the first token (3.0 s, 2 requests queued ahead in the cluster)" in e.value.message \
        and "2 x its unloaded TTFT p90" in e.value.message
    assert e.value.retry_after == pytest.approx(1.0)
    assert m.registry.get_sample_value("kvnotes_shed_total", {"reason": "ttft_objective"}) == 1
    # the wait budget alone (30 s) would have admitted it
    off, oclock, _ = _adm(max_queue_wait_s=30.0)
    _alone(off, oclock, 1.0, 3)
    oclock.t += 60
    assert [off.admit("a") for _ in range(3)] and off.snapshot()["ttft_budget_s"] is None
    clock.t += 1
    first.first_token()
    clock.t += 1
    second.first_token()
    assert list(adm._unloaded) == [1.0] * 3                   # `first` had `second` queued behind it: no sample
    adm.admit("a")                                            # drained: room again


def test_ttft_factor_is_zero_or_at_least_one():
    from kvruntime.config import ClusterConfig
    assert ClusterConfig.of(admission_ttft_factor=2.5).server.admission_ttft_factor == 2.5
    for bad in (0.5, -1):
        with pytest.raises(ValueError, match="admission_ttft_factor"):
            ClusterConfig.of(admission_ttft_factor=bad)


def test_the_ttft_objective_never_refuses_a_request_alone_in_the_queue():
    """An interval measured in a slow spell (over the objective) must not refuse a request with
    nothing ahead: else the queue stays empty, nothing is measured again and every request is refused."""
    adm, clock, m = _adm(max_queue_wait_s=60.0, ttft_factor=2.0)
    _alone(adm, clock, 1.0, 20)
    clock.t += 60
    a, b = adm.admit("a"), adm.admit("a")          # first tokens predicted at 1 and 2 s
    clock.t += 20                                  # a stall: 20 s per first token
    a.first_token()
    clock.t += 20
    b.first_token()
    assert adm.interval > 2.0 and adm.snapshot()["ttft_budget_s"] == pytest.approx(2.0)
    clock.t += 60
    alone = adm.admit("a")                         # nothing ahead: admitted
    with pytest.raises(RequestError) as e:
        adm.admit("a")                             # behind it: (1 + 1) x interval > 2 s
    assert e.value.code == "overloaded"
    clock.t += 1
    alone.first_token()
    assert adm.interval < 7.0                      # measured again: the spell fades


def test_the_objective_counts_the_other_replicas_queues_and_measures_the_slowdown():
    """Two replicas before one prefill worker: the requests another replica has queued (as the
    workers last reported them) count ahead of this one; a request admitted while any replica had
    one queued is no unloaded sample; first tokens slower than the model predicts raise it."""
    others = [0]
    clock, m = Clock(), Metrics()
    adm = Admission(AdmissionConfig(max_queue_wait_s=30.0, ttft_factor=2.0), m, clock, workers=lambda: 1,
                    others=lambda: others[0])
    _alone(adm, clock, 1.0, 3)                       # S = 1 s, objective 2 s
    clock.t += 60
    others[0] = 1                                    # the other replica has one queued
    mine = adm.admit("a")                            # (1 / 1 + 1) x 1 s = 2 s: admitted
    assert mine.model_s == pytest.approx(2.0)
    with pytest.raises(RequestError) as e:
        adm.admit("a")                               # (2 + 1) x 1 s = 3 s > 2 s
    assert "(3.0 s, 2 requests queued ahead in the cluster)" in e.value.message
    assert m.registry.get_sample_value("kvnotes_admission_peer_queued") == 1
    clock.t += 4                                     # served in 4 s, the model said 2 s
    mine.first_token()
    assert list(adm._unloaded) == [1.0] * 3          # not an unloaded sample: a peer has one queued
    assert adm.slowdown == 1.0                       # one ratio (2) so far: the model is trusted as is...
    for _ in range(2):                               # ...two more served at twice the model's 2 s
        t = adm.admit("a")
        clock.t += 4
        t.first_token()
    assert adm.slowdown == pytest.approx(2.0)        # p90 of [2, 2, 2]
    with pytest.raises(RequestError):
        adm.admit("a")                               # (1 / 1 + 1) x 1 s x 2 = 4 s > 2 s
    assert m.registry.get_sample_value("kvnotes_admission_slowdown") == pytest.approx(2.0)
    others[0] = 0
    alone = adm.admit("a")                           # nothing queued anywhere: never refused (1 x 1 x 2 s)
    assert alone.model_s == pytest.approx(1.0)
    # two live workers halve the wait the others' queue adds
    peers = [0]
    two = Admission(AdmissionConfig(max_queue_wait_s=30.0, ttft_factor=2.0), Metrics(), Clock(), workers=lambda: 2,
                    others=lambda: peers[0])
    _alone(two, two.clock, 1.0, 3)
    two.clock.t += 60
    peers[0] = 2
    assert two.admit("a").model_s == pytest.approx(2.0)    # (2 / 2 + 1) x 1 s


def test_queue_reports_travel_through_the_workers_and_expire():
    from cluster.control.peers import PeerQueues
    from kvruntime.messages.prefill import QueueReport
    from prefill_workers.queue_reports import QueueReports
    clock = Clock()
    worker = QueueReports(ttl_s=5.0, clock=clock)
    assert _queued(worker.update(QueueReport("router-a", 3))) == {"router-a": 3}
    clock.t += 1
    seen = worker.update(QueueReport("router-b", 1))
    assert _queued(seen) == {"router-a": 3, "router-b": 1}
    a = PeerQueues("router-a", ttl_s=5.0, clock=clock)
    a.heard(seen)
    assert a.others() == 1                           # its own report is not counted
    clock.t += 4.5
    assert _queued(worker.update(None)) == {"router-b": 1}    # router-a's report is 5.5 s old: dropped
    clock.t += 1
    assert a.others() == 0                           # router-b last heard 5.5 s ago
    for bad in (("", 1), ("router-c", -1), ("router-c", 1.5), ("router-c", 1, 0, 2.0, 1.0), ("router-c", 1, 0, -1.0)):
        with pytest.raises(ValueError, match="queue report"):
            QueueReport(*bad)


def _queued(reports) -> dict:
    return {r: rep.queued for r, rep in reports.items()}


def test_a_replica_without_its_own_unloaded_ttft_applies_the_objective_with_the_others():
    """A replica that has measured no unloaded TTFT yet (just started, or the quiet requests went to
    the other) would admit without an objective: it takes the other replicas' reference as heard."""
    from cluster.control.peers import PeerQueues
    from kvruntime.messages.prefill import QueueReport
    clock = Clock()
    peers = PeerQueues("router-b", clock=clock)
    cold = Admission(AdmissionConfig(max_queue_wait_s=30.0, ttft_factor=2.0), Metrics(), clock, workers=lambda: 1,
                     others=peers.others, reference=peers.reference)
    assert cold.snapshot()["ttft_budget_s"] is None and cold.objective_on() is False
    held = [cold.admit("a") for _ in range(3)]        # no reference anywhere: only the wait budget applies
    for t in held:
        t.release()
    warm, wclock, _ = _adm(max_queue_wait_s=30.0, ttft_factor=2.0)
    _alone(warm, wclock, 1.0, 3)
    p50, p90 = warm.own_reference()
    assert (p50, p90) == (1.0, 1.0)
    peers.heard({"router-a": QueueReport("router-a", 0, 7, p50, p90),
                 "router-c": QueueReport("router-c", 0, 3, 0.5, 0.6)})
    assert peers.reference() == (1.0, 1.0)            # the most lenient of those measured
    assert cold.snapshot()["ttft_budget_s"] == pytest.approx(2.0) and cold.own_reference() is None
    first = cold.admit("a")                           # (0 + 1) x 1 s
    assert first.model_s == pytest.approx(1.0)
    cold.admit("a")                                   # (1 + 1) x 1 s = 2 s: within
    with pytest.raises(RequestError) as e:
        cold.admit("a")                               # (2 + 1) x 1 s = 3 s > 2 s
    assert e.value.code == "overloaded"


def test_only_a_request_alone_from_admission_to_first_token_is_an_unloaded_sample():
    others = [0]
    adm, clock, m = _adm(max_queue_wait_s=30.0, ttft_factor=2.0)
    adm.others = lambda: others[0]
    _alone(adm, clock, 1.0, 3)
    clock.t += 60
    a = adm.admit("a")
    b = adm.admit("a")                     # disturbs a
    clock.t += 3
    a.first_token()
    clock.t += 3
    b.first_token()
    c = adm.admit("a")                     # alone here, but a peer queues one before its first token
    others[0] = 1
    clock.t += 5
    c.first_token()
    others[0] = 0
    d = adm.admit("a")
    d.release()                            # ended without a first token: nothing measured
    e = adm.admit("a")
    clock.t += 1.5
    e.first_token()
    assert list(adm._unloaded) == [1.0, 1.0, 1.0, 1.5] and not adm._live


def test_no_unloaded_sample_is_taken_while_the_replica_sheds():
    """A request alone in the queue during an overload (the others were refused) runs beside the
    work of those just before it: were it an unloaded sample, the reference would drift up with the
    load and the objective loosen as the overload went on."""
    adm, clock, m = _adm(max_queue_wait_s=30.0, ttft_factor=2.0)
    _alone(adm, clock, 1.0, 3)
    clock.t += 60
    a, b = adm.admit("a"), adm.admit("a")
    with pytest.raises(RequestError):
        adm.admit("a")                     # (2 + 1) x 1 s > 2 s: shed
    clock.t += 1
    a.first_token()
    clock.t += 1
    b.first_token()
    clock.t += 0.5
    alone = adm.admit("a")                 # nothing queued anywhere, but 0.5 s after a refusal
    clock.t += 3.0
    alone.first_token()                    # 3 s: would raise the p90 (and the objective) to 6 s
    assert list(adm._unloaded) == [1.0] * 3 and adm.snapshot()["ttft_budget_s"] == pytest.approx(2.0)
    clock.t += 60
    quiet = adm.admit("a")                 # long after the last refusal: a sample again
    clock.t += 1.2
    quiet.first_token()
    assert list(adm._unloaded) == pytest.approx([1.0] * 3 + [1.2])


def test_first_tokens_sooner_than_modelled_never_lower_the_slowdown_below_one():
    """The model counts the request in service as a whole S: one queued behind a request nearly
    done comes sooner. A slowdown under 1 learned from those would admit a third behind two."""
    adm, clock, m = _adm(max_queue_wait_s=30.0, ttft_factor=2.0)
    _alone(adm, clock, 1.0, 3)                     # S = 1 s, objective 2 s
    clock.t += 60
    for _ in range(5):
        a, b = adm.admit("a"), adm.admit("a")      # b modelled at 2 s
        clock.t += 0.9
        a.first_token()
        clock.t += 0.2
        b.first_token()                            # at 1.1 s: ratio 0.55
        clock.t += 60
    assert adm.slowdown == 1.0
    adm.admit("a"), adm.admit("a")
    with pytest.raises(RequestError):
        adm.admit("a")                             # (2 + 1) x 1 s x 1 = 3 s > 2 s, as with no samples
