"""cluster.control: the control plane proper, below the HTTP edge. A request is priced
(``pricing``: refused before tokenising when it cannot fit), rendered (``render``), planned (``planner``: a pure function returning a frozen ``RequestPlan``), routed
(``router``, ``routing``) and executed (``lifecycle``) on workers reached through the ``backends``
contract (``ray_backends`` in production, watched by ``health``; ``assembly`` builds the router
and its collaborators from the config); ``sessions``, ``registry`` and
``state/`` keep what must survive a restart (``usage_marks`` writes the registrations' last use
off the request path); ``admission`` refuses what cannot be served in time (``peers``: the other
replicas' queues as heard; ``exchange``: as they are now); ``shadow`` checks approximate plans
online and ``metrics`` records everything. Imports only ``kvruntime.messages`` and the worker packages (for
actor classes); never ``cluster.http`` or ``cluster.operator``.
"""
