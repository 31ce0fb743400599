"""cluster.operator: what operators run, on top of the other two boxes. ``cli`` is the ``kvnotes``
command, ``launcher`` starts Ray, the workers and the Serve ingress, ``admin`` manages keys and
registrations, ``calibrate`` measures a model's fidelity profile (``kvnotes calibrate``), ``report`` and
``dashboard`` build the operator views, ``demo`` is the quick start.
May import ``cluster.http`` and ``cluster.control``; no other box of ``cluster`` imports it.
"""
