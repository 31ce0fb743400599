"""cluster: the control plane, in three boxes by stage (imports point one way: http -> control;
operator may import both; control imports neither):

- ``cluster.http``: where a request enters. The Ray Serve ingress, the OpenAI and native handlers,
  body and field validation, API-key auth, error responses.
- ``cluster.control``: where it is planned and executed. Render -> plan (a pure function returning a
  frozen ``RequestPlan``) -> route -> run on a prefill and a decode worker, with health, sessions,
  registrations, shadow checks, metrics and the durable state store.
- ``cluster.operator``: what operators run. The ``kvnotes`` CLI, the launcher that starts Ray, workers
  and Serve, key/registration admin, the report, the Grafana dashboard and the demo.
"""
