"""Loaded as ``sitecustomize`` only by the vLLM P/D servers ``bench.vllm_pd --vllm-nixl quiet``
starts (this folder is put first on their PYTHONPATH; nothing else imports it).

nixl 1.5.1 starts each agent's progress thread with no delay: it busy-polls a core per agent,
idle or not (seen as one full core per idle agent in top), and vLLM's ``NixlConnector`` creates its agents with
that default. Here every ``nixl_agent_config`` is built with ``enable_prog_thread`` off, as
kvnotes' own NIXL transport runs; vLLM's worker then drives UCX progress itself when it polls its
transfers each engine step. It changes nothing else in vLLM.
"""
import os

if os.environ.get("KVNOTES_BENCH_NIXL_QUIET") == "1":
    try:
        from nixl_cu12 import _api as _nixl_api
    except ImportError:  # no NIXL in this environment: vLLM's connector will say so itself
        _nixl_api = None
    if _nixl_api is not None:
        _init = _nixl_api.nixl_agent_config.__init__

        def _quiet_init(self, *args, **kwargs):
            _init(self, *args, **kwargs)
            self.enable_pthread = False

        _nixl_api.nixl_agent_config.__init__ = _quiet_init
