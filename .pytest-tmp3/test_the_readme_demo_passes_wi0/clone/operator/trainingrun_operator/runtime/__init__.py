"""The operator's own controller runtime: the parts that do what a controller framework's runtime does, for any kind.

kopf logs in, runs peering and serves `/healthz`; the controller work itself is done here, on purpose:

- `kube`: the API client over aiohttp (kopf brings it): priority lanes (reconciles, status, Events and reviews
  wait in separate queues, so a flood of one kind never starves another), retries with Retry-After, bounded answers.
- `informer`: lists then watches runs, jobs and pods from the list's resourceVersion, with bookmarks; a 410 lists
  again. One watch per kind for the whole fleet (kopf's per-object handlers cost a task and its memory per run).
- `leadership`: which replica acts, from kopf's peering records, with a short lifetime for a replica that vanished.
- `rechecks`: when a run is reconciled without an event (its decision's due time, Warning Events, failed reconciles,
  a sweep), so nothing reconciles every run on a timer.

Why not kopf's handlers: at 20,000 runs its per-object watch streams and handler tasks held several hundred MB and a
reconcile per run per interval; measured in docs/performance.md. What a run *is* (api, builders, reconcile,
validation) stays outside: tests/unit/test_import_graph.py fails if a module here imports those.
"""
