"""The message module: every value that crosses a box boundary, torch-free and frozen.

Where it sits: at the bottom of the package graph. ``cluster`` (control plane),
``prefill_workers``, ``decode_workers`` and ``kvtransport`` import these values and never each
other in a cycle (``tests/test_import_graph.py`` walks the imports). Nothing here imports torch,
transformers or Ray, so the router and the state store can use them without a model runtime.

- ``plan``: :class:`RequestPlan` / :class:`SegmentPlan` / :class:`KVRef` -- the planner's output,
  what prefill workers execute and what ``explain`` shows.
- ``keys``: :class:`ChunkKey` -- the content address of KV in the tier, derivable from a plan.
- ``decode``: :class:`SamplingParams`, :class:`DecodeJob` (one ``DecodeWorker.generate`` call),
  :class:`TokenEvent`, :class:`DecodeSummary` -- the router <-> decode worker boundary.
- ``prefill``: :class:`PrefillJob` (one ``PrefillWorker.execute`` call), :class:`PrefillStats`,
  :class:`PrefillResult` -- what a prefill worker is asked and reports.
- ``fidelity``: :class:`ShadowResult` -- an online shadow check (prefill worker -> router).
- ``transfer``: :class:`KVEndpoint`, :class:`TransferGrant` (per-transfer credential),
  :class:`TransferExpectation` / :class:`ExpectReply` (``DecodeWorker.expect``), stage names.
"""
