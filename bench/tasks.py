"""Benchmark-only task, loaded with ``celery -A config worker -I bench.tasks -Q bench``.

A no-op under the product's delivery contract (acks_late, prefetch 1 from settings): the floor
that Celery + kombu + Redis put under any per-message work.
"""

from config.celery_app import app


@app.task(name="bench.noop", acks_late=True, ignore_result=True)
def noop(i: int = 0) -> None:
    return None
