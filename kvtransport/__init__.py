"""kvtransport: the KV block format (header + payload, one codec), the KV tier (LMCache
behind a small store interface) and the transfer between prefill and decode workers.
"""
