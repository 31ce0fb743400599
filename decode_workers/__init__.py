"""decode_workers: receive a request's composed prefix KV from kvtransport, prefill the
remaining suffix, decode and stream tokens back; report TTFT. They never re-plan.
"""
