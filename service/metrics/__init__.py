"""The service's metrics: one definition table, kept per process, merged at scrape time.

- `specs`: every exported metric, declared once (`SPECS`: name, type, labels, buckets);
- `process`: one process's values (`MetricSet`, `process_metrics()`) and the flusher that
  hands them to Ray's metrics off the request path (`enable_ray_metrics()`);
- `exposition`: merging replicas' snapshots and the Prometheus text of `GET /metrics`;
- `recorders`: what the GangServer and the JobManager count, over `process`.

Where values live: each process keeps its own cumulative values; ingress and gang server
replicas report snapshots to the app's Controller (service.state.fleet), which keeps them
in memory (a gone replica's counters folded into one "retired" snapshot); an ingress
answering `/metrics` merges them with its own live values. Import the module you need;
this package re-exports nothing.
"""
