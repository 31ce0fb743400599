"""The admission exchange (cluster.control.exchange): two router replicas whose last heard views
of each other are stale take one request each at the same moment; the ledger (a prefill worker's
real ``QueueReports``) orders them so that the second replica decides with the first's request in
its queue, a refusal leaves the queue and corrects the ledger, reports never go back in time,
and an exchange without an answer leaves the decision to the last heard view, counted."""
import asyncio

import pytest

from cluster.control.admission import Admission, AdmissionConfig
from cluster.control.errors import RequestError
from cluster.control.exchange import QueueExchange
from cluster.control.metrics import Metrics
from cluster.control.peers import PeerQueues
from kvruntime.messages.prefill import QueueReport
from prefill_workers.queue_reports import QueueReports


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class LedgerBackends:
    """Stands in for the Ray backends of one replica (unit test of the exchange): the exchange goes
    straight to a shared ledger; ``hang``: the ledger never answers; ``gone``: no worker to ask."""

    def __init__(self, ledger: QueueReports, me: str):
        self.ledger, self.peers, self.hang, self.gone, self.sent = ledger, PeerQueues(me), False, False, []

    def exchange_queues(self, report, timeout_s):
        if self.gone:
            return None
        self.sent.append(report)
        return Reply(None if self.hang else self.ledger.update(report))   # recorded and answered at once


class Reply:
    """An awaitable answer, like the ObjectRef the Ray backends return (None: never answers)."""

    def __init__(self, answer):
        self.answer = answer

    def __await__(self):
        if self.answer is None:
            return asyncio.sleep(3600).__await__()
        return asyncio.sleep(0, self.answer).__await__()


def _replica(name: str, ledger: QueueReports, clock: Clock, timeout_s: float = 0.2):
    m, backends = Metrics(), LedgerBackends(ledger, name)
    adm = Admission(AdmissionConfig(max_queue_wait_s=30.0, ttft_factor=2.0), m, clock, workers=lambda: 1,
                    others=backends.peers.others)
    for _ in range(3):                       # unloaded TTFT 1 s: objective 2 s
        t = adm.admit("solo")
        clock.t += 1.0
        t.first_token()
        t.release()
    return QueueExchange(name, adm, backends, m, timeout_s), backends, m


def _count(m, result):
    return m.registry.get_sample_value("kvnotes_admission_exchanges_total", {"result": result})


def test_the_ledger_orders_two_replicas_admitting_at_once():
    clock, ledger = Clock(), QueueReports(clock=Clock())
    a, _, ma = _replica("router-a", ledger, clock)
    b, _, mb = _replica("router-b", ledger, clock)
    clock.t += 60

    async def run():
        first = await a.admit("t", None)             # nothing anywhere: (0 + 1) x 1 s
        assert first.queued and ledger.update(None)["router-a"].queued == 1
        # b's last heard view of a is stale (0): alone it would take the next one too; the ledger
        # says a has one queued: (1 + 1) x 1 s = 2 s, within the objective, admitted with that model
        second = await b.admit("t", None)
        assert second.queued and second.model_s == pytest.approx(2.0)
        assert b.backends.peers.others() == 1        # what the ledger answered is now b's view too
        # a's own queue (1) and its stale view of b (0) would take a third; the ledger has b's: 3 s > 2 s
        with pytest.raises(RequestError) as e:
            await a.admit("t", None)
        assert e.value.status == 503 and e.value.retry_after >= 1
        assert "(3.0 s, 2 requests queued ahead in the cluster)" in e.value.message
        assert a.admission.total == 1                # the refused request left a's queue...
        assert ledger.update(None)["router-a"].queued == 1  # ...and the ledger holds the corrected report
        assert ma.registry.get_sample_value("kvnotes_shed_total", {"reason": "ttft_objective"}) == 1
        first.first_token()                          # leaving the queue corrects the ledger too
        assert ledger.update(None)["router-a"].queued == 0
        second.first_token()
        assert ledger.update(None)["router-b"].queued == 0
    asyncio.run(run())
    assert _count(ma, "ok") == 2 and _count(mb, "ok") == 1
    assert ledger.update(None)["router-b"].ttft_p90_s == pytest.approx(1.0)   # reports carry the reference


def test_reports_never_go_back_in_time():
    ledger = QueueReports(clock=Clock())
    ledger.update(QueueReport("router-a", 3, seq=5))
    assert ledger.update(QueueReport("router-a", 1, seq=4))["router-a"].queued == 3   # an older path arrived late
    assert ledger.update(QueueReport("router-a", 0, seq=6))["router-a"].queued == 0
    with pytest.raises(ValueError, match="queue report"):
        QueueReport("router-a", 1, seq=-1)


def test_no_answer_leaves_the_decision_to_the_last_heard_view_and_is_counted():
    clock, ledger = Clock(), QueueReports(clock=Clock())
    a, backends, m = _replica("router-a", ledger, clock, timeout_s=0.05)
    ledger.update(QueueReport("router-b", 5, seq=1))    # the ledger knows b is busy; a has not heard
    clock.t += 60

    async def run():
        backends.hang = True
        t = await a.admit("t", None)                 # no answer in 50 ms: a's own view (nothing queued)
        assert t.queued
        t.first_token()
        backends.hang, backends.gone = False, True
        t = await a.admit("t", None)                 # no live prefill worker to ask
        assert t.queued
        t.first_token()
        backends.gone = False
        with pytest.raises(RequestError):            # the ledger answers: b's 5 queued ahead
            await a.admit("t", None)
    asyncio.run(run())
    assert (_count(m, "timeout"), _count(m, "unavailable"), _count(m, "ok")) == (1, 1, 1)


def test_off_without_the_objective_or_with_a_zero_timeout():
    clock, ledger = Clock(), QueueReports(clock=Clock())
    a, backends, m = _replica("router-a", ledger, clock, timeout_s=0.0)
    b_backends = LedgerBackends(ledger, "router-b")
    cold = QueueExchange("router-b", Admission(AdmissionConfig(ttft_factor=2.0), Metrics(), clock), b_backends,
                         Metrics(), 0.2)

    async def run():
        (await a.admit("t", None)).first_token()     # timeout 0: never asked
        (await cold.admit("t", None)).first_token()  # objective not yet measured: never asked
    asyncio.run(run())
    assert backends.sent == []                       # timeout 0: nothing, ever
    assert [r.queued for r in b_backends.sent] == [0]   # the announcement at start only (it starts the prober)
    with pytest.raises(ValueError, match="admission_exchange_timeout_s"):
        from kvruntime.config import ClusterConfig
        ClusterConfig.of(admission_exchange_timeout_s=-1)
