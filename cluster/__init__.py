"""cluster: the control plane. Where a request enters (HTTP API, CLI), is planned
(router/planner: a pure function returning a frozen RequestPlan), and is measured (metrics).
Ray wiring that places prefill and decode actors lives here too.
"""
