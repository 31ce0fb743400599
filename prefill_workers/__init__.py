"""prefill_workers: execute a RequestPlan's prefill steps — load chunk KV from the tier,
reposition, seam repair, erratum prefill, selective recompute or full recompute — and hand
the composed prefix KV to a decode worker through kvtransport. They never re-plan.
"""
