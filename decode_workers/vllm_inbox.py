"""How a decode actor's ``Receiver`` reaches the kvnotes connector that vLLM builds.

vLLM constructs a connector from its config alone (``connector_cls(vllm_config, role,
kv_cache_config)``), so a live object (the actor's inbox: a gRPC server, NIXL agents) cannot
travel in that config: it travels by key, as vLLM's LMCache connector finds its engine by name
(``LMCacheEngineBuilder.get_or_create``). The engine registers its receiver here, puts the key
in ``kv_connector_extra_config`` (``kvnotes_inbox_key``) and releases it when it stops; the
worker-side connector looks the key up once, at its construction, in the same process (vLLM
runs in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). A key that is not registered is an
error naming it, never a quiet switch to another inbox.
"""
from __future__ import annotations

import threading
import uuid

from kvtransport.transfer.interface import KVReceiver


class InboxRegistry:
    """Receivers of the vLLM engines in this process, by key."""

    def __init__(self):
        self._lock = threading.Lock()
        self._receivers: dict[str, KVReceiver] = {}

    def register(self, receiver: KVReceiver) -> str:
        """A fresh key under which the connector finds ``receiver`` until :meth:`release`."""
        if not isinstance(receiver, KVReceiver):
            raise ValueError(f"a decode engine's inbox must be a KVReceiver, got {type(receiver).__name__}")
        key = uuid.uuid4().hex
        with self._lock:
            self._receivers[key] = receiver
        return key

    def get(self, key: str) -> KVReceiver:
        with self._lock:
            receiver = self._receivers.get(key)
        if receiver is None:
            raise LookupError(f"no kvnotes inbox is registered under kvnotes_inbox_key={key!r} in this process: "
                              f"the connector must run in the process of the engine that registered it "
                              f"(VLLM_ENABLE_V1_MULTIPROCESSING=0), before that engine stops")
        return receiver

    def release(self, key: str) -> None:
        with self._lock:
            self._receivers.pop(key, None)


#: this process's registry (vLLM's connector has no other way in than its config)
INBOXES = InboxRegistry()
