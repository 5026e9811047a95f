"""Operations: what the on-call reads and does. The console (health page, a hold's story,
/metrics gauges, /healthz), dead-letter triage, the pool autoscaler and capacity plan, the
worker's and web's metrics serving, and the admin's schedule preview. Above the release core
and the worker's edge; only the Django entry points (tasks, admin, commands) sit above it."""
