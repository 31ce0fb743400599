"""The request as a value: RequestContext, its OutcomeRecord and leases, the worker messages'
checks, and the runner's one table from errors to statuses."""
from __future__ import annotations

import pytest

from cluster.control.context import OutcomeRecord, RequestContext, StageClock
from cluster.control.errors import RequestError
from cluster.control.lifecycle import FAILURES, PlannedRequest, RequestRunner, _Run
from cluster.control.metrics import Metrics
from cluster.control.routing import DeadlineExceeded, FaultPolicy, NoLiveWorker, WorkerLost
from kvruntime.messages.decode import SamplingParams
from kvruntime.messages.plan import Policy, RequestPlan
from kvruntime.messages.transfer import TransferExpectation, TransferGrant
from tests.conftest import metric


class _Ticket:
    def __init__(self):
        self.first, self.released = 0, 0

    def first_token(self):
        self.first += 1

    def release(self):
        self.released += 1


class _Lease:
    def __init__(self):
        self.released = 0

    def release(self):
        self.released += 1


def test_a_choice_shares_the_requests_clock_outcome_and_ticket_but_not_its_leases():
    ticket = _Ticket()
    ctx = RequestContext("rid", "acme", clock=StageClock(), outcome=OutcomeRecord("acme")).admitted(ticket)
    lease = _Lease()
    ctx.leases.add(lease)
    one = ctx.with_body(policy="exact", deadline_s=3.0).choice("rid.1")
    assert (one.request_id, one.policy, one.deadline_s, one.tenant) == ("rid.1", "exact", 3.0, "acme")
    assert one.clock is ctx.clock and one.outcome is ctx.outcome and one.ticket is ticket
    assert one.leases is not ctx.leases
    one.leases.release()
    assert lease.released == 0                      # the choice's leases are its own
    ctx.leases.release()
    ctx.leases.release()
    assert lease.released == 1                      # released once
    one.lap("render")
    assert [k for k, _ in ctx.clock.laps] == ["render"]
    one.first_token()
    assert ticket.first == 1 and ctx.outcome.first_token and ctx.outcome.cancel_outcome == \
        "cancelled_after_first_token"


def test_a_local_context_has_no_clock_and_laps_are_no_ops():
    ctx = RequestContext.local("t", policy="fast")
    ctx.lap("validate")
    ctx.add("tier_lookup", 0.5)
    ctx.leave_queue()
    assert ctx.clock is None and ctx.ticket is None and ctx.outcome.tenant == "t" and len(ctx.request_id) == 32


def test_count_request_labels_by_the_record_and_marks_it_counted():
    m = Metrics()
    m.set_tenant_labels(["acme"])
    named, other, anonymous = OutcomeRecord("acme"), OutcomeRecord("someone"), OutcomeRecord()
    m.count_request("reuse", "ok", record=named)
    m.count_request("none", "cancelled", record=other)
    anonymous.shed = True
    m.count_request("none", "unavailable", record=anonymous)
    text = m.render().decode()
    assert named.counted and other.counted and anonymous.counted
    assert metric(text, "kvnotes_requests_total", plan="reuse", tenant="acme", outcome="ok") == 1
    assert metric(text, "kvnotes_requests_total", tenant="other", outcome="cancelled_before_first_token") == 1
    assert metric(text, "kvnotes_requests_total", tenant="none", status="unavailable", outcome="shed") == 1


def test_an_expectation_whose_ids_are_not_its_grants_is_refused():
    grant, _ = TransferGrant.issue("t-1", "m", "float32", (1, 2, 3))
    assert TransferExpectation(grant, (1, 2, 3), "salt").prefix_ids == (1, 2, 3)
    with pytest.raises(ValueError, match="do not match its grant"):
        TransferExpectation(grant, (1, 2), "salt")


def _runner_and_job():
    plan = RequestPlan("rid", "m", Policy.EXACT, (), (5, 6))      # no prefix steps: a recompute
    job = PlannedRequest(plan, SamplingParams(max_tokens=4), None, 0, "salt", 0.0)
    return RequestRunner(None, None, FaultPolicy(), Metrics(), "float32", None, "default"), job


@pytest.mark.parametrize("exc, status, code", [
    (DeadlineExceeded("decode"), "deadline", 504),
    (NoLiveWorker("decode"), "no_live_worker", 503),
    (WorkerLost("decode", 1, "ActorDiedError"), "worker_lost", 503),
])
def test_each_error_maps_to_one_status_and_http_code(exc, status, code):
    runner, job = _runner_and_job()
    ctx = RequestContext.local()
    assert FAILURES[type(exc)][:2] == (status, code)
    with pytest.raises(RequestError) as info:
        runner._fail(ctx, job, _Run(0.0, "kv", 0), exc)
    assert info.value.status == code and ctx.outcome.counted
    assert metric(runner.metrics.render().decode(), "kvnotes_requests_total", plan="recompute", status=status) == 1


def test_a_client_error_and_an_unknown_error_are_raised_unchanged_and_counted():
    runner, job = _runner_and_job()
    bad, boom = RequestError(400, "no"), RuntimeError("boom")
    for exc in (bad, boom):
        with pytest.raises(type(exc)) as info:
            runner._fail(RequestContext.local(), job, _Run(0.0, "kv", 0), exc)
        assert info.value is exc
    text = runner.metrics.render().decode()
    assert metric(text, "kvnotes_requests_total", status="client_error") == 1
    assert metric(text, "kvnotes_requests_total", status="error") == 1


def test_a_worker_lost_mid_stream_stays_a_worker_loss_naming_the_tokens_sent():
    runner, job = _runner_and_job()
    run = _Run(0.0, "kv", 0)
    run.sent = 3
    with pytest.raises(WorkerLost, match="mid-stream after 3 tokens"):
        runner._fail(RequestContext.local(), job, run, WorkerLost("decode", 0, "ActorDiedError"))
