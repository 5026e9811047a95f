"""Benchmark-only task, loaded with ``celery -A config worker -I bench.tasks -Q bench``; the
"bench" queue is declared and both tasks routed to it by the benchmark's settings
(``bench.arms.ROUTES``).

A no-op under the product's delivery contract (acks_late, prefetch 1 from settings): the floor
that Celery + kombu + Redis put under any per-message work. ``bench.wait`` sleeps a few
milliseconds, about what a release waits on PostgreSQL, so that the pool processes (not the
worker's main process, as with no-ops) are what limits a drain and prefetched messages pile up
in the worker as they do with releases.
"""

import time

from config.celery_app import app


@app.task(name="bench.noop", acks_late=True, ignore_result=True)
def noop(i: int = 0) -> None:
    return None


@app.task(name="bench.wait", acks_late=True, ignore_result=True)
def wait(ms: float = 3.0) -> None:
    time.sleep(ms / 1000)
