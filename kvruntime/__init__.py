"""kvruntime: the shared model runtime both worker kinds build on.

Where it sits in a request's flow: prefill workers use it to compute, reposition, repair and
edit KV ("the notes the model took at prefill"); decode workers use it as the reference
decode engine and as the oracle tests compare vLLM against. It never imports from
``cluster``, ``prefill_workers`` or ``decode_workers``.

Boxes inside:
- ``models``: the model registry (names, GGUF sources, chat framing) and the entry point that
  also takes a local HF checkpoint directory.
- ``hf_models``: a checkpoint directory as a model: architecture, context window and chat
  framing read from it, content-hashed name, one-line refusal of what cannot be spliced.
- ``rope_config``: per-layer RoPE frequencies from a config (transformers' own functions).
- ``checkpoint``: one-time GGUF -> safetensors conversion, cached by the GGUF's hash.
- ``kv``: the one KV layout (:class:`KVCache`), owned here and nowhere else.
- ``rope``: key re-rotation by a position delta and its startup self-test.
- ``engine``: the reference engine (torch + transformers): prefill at arbitrary positions
  against an arbitrary past, greedy/sampled decode.
- ``ops``: the KV operations: reposition/splice/seam repair, erratum, edit-in-place, recompute.
- ``fidelity``: the harness that measures each operation against full recompute.
"""
