"""cluster.http: the HTTP edge, where a request enters. ``serve_app`` is the Ray Serve ingress
(request id from ``ids``, auth, body limits, in-flight slot), ``api`` maps the OpenAI and native endpoints onto
the router, ``validate`` and ``body`` turn every caller mistake into a 4xx before anything is
planned, ``auth`` maps API keys to tenants, ``errors`` shapes error responses, ``heap`` returns a large
body's memory to the system. Imports
``cluster.control``; nothing in ``cluster.control`` imports this box.
"""
